"""Checkpoints with their replay (atomic, the last N kept), resume by rerunning the same command, graceful stops.

Layout of `<run>/checkpoints/`:
    ckpt-<env steps>.pt                       model, optimizer, counters, RNG states and the replay manifest
    replay/<stream>/<first>-<end>-<tag>.pt    records [first, end) of one env stream (positions count every
                                              record the stream ever received), context included

The replay is saved incrementally: each checkpoint writes, per stream, only the records that arrived
since the previous one, as a new chunk file; its manifest lists the chunks that cover what the stream
still holds (its newest `capacity` records). A chunk is written once and never changed; chunks that no
kept checkpoint lists any more are deleted. A chunk carries each record's latent context as it was when
the chunk was written (later write-backs are not saved: rewriting every context at every checkpoint
would rewrite most of the replay, see README).

Every file is written to a temporary name in its folder, flushed, fsynced, renamed, and the folder
fsynced. The checkpoint file is written last, after its chunks are durable: its rename commits the
whole checkpoint. A crash leaves either the old set of checkpoints or the new one; chunks and
temporary files of a save that did not commit are removed at the next start. Corrupt checkpoints are
never deleted by the application.

Loading is `torch.load(weights_only=True)`: a checkpoint holds tensors, numbers, strings, lists and
dicts only (RNG states included), so a crafted file cannot run code.
"""

from __future__ import annotations

import errno
import os
import random
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

PREFIX, SUFFIX = "ckpt-", ".pt"
TMP_PREFIX = ".tmp-"
REPLAY = "replay"
FORMAT = 2  # 2: RNG states as tensors, the replay manifest (format 1 needed unpickling arbitrary objects)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message is one line for the user."""


class SaveError(RuntimeError):
    """A checkpoint could not be written (full disk, read-only folder); one line, earlier checkpoints intact."""


def folder(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints of a run, oldest first (the step is in the name, zero-padded)."""
    path = folder(run_dir)
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if p.name.startswith(PREFIX) and p.name.endswith(SUFFIX))


def step_of(path: Path) -> int:
    return int(Path(path).name[len(PREFIX):-len(SUFFIX)])


def _fsync_dir(path: Path) -> None:
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 64


def _atomic_save(obj, target: Path) -> None:
    """torch.save to a temporary file beside `target`, fsync, rename; SaveError (one line) on a full disk
    or a folder that cannot be written. The temporary file never outlives a failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=TMP_PREFIX, suffix=SUFFIX)
        with os.fdopen(fd, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
        tmp = None
        _fsync_dir(target.parent)
    except (OSError, RuntimeError) as error:  # torch.save reports a failed write as a RuntimeError
        cause = error if isinstance(error, OSError) else error.__cause__ or error.__context__
        # torch.save's zip writer reports a failed write as a RuntimeError without the OSError behind it.
        full = isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)
        if full or any(text in str(error) for text in ("unexpected pos", "file write failed")):
            free = shutil.disk_usage(target.parent).free
            raise SaveError(
                f"no space left in {target.parent}: the checkpoint needs about {_nbytes(obj) / 1e6:,.1f} MB and "
                f"{free / 1e6:,.1f} MB are free; free some space (or set run.dir elsewhere) and rerun the same "
                "command to resume from the last checkpoint") from None
        if isinstance(cause, OSError) and cause.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
            raise SaveError(f"cannot write to {target.parent} ({cause.strerror}); make it writable or set run.dir "
                            "elsewhere, then rerun the same command") from None
        raise
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def remove_leftovers(run_dir: Path) -> int:
    """Deletes temporary files of saves that never committed (a kill mid-save); returns how many."""
    removed = 0
    root = folder(run_dir)
    if root.is_dir():
        for path in root.rglob(f"{TMP_PREFIX}*"):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def _flat(records: TensorDictBase) -> dict[str, torch.Tensor]:
    return {"/".join(key) if isinstance(key, tuple) else key: value.contiguous()
            for key, value in records.items(include_nested=True, leaves_only=True)}


def _unflat(flat: dict[str, torch.Tensor]) -> TensorDictBase:
    length = next(iter(flat.values())).shape[0]
    return TensorDict({tuple(key.split("/")): value for key, value in flat.items()}, [length])


