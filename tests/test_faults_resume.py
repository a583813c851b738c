"""The fault suite, resume side: kills at random moments then reruns, the replay in the checkpoint, safe
loading, a full disk, a read-only or file run folder, run identity, and replay memory.

Everything is real: the training command as a subprocess, SIGKILL, a tmpfs of a few hundred KB mounted
in a private mount namespace (`unshare -m`, so nothing stays mounted); nothing is faked.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from dreamer import checkpoint
from dreamer.replay import CONTEXT_DTYPE, Replay, record_bytes
from tests.conftest import ROOT, run_train

pytestmark = pytest.mark.faults

SMOKE = ["+debug=smoke", "run.eval_every=0"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


def _records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _tree(path: Path) -> dict[str, str]:
    """Every file under `path` with a hash of its content: what a failed start must leave unchanged."""
    return {str(p.relative_to(path)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _stream_records(step: int, streams: int) -> TensorDict:
    t = torch.tensor([1000.0 * s + step for s in range(streams)])
    return TensorDict({
        "t": t,
        "state": (t % 251).unsqueeze(-1).expand(streams, 3).clone(),  # exact in bf16
        "belief": -(t % 251).unsqueeze(-1).expand(streams, 2).clone(),
        "is_init": torch.zeros(streams, 1, dtype=torch.bool),
        "next": {"done": torch.zeros(streams, 1, dtype=torch.bool), "reward": t.unsqueeze(-1)},
    }, [streams])


def test_the_replay_comes_back_whole_from_incremental_chunks(tmp_path):
    """Three checkpoints with the streams wrapping between them: a new replay restored from the last one
    holds exactly the records the old one held (fields, context, order), only the last save's new
    records were written by it, chunks no kept checkpoint needs are deleted, and each stream's newest
    record ends its episode."""
    streams, size = 2, 24  # 12 records per stream
    replay = Replay(streams, size, 2, 3, torch.device("cpu"), seed=0)
    saver = checkpoint.Checkpointer(tmp_path, keep=1, replay=replay)
    step = 0
    for target in (5, 9, 30):  # the third save follows a full wrap of each stream
        while step < target:
            replay.add(_stream_records(step, streams))
            step += 1
        saver.save(step, {"counters": {"env_steps": step}}, wait=True)
    # The last save wrote the 12 records each stream still holds of the 21 that arrived since the second
    # (9 were overwritten before any save); the earlier chunks, listed by no kept checkpoint, are gone.
    chunks = sorted(p.name for p in (checkpoint.folder(tmp_path) / "replay" / "000").iterdir())
    assert [name.rsplit("-", 1)[0] for name in chunks] == ["000000000018-000000000030"]
    before = [replay.stored(s) for s in range(streams)]
    state = checkpoint.load(checkpoint.list_checkpoints(tmp_path)[-1])
    assert state["replay"]["counts"] == [30, 30]

    restored = Replay(streams, size, 2, 3, torch.device("cpu"), seed=0)
    loader = checkpoint.Checkpointer(tmp_path, keep=1, replay=restored)
    assert loader.restore(state["replay"], checkpoint.list_checkpoints(tmp_path)[-1]) == 24
    for stream in range(streams):
        old, new = before[stream], restored.stored(stream)
        order = old.get("t").argsort()  # slots differ after a restore; the records and their order do not
        assert torch.equal(new.get("t"), old.get("t")[order])
        for key in ("state", "belief", "is_init", ("next", "reward")):
            assert torch.equal(new.get(key), old.get(key)[order]), key
        assert new.get("state").dtype == CONTEXT_DTYPE
        done = new.get(("next", "done")).reshape(-1)
        assert done[-1] and not done[:-1].any()  # the newest record ends the stream's episode
    assert restored.appended == [30, 30]
    # The next save after a restore writes only what arrives after it.
    restored.add(_stream_records(30, streams))
    loader.save(31, {"counters": {"env_steps": 31}}, wait=True)
    newest = checkpoint.load(checkpoint.list_checkpoints(tmp_path)[-1])["replay"]
    assert [name.split("/")[1].rsplit("-", 1)[0] for name in newest["chunks"][0]] == [
        "000000000018-000000000030", "000000000030-000000000031"]
    for part in (saver, loader, replay, restored):
        part.close()


def test_record_bytes_counts_the_context_in_bf16():
    example = TensorDict({"state": torch.zeros(8), "belief": torch.zeros(8), "pixels": torch.zeros(3, dtype=torch.uint8)})
    assert record_bytes(example) == 16 * 2 + 3 + 16


def test_a_crafted_checkpoint_is_refused_and_runs_no_code(workdir):
    """A checkpoint file whose pickle would run code on load: refused in one line, the code never runs."""
    marker = workdir / "ran"
    args = SMOKE + ["run.name=crafted", "run.steps=128"]
    assert run_train(args, workdir).returncode == 0
    newest = checkpoint.list_checkpoints(workdir / "runs" / "crafted")[-1]

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"format": checkpoint.FORMAT, "step": 999, "payload": Payload()},
               newest.with_name("ckpt-000000000999.pt"))
    result = run_train(args + ["run.steps=2000"], workdir, timeout=120)
    assert result.returncode == 2 and not marker.exists()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "ckpt-000000000999.pt" in lines[0] and "never unpickled" in lines[0], result.stderr


def _start(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dreamer.train", *args], cwd=cwd, env=_env(),
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def test_sigkill_at_random_moments_then_rerun_always_resumes_from_an_intact_checkpoint(workdir):
    """20 SIGKILLs (FAULT_KILLS=N for more) of the whole process group at random moments (saves are every
    16 env steps, so many land during one), each followed by the same command: every rerun resumes from
    the newest intact checkpoint with every replay record it holds, leaves no temporary file, and the
    finished run's metrics have no record twice."""
    kills = int(os.environ.get("FAULT_KILLS", "20"))
    rng = random.Random(0)
    run = workdir / "runs" / "kill"
    base = SMOKE + ["run.name=kill", "run.save_every=16", "run.log_every=16", "run.keep_checkpoints=2",
                    "run.train_start=32"]
    args = base + ["run.steps=100000"]
    resumed = 0
    for attempt in range(kills):
        expected = None
        found = checkpoint.list_checkpoints(run)
        if found:
            state = checkpoint.load(found[-1])  # the newest is intact: a commit is a rename
            expected = (checkpoint.step_of(found[-1]),
                        sum(min(count, state["replay"]["capacity"]) for count in state["replay"]["counts"]))
        log = workdir / f"attempt-{attempt}.log"
        process = _start(args, workdir, log)
        deadline = time.monotonic() + 120
        while "env steps" not in log.read_text() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # until it reports progress (started, maybe resumed)
        while not checkpoint.list_checkpoints(run) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # the first run: until there is a checkpoint to come back to
        time.sleep(rng.uniform(0.0, 3.0))
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        out = log.read_text()
        assert "Traceback" not in out and "error:" not in out, out[-3000:]
        if expected is not None:
            step, records = expected
            assert f"at {step:,} env steps with {records:,} replay records" in out, (expected, out[-2000:])
            resumed += 1
    newest = checkpoint.list_checkpoints(run)[-1]
    last, state = checkpoint.step_of(newest), checkpoint.load(newest)
    records = sum(min(count, state["replay"]["capacity"]) for count in state["replay"]["counts"])
    final = run_train(base + [f"run.steps={last + 32}"], workdir)
    assert final.returncode == 0, final.stderr[-3000:]
    assert f"at {last:,} env steps with {records:,} replay records" in final.stdout
    resumed += 1
    assert resumed == kills  # every kill came after a first checkpoint: every rerun resumed from the newest
    print(f"{kills} kills: {resumed} reruns resumed from the newest checkpoint, each with its replay")
    assert not list(checkpoint.folder(run).rglob(".tmp-*"))
    train = [r["env_steps"] for r in _records(run) if r["kind"] == "train"]
    assert train == sorted(set(train))  # no record twice: the ones newer than a resumed checkpoint were dropped
    # Only chunks that a kept checkpoint lists are left.
    listed = {name for path in checkpoint.list_checkpoints(run) for names in checkpoint.read_manifest(path)["chunks"]
              for name in names}
    on_disk = {f"{p.parent.name}/{p.name}" for p in (checkpoint.folder(run) / "replay").glob("*/*.pt")}
    assert on_disk == listed


