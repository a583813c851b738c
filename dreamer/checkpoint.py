"""Checkpoints (atomic, the last N kept), resume by rerunning the same command, and graceful stops.

A checkpoint is written to a temporary file in the same folder, flushed and fsynced, then renamed over
its final name and the folder fsynced: a crash leaves either the old set of files or the new one, never
a half-written checkpoint under a real name. Corrupt files are never deleted by the application.
"""

from __future__ import annotations

import os
import random
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

PREFIX, SUFFIX = "ckpt-", ".pt"
FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message is one line for the user."""


def folder(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints of a run, oldest first (the step is in the name, zero-padded)."""
    path = folder(run_dir)
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if p.name.startswith(PREFIX) and p.name.endswith(SUFFIX))


def save(run_dir: Path, step: int, state: dict, keep: int) -> Path:
    path = folder(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    target = path / f"{PREFIX}{step:012d}{SUFFIX}"
    fd, tmp = tempfile.mkstemp(dir=path, prefix=".tmp-", suffix=SUFFIX)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save({"format": FORMAT, "step": step, **state}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return target


def load(path: Path) -> dict:
    """Loads a checkpoint on the CPU; CheckpointError names the file when it is unreadable."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # truncated zip, wrong format, unpickling failure: all mean corrupt
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated ({reason})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} is not a dreamer checkpoint of format {FORMAT}")
    return state


def resume_state(run_dir: Path, resume: str) -> tuple[Path, dict] | None:
    """What to resume from, checked before anything is built.

    resume='auto': the newest checkpoint of the run, if any. If it is corrupt, the error names it and
    offers the newest intact one (`run.resume=PATH`); nothing is deleted. resume='never': no resume, and
    a run folder that already has checkpoints is refused. Any other value is a checkpoint path.
    """
    found = list_checkpoints(run_dir)
    if resume == "never":
        if found:
            raise CheckpointError(
                f"{folder(run_dir)} already holds checkpoints and run.resume=never; "
                "choose another run.name or run.dir, or resume with run.resume=auto"
            )
        return None
    if resume != "auto":
        path = Path(resume)
        return path, load(path)
    if not found:
        return None
    newest = found[-1]
    try:
        return newest, load(newest)
    except CheckpointError as error:
        for older in reversed(found[:-1]):
            try:
                load(older)
            except CheckpointError:
                continue
            raise CheckpointError(
                f"{error}; the previous checkpoint {older} is intact: rerun with run.resume={older} "
                f"(or move {newest.name} away)"
            ) from None
        raise CheckpointError(f"{error}; no intact checkpoint is left in {folder(run_dir)}") from None


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def write_config(run_dir: Path, text: str) -> None:
    """Saves the resolved config as config.yaml; a different one already there is kept, renamed."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    if path.exists() and path.read_text() != text:
        path.rename(run_dir / f"config.{time.strftime('%Y%m%d-%H%M%S')}.yaml")
    path.write_text(text)


class GracefulStop:
    """SIGINT / SIGTERM set a flag: the loop finishes its current update, saves and exits 0.

    A second signal restores the default handlers, so pressing Ctrl-C twice stops at once.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}

    def _handle(self, number, _frame):
        self.requested = signal.Signals(number).name
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def __enter__(self) -> GracefulStop:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def __bool__(self) -> bool:
        return self.requested is not None