def _chunk_range(name: str) -> tuple[int, int]:
    first, end, _ = Path(name).name.split("-", 2)
    return int(first), int(end)


class Checkpointer:
    """Saves checkpoints, each with the replay records that arrived since the previous one, from a
    thread of its own: `save` snapshots the model state it is given (copies on the host) and returns;
    the thread reads each replay stream's new records under that stream's lock (sampling and other
    streams go on), writes the chunks, then the checkpoint file, then deletes what no kept checkpoint
    needs. The replay a checkpoint holds is each stream as it was when the thread reached it, at or
    after the checkpoint's step: nothing the checkpoint's counters account for is missing from it.

    `replay` needs `streams`, `capacity`, `snapshot(stream, since)` and `restore(stream, records, count)`
    (dreamer.replay.Replay); None saves no replay.
    """

    def __init__(self, run_dir: Path, keep: int, replay=None, progress: Callable[[str], None] | None = None):
        self.run_dir, self.keep, self.replay = Path(run_dir), keep, replay
        self.progress = progress or (lambda line: None)
        streams = replay.streams if replay is not None else 0
        self.saved = [0] * streams  # per stream: position up to which records are in chunk files
        self.chunks: list[list[str]] = [[] for _ in range(streams)]  # the newest manifest's chunks
        self.tag = secrets.token_hex(3)  # this process's chunks never take the name of another's
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dreamer-checkpoint")
        self._pending: Future | None = None
        self._manifests: dict[str, dict] = {}  # checkpoint name -> its replay manifest (for clean-up)
        self.last_seconds = 0.0  # the last save's time in the thread
        self.last_bytes = 0
        self._pinned: dict[int, torch.Tensor] = {}  # reused host copies of device tensors (see _to_host)

    def save(self, step: int, state: dict, wait: bool = False) -> Future:
        """Starts a checkpoint at `step` (after the previous one has committed); `wait` until it commits.
        Raises SaveError (one line) when this or the previous save failed."""
        self.wait()
        snapshot, copied = self._to_host(state)
        self._pending = self._thread.submit(self._write, step, snapshot, copied)
        if wait:
            self.wait()
        return self._pending

    def reserve(self, state: dict) -> None:
        """Allocates the pinned host copies of `state`'s device tensors now, at start-up: pinning about 3 GB
        (size200m) takes over a second, which the first save would otherwise hold the training loop for."""
        _, copied = self._to_host(state)
        if copied is not None:
            copied.synchronize()

    def wait(self) -> None:
        """Until the save in flight (if any) has committed; its error, if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _to_host(self, state) -> tuple:
        """(a copy of `state` on the host, the CUDA event its device copies end at, or None).

        Device tensors are copied into pinned buffers kept from one save to the next, without waiting:
        the copies are enqueued on the current stream, behind the update that produced the values and
        before the next one, which changes them; the thread waits for the event before writing. The
        training loop is not held up for the copies (at size200m about 3 GB)."""
        leaves: list[tuple[torch.Tensor, torch.Tensor]] = []

        def copy(value):
            if isinstance(value, torch.Tensor):
                if not value.is_cuda:
                    return value.detach().clone()
                key = len(leaves)
                buffer = self._pinned.get(key)
                if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                    buffer = self._pinned[key] = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                leaves.append((buffer, value))
                return buffer
            if isinstance(value, dict):
                return {k: copy(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(copy(v) for v in value)
            return value

        host = copy(state)
        if not leaves:
            return host, None
        with torch.no_grad():
            for buffer, value in leaves:
                buffer.copy_(value.detach(), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _write(self, step: int, state: dict, copied=None) -> Path:
        start = time.perf_counter()
        if copied is not None:
            copied.synchronize()
        root = folder(self.run_dir)
        manifest, written = None, 0
        saved, chunks = list(self.saved), [list(c) for c in self.chunks]
        if self.replay is not None:
            counts = []
            for stream in range(self.replay.streams):
                count, first, records = self.replay.snapshot(stream, saved[stream])
                if records is not None:
                    name = f"{stream:03d}/{first:012d}-{count:012d}-{self.tag}{SUFFIX}"
                    flat = _flat(records)
                    _atomic_save(flat, root / REPLAY / name)
                    written += _nbytes(flat)
                    chunks[stream].append(name)
                # The chunks the stream's newest `capacity` records lie in.
                oldest = count - self.replay.capacity
                chunks[stream] = [c for c in chunks[stream] if _chunk_range(c)[1] > oldest]
                saved[stream] = count
                counts.append(count)
            manifest = {"streams": self.replay.streams, "capacity": self.replay.capacity, "counts": counts,
                        "chunks": chunks}
        target = root / f"{PREFIX}{step:012d}{SUFFIX}"
        _atomic_save({"format": FORMAT, "step": step, **state, "replay": manifest}, target)
        self.saved, self.chunks = saved, chunks
        self._manifests[target.name] = manifest
        self._clean()
        self.last_seconds, self.last_bytes = time.perf_counter() - start, written + _nbytes(state)
        return target

    def _clean(self) -> None:
        """Keeps the newest `keep` checkpoints and the chunks their manifests list; nothing else of ours."""
        found = list_checkpoints(self.run_dir)
        for old in found[:-self.keep] if self.keep > 0 else []:
            old.unlink(missing_ok=True)
            self._manifests.pop(old.name, None)
        wanted = set()
        for path in list_checkpoints(self.run_dir):
            manifest = self._manifests.get(path.name)
            if manifest is None and path.name not in self._manifests:
                manifest = self._manifests[path.name] = read_manifest(path)
            for names in (manifest or {}).get("chunks", []):
                wanted.update(names)
        chunk_root = folder(self.run_dir) / REPLAY
        if chunk_root.is_dir():
            for path in chunk_root.glob(f"*/*{SUFFIX}"):
                if f"{path.parent.name}/{path.name}" not in wanted:
                    path.unlink(missing_ok=True)

    def restore(self, manifest: dict | None, path: Path) -> int:
        """Refills replay from the chunks `manifest` lists; returns the records restored. Each stream's
        newest record is then marked as an episode end (truncated): the resumed envs start new episodes."""
        if manifest is None or self.replay is None:
            return 0
        if manifest["streams"] != self.replay.streams:
            raise CheckpointError(f"{path} holds a replay of {manifest['streams']} env streams and this run has "
                                  f"{self.replay.streams}; resume with the run's run.envs")
        root, restored, started = folder(self.run_dir) / REPLAY, 0, time.monotonic()
        for stream, (count, names) in enumerate(zip(manifest["counts"], manifest["chunks"])):
            oldest = count - self.replay.capacity
            for name in names:
                first, end = _chunk_range(name)
                try:
                    records = _unflat(torch.load(root / name, map_location="cpu", weights_only=True, mmap=True))
                except Exception as error:
                    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
                    raise CheckpointError(f"replay chunk {root / name} of {path.name} is missing or corrupt "
                                          f"({reason}); resume from an older checkpoint with run.resume=PATH") from None
                if records.shape[0] != end - first:
                    raise CheckpointError(f"replay chunk {root / name} of {path.name} holds {records.shape[0]} "
                                          f"records, not {end - first}; resume from an older checkpoint")
                keep = records[max(0, oldest - first):]
                try:
                    self.replay.restore(stream, keep, end)
                except (RuntimeError, KeyError, ValueError) as error:
                    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
                    raise CheckpointError(f"the replay saved with {path.name} does not fit this run's records "
                                          f"({reason}); start a new run (another run.name)") from None
                restored += keep.shape[0]
            self.saved[stream], self.chunks[stream] = count, list(names)
            self.replay.end_stream(stream)
            if time.monotonic() - started > 5 and stream + 1 < self.replay.streams:
                self.progress(f"restoring replay: {stream + 1}/{self.replay.streams} streams, {restored:,} records")
                started = time.monotonic()
        self._manifests[Path(path).name] = manifest
        return restored

    def close(self) -> None:
        self._thread.shutdown(wait=True)


def read_manifest(path: Path) -> dict | None:
    """The replay manifest of a checkpoint, without reading its tensors (memory-mapped load)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("replay")
    except Exception:  # corrupt: it protects no chunk
        return None