def _unshare() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


needs_mounts = pytest.mark.skipif(not _unshare(), reason="needs root and mount namespaces (unshare -m) for a tmpfs")


@needs_mounts
def test_a_full_disk_stops_the_run_in_one_line_and_keeps_the_earlier_checkpoints(workdir):
    """The run folder on a 1.2 MB tmpfs: the first checkpoints fit, a later one does not."""
    script = (f"mount -t tmpfs -o size=1200k tmpfs {workdir}/runs && "
              f"{sys.executable} -m dreamer.train {' '.join(SMOKE)} run.name=full run.steps=100000 run.save_every=32 "
              f"run.keep_checkpoints=100; code=$?; ls -a {workdir}/runs/full/checkpoints > {workdir}/listing; "
              f"cp -r {workdir}/runs/full {workdir}/copy; exit $code")
    (workdir / "runs").mkdir()
    result = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=workdir, env=_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 3, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no space left in "), result.stderr[-3000:]
    assert "runs/full/checkpoints" in lines[0] and "MB are free" in lines[0]
    listing = (workdir / "listing").read_text().split()
    assert not [name for name in listing if name.startswith(".tmp-")]
    saved = checkpoint.list_checkpoints(workdir / "copy")
    assert saved and all(checkpoint.load(path)["format"] == checkpoint.FORMAT for path in saved)