def load(path: Path) -> dict:
    """Loads a checkpoint on the CPU (tensors and plain values only); CheckpointError names the file
    when it is unreadable."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated zip, wrong format, a pickled object that is not plain data
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        if "Weights only load failed" in reason or "weights_only" in reason:
            reason = "it holds objects other than tensors and plain values, which are never unpickled"
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
    """The RNG states as tensors and plain values (loadable with weights_only=True)."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["position"],
                         numpy["has_gauss"], numpy["gauss"]))
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))


def trim_metrics(run_dir: Path, step: int) -> int:
    """Drops the metrics.jsonl records newer than the checkpoint a run resumes from (they will be
    written again); returns how many. Rewritten through a temporary file and a rename."""
    import json

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            newer = json.loads(line).get("env_steps", 0) > step
        except ValueError:  # a line cut short by a kill: never a complete record
            newer = True
        if newer:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        tmp = path.with_name(f"{TMP_PREFIX}metrics.jsonl")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return dropped


# Settings that say how a run is executed or reported, not what it learns: a rerun may change them.
RUN_SETTINGS = ("run.name", "run.dir", "run.steps", "run.resume", "run.accept_changes", "run.log_every",
                "run.eval_every", "run.eval_episodes", "run.eval_envs", "run.eval_video", "run.save_every",
                "run.keep_checkpoints", "run.compile", "run.cudagraph", "run.fuse_kernels", "run.cudnn_benchmark",
                "run.precision", "run.threads", "run.collect", "run.chunk", "run.sync_every", "run.inference_wait_ms",
                "run.inference", "run.inference_threads", "run.worker_stall_s", "run.worker_start", "run.ray_address",
                "run.ray_env_cpus", "run.ray_env_memory_gb", "run.ray_envs_per_pump", "run.ray_pump", "replay.storage",
                "topology", "logger")