@needs_mounts
def test_a_read_only_run_folder_is_one_line(workdir):
    script = f"mount -t tmpfs -o ro,size=64k tmpfs {workdir}/runs && {sys.executable} -m dreamer.train {' '.join(SMOKE)} run.name=ro"
    (workdir / "runs").mkdir()
    result = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=workdir, env=_env(), capture_output=True,
                            text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "read-only" in lines[0], result.stderr[-3000:]


def test_a_run_folder_that_is_a_file_is_one_line(workdir):
    (workdir / "runs").mkdir()
    (workdir / "runs" / "afile").write_text("not a folder")
    result = run_train(SMOKE + ["run.name=afile"], workdir, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "is a file" in lines[0], result.stderr[-3000:]


def test_presets_get_folders_of_their_own():
    from hydra import compose, initialize_config_dir

    from dreamer.config import CONFIG_DIR

    names = {}
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        for preset in ("dmc_proprio", "dmc_vision", "dmc_proprio_paper", "dmc_vision_paper", "atari", "atari100k",
                       "crafter", "reference"):
            names[preset] = compose(config_name="config", overrides=[f"+exp={preset}"]).run.name
        names["default"] = compose(config_name="config").run.name
    assert len(set(names.values())) == len(names), names
    assert names["dmc_vision"] == "dmc_vision-walker_walk-size200m-seed0"


def test_a_rerun_with_other_settings_stops_before_touching_the_folder(workdir):
    run = workdir / "runs" / "same"
    args = SMOKE + ["run.name=same", "run.steps=128"]
    assert run_train(args, workdir).returncode == 0
    before = _tree(run)
    result = run_train(args + ["optimizer.lr=1e-3", "model.units=32"], workdir, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert "optimizer.lr: 0.0002 -> 0.001" in lines[0] and "model.units: 16 -> 32" in lines[0]
    assert "run.name=" in lines[0] and "run.accept_changes=true" in lines[0]
    assert _tree(run) == before  # config.yaml, metrics, checkpoints: nothing changed
    # Settings that do not change the experiment may change; extending the run resumes it.
    result = run_train(args[:-1] + ["run.steps=192", "run.log_every=32", "run.keep_checkpoints=5"], workdir)
    assert result.returncode == 0 and "resumed from" in result.stdout, result.stderr[-3000:]
    # Accepting the change continues the run and keeps the old config beside the new one.
    result = run_train(args[:-1] + ["run.steps=256", "optimizer.lr=1e-3", "run.accept_changes=true"], workdir)
    assert result.returncode == 0 and "continuing" in result.stdout and "optimizer.lr" in result.stdout
    assert list(run.glob("config.*.yaml"))


def test_a_finished_run_says_so_and_evaluates_nothing_again(workdir):
    run = workdir / "runs" / "done"
    args = SMOKE + ["run.name=done", "run.steps=128", "run.eval_episodes=1"]
    assert run_train(args, workdir).returncode == 0
    finals = [r for r in _records(run) if r["kind"] == "final_eval"]
    result = run_train(args, workdir, timeout=120)
    assert result.returncode == 0 and "run done already finished" in result.stdout
    assert "128 of 128 env steps" in result.stdout and f"folder: {run}" in result.stdout
    assert f"final evaluation: return {finals[0]['eval/return_mean']:.2f} mean" in result.stdout
    assert [r for r in _records(run) if r["kind"] == "final_eval"] == finals


def test_a_failed_start_leaves_no_empty_folder(workdir):
    result = run_train(SMOKE + ["run.name=never", "replay.storage=tape"], workdir, timeout=120)
    assert result.returncode == 2 and "replay.storage must be memory or disk" in result.stderr
    assert not (workdir / "runs" / "never").exists()


def test_a_replay_larger_than_memory_is_refused_before_it_is_allocated(workdir):
    result = run_train(SMOKE + ["run.name=huge", "replay.size=2000000000000"], workdir, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert "replay.size=2,000,000,000,000 needs" in lines[0] and "lower replay.size to at most" in lines[0]
    assert "replay.storage=disk" in lines[0]


def test_a_replay_on_disk_trains_and_resumes(workdir):
    args = SMOKE + ["run.name=disk", "run.steps=128", "replay.storage=disk"]
    result = run_train(args, workdir)
    assert result.returncode == 0 and "memory-mapped files" in result.stdout, result.stderr[-3000:]
    assert not list((workdir / "runs" / "disk" / "replay-mmap").glob("*"))  # unlinked once mapped
    result = run_train(args[:-2] + ["run.steps=192", "replay.storage=disk"], workdir)
    assert result.returncode == 0 and "with 128 replay records" in result.stdout, result.stderr[-3000:]


def test_a_snapshot_racing_inserts_returns_consecutive_records_the_replay_held():
    """Inserts between the pieces of a snapshot evict its oldest records: it returns a run of consecutive
    positions, all of which replay held, ending where the call began."""
    replay = Replay(1, 10, 1, 3, torch.device("cpu"), seed=0)
    for step in range(10):
        replay.add(_stream_records(step, 1))
    member = replay.buffer._rbs[0]
    real_lock, entered = member._replay_lock, []

    # Inserts before the lock's 3rd, 4th and 5th takes (the 1st reads the count, the 2nd is the length
    # torchrl reads under it): the first piece copied is [1, 4); then 4 inserts evict up to position 5,
    # past that piece, which must be dropped; the last piece is [8, 10).
    inserts = {2: 1, 3: 4, 4: 1}

    class InsertingLock:
        """The stream's lock, with inserts just before some of its takes."""

        def __enter__(self):
            member._replay_lock = real_lock
            for _ in range(inserts.get(len(entered), 0)):
                replay.add(_stream_records(replay.appended[0], 1))
            member._replay_lock = self
            entered.append(1)
            return real_lock.__enter__()

        def __exit__(self, *exc):
            return real_lock.__exit__(*exc)

    member._replay_lock = InsertingLock()
    count, first, records = replay.snapshot(0, 0, piece=3)
    member._replay_lock = real_lock
    t = records.get("t").tolist()
    assert count == 10 and first == 5 and t == [float(p) for p in range(5, 10)]
    replay.close()


def test_a_setting_added_since_a_run_was_made_is_no_change_at_the_value_the_run_had():
    """A run folder whose config.yaml predates `loss.actor_grad` ran REINFORCE, as `reinforce` does: its
    resume is the same experiment; `backprop` is another one."""
    from dreamer.checkpoint import experiment_changes

    old = {"loss": {"entropy": 3e-4}, "seed": 0}
    assert experiment_changes(old, {"loss": {"entropy": 3e-4, "actor_grad": "reinforce"}, "seed": 0}) == []
    assert experiment_changes(old, {"loss": {"entropy": 3e-4, "actor_grad": "backprop"}, "seed": 0}) == [
        "loss.actor_grad: <unset> -> backprop"]
    assert experiment_changes(old, {"loss": {"entropy": 3e-4, "lmbda": 0.95}, "seed": 0}) == [
        "loss.lmbda: <unset> -> 0.95"]  # a setting not in the table still counts


def test_a_run_folder_made_before_a_run_setting_existed_resumes_as_the_same_experiment():
    """A real run's config.yaml (the image run of learning/sets, made before `run.fuse_kernels` existed)
    against today's config composed from the same overrides: no experiment change, so its resume is not
    refused. A setting added later must be a run setting or have its earlier value in ADDED_SETTINGS."""
    from omegaconf import OmegaConf

    from dreamer.checkpoint import experiment_changes
    from dreamer.config import compose_config

    folder = Path(__file__).resolve().parents[1] / "learning/sets/dmc_vision_paper/walker_walk-seed0"
    old = OmegaConf.to_container(OmegaConf.load(folder / "config.yaml"), resolve=False)
    overrides = [str(line) for line in OmegaConf.load(folder / "overrides.yaml")]
    new = OmegaConf.to_container(compose_config(overrides), resolve=False)
    assert "fuse_kernels" not in old["run"] and "fuse_kernels" in new["run"]
    # Its continue head learned the flag, before loss.continue_target existed; the default is the reference's
    # target since: resumed as it was with the setting given, refused (a change of experiment) without it.
    assert experiment_changes(old, new) == ["loss.continue_target: <unset> -> discounted"]
    as_made = OmegaConf.to_container(compose_config([*overrides, "loss.continue_target=flag"]), resolve=False)
    assert experiment_changes(old, as_made) == []