def _leaves(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_leaves(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


# Settings added after runs were made, at the value the code before them had: a run folder whose config.yaml
# predates one continues at that value, the same experiment.
# (loss.continue_target's default changed with it: a folder without it continues under the new default only
# with run.accept_changes=true, or as it was with loss.continue_target=flag.)
ADDED_SETTINGS = {"loss.two_hot": "symexp", "loss.actor_grad": "reinforce", "optimizer.agc_per_output": False,
                  "loss.continue_target": "flag", "run.state_precision": "fp32", "model.cnn_full_res": False,
                  "run.acting_precision": "fp32"}


def experiment_changes(old: dict, new: dict) -> list[str]:
    """`key: old -> new` for each setting that changes the experiment (anything but RUN_SETTINGS)."""
    before, after = _leaves(old), _leaves(new)
    changes = []
    for key in sorted(set(before) | set(after)):
        if any(key == s or key.startswith(s + ".") for s in RUN_SETTINGS):
            continue
        if key not in before and key in ADDED_SETTINGS and after.get(key) == ADDED_SETTINGS[key]:
            continue
        if before.get(key, "<unset>") != after.get(key, "<unset>"):
            changes.append(f"{key}: {before.get(key, '<unset>')} -> {after.get(key, '<unset>')}")
    return changes


def check_same_experiment(run_dir: Path, config: dict, accept: bool) -> list[str]:
    """Refuses (CheckpointError, one line) to continue a run folder whose config.yaml describes another
    experiment, unless `accept`; returns the accepted changes. Reads the folder, changes nothing."""
    from omegaconf import OmegaConf

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return []
    try:
        old = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as error:
        raise CheckpointError(f"{path} cannot be read ({str(error).splitlines()[0]}); move it away or choose "
                              "another run.name") from None
    changes = experiment_changes(old, config)
    if changes and not accept:
        shown = "; ".join(changes[:4]) + (f"; and {len(changes) - 4} more" if len(changes) > 4 else "")
        raise CheckpointError(
            f"{run_dir} holds a run with other settings ({shown}): give this run its own folder with "
            "run.name=NAME, or continue that run with the new settings by adding run.accept_changes=true")
    return changes


def write_config(run_dir: Path, text: str, overrides: list[str] | None = None) -> None:
    """Saves the resolved config as config.yaml (a different one already there is kept, renamed) and
    the command line's overrides as overrides.yaml."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    if path.exists() and path.read_text() != text:
        path.rename(run_dir / f"config.{time.strftime('%Y%m%d-%H%M%S')}.yaml")
    path.write_text(text)
    if overrides is not None:
        (run_dir / "overrides.yaml").write_text("".join(f"- {item}\n" for item in overrides))


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
