"""The fault paths of the worker processes and the inference server, with real processes and signals.

A stopped (SIGSTOP) worker, a SIGKILLed inference server, a SIGKILLed trainer under a subreaper and
`kill -9` of the trainer's whole process group. Every wait has a deadline, so a regression fails
instead of hanging. Processes are found through /proc: the descendants of a trainer, by parent pid.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from dreamer import reaper
from dreamer.agent import EnvLayout, build_agent
from dreamer.collect import CollectionError
from dreamer.workers import Ingest, WorkerPool
from dreamer.envs import make_env
from dreamer.inference import Inference
from dreamer.reaper import semaphore_prefix
from dreamer.replay import Replay
from tests.test_agent import _size
from tests.conftest import ROOT

pytestmark = pytest.mark.faults

SIZE = _size("size1m", deter=32, hidden=16, stoch=4, classes=4, depth=4, units=16, blocks=4)
ENV = {"suite": "gym", "task": "CartPole-v1", "max_episode_steps": 500}
# A short run of the emulated Minecraft env with 2 workers and the server in its own process; it would
# take hours to end by itself, so each test ends it.
RUN = ["+exp=emulated", "+debug=smoke", "env.step_latency=0.001", "run.inference=process", "run.chunk=16",
       "run.steps=100000", "run.save_every=100000", "run.eval_every=0", "run.name=faults"]


def _agent():
    env = make_env(OmegaConf.create(ENV), 0)
    layout = EnvLayout.from_specs(env.observation_spec, env.action_spec)
    env.close()
    torch.manual_seed(0)
    return layout, build_agent(layout, SIZE)


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (an orphan's zombie waits for whoever adopted it)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _descendants(root: int) -> dict[int, str]:
    """{pid: start time} of every process below `root`."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            parents[int(entry.name)] = (int(fields[1]), fields[19])
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, started) in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = started
                frontier.append(pid)
    return found


def _left(processes: dict[int, str]) -> list[int]:
    """Those of `processes` (pid: start time) still alive."""
    return [pid for pid, started in processes.items() if _alive(pid) and _stat(pid)[19] == started]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _until(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not within {seconds:.0f} s: {what}"
        time.sleep(0.2)
    return value


def _environment() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


def _training(run_dir: Path) -> bool:
    """The run has written a train record with updates (collection and training are both under way)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return False
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return any(r["kind"] == "train" and r["updates"] > 0 for r in records)


def _bounded(call, seconds: float, what: str):
    """`call()`'s result; fails after `seconds` s if it has not returned (a blocked read, a hung close)."""
    result: list = []

    def run() -> None:
        try:
            result.append((True, call()))
        except BaseException as error:
            result.append((False, error))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, f"not within {seconds:.0f} s: {what}"
    done, value = result[0]
    if not done:
        raise value
    return value


def _receive_until(pool: WorkerPool, replay: Replay, condition, seconds: float = 180.0) -> list:
    chunks = []
    deadline = time.monotonic() + seconds
    while not condition(chunks):
        assert time.monotonic() < deadline, f"no progress: {len(chunks)} chunks from {[c.stream for c in chunks]}"
        for chunk in pool.receive(timeout=1.0):
            replay.add_chunk(chunk.stream, chunk.records)
            chunks.append(chunk)
    return chunks


def _stop_with_a_chunk_waiting(pool: WorkerPool, index: int) -> None:
    """SIGSTOPs worker `index` once a chunk of it waits unread in its pipe. Reading that chunk then
    blocks the reader: its tensors come through the stopped worker (torch's fd sharing)."""
    _until(lambda: pool.pipes[index].poll(), 120, f"a chunk of worker {index} waiting")
    os.kill(pool.processes[index].pid, signal.SIGSTOP)


def test_the_run_names_its_semaphores_after_the_trainer():
    """dreamer.reaper finds a run's semaphores by their names: multiprocessing's private `semprefix`, the
    one place it touches, still names them."""
    reaper.guard()
    semaphore = multiprocessing.get_context("spawn").Semaphore(0)
    assert semaphore._semlock.name.startswith(semaphore_prefix(os.getpid()) + "-")


def test_a_stopped_worker_is_killed_and_restarted_while_the_other_goes_on():
    layout, agent = _agent()
    replay = Replay(2, 4000, 2, 4, torch.device("cpu"))
    inference = Inference(agent.policy, layout, SIZE, clients=2, device=torch.device("cpu")).start()
    ends = []  # (stream, newest stored slot) at each restart

    def restarted(stream: int) -> None:
        inference.forget_slot(stream)
        ends.append((stream, len(replay.buffer._rbs[stream]) - 1))
        replay.end_stream(stream)

    pool = WorkerPool(ENV, 0, layout, SIZE, inference.clients, chunk=8, suite="gym", on_restart=restarted).start()
    stopped = pool.processes[0]
    try:
        _receive_until(pool, replay, lambda got: {0, 1} <= {c.stream for c in got})
        _stop_with_a_chunk_waiting(pool, 0)
        snapshot, other = replay.stored(0), pool.stepped[1]
        pool.stall_seconds = 3.0  # once started (a worker's start-up alone takes seconds)

        def restarted_and_delivered(got: list) -> bool:
            if pool.stalls:  # the replacement's start-up alone may take longer than 3 s on a busy machine
                pool.stall_seconds = 600.0
            return bool(ends) and any(c.stream == 0 for c in got)

        after = _bounded(lambda: _receive_until(pool, replay, restarted_and_delivered), 200,
                         "the stopped worker restarted")
        assert pool.stalls == 1 and pool.restarts >= 1 and [stream for stream, _ in ends] == [0]
        assert not _alive(stopped.pid) and pool.processes[0] is not stopped
        # The other worker went on meanwhile, and its chunks arrived.
        assert pool.stepped[1] - other >= 16 and sum(c.stream == 1 for c in after) >= 2
        stored = replay.stored(0)[: snapshot.shape[0]]
        for key in ("state", "belief", "action", ("next", "observation"), ("next", "reward")):
            assert torch.equal(stored.get(key), snapshot.get(key)), key  # nothing already in replay is lost
        assert bool(replay.stored(0)[ends[0][1]].get(("next", "done")))  # truncated where it stopped
        assert bool(next(c for c in after if c.stream == 0).records.get("is_init")[0])  # a fresh episode
    finally:
        if _alive(stopped.pid):
            os.kill(stopped.pid, signal.SIGCONT)
        pool.close()
        inference.close()
        replay.close()


def test_closing_a_pool_with_a_stopped_worker_returns_at_once_and_leaves_no_process():
    """The ingest thread is blocked reading a stopped worker's chunk; Ingest.close then WorkerPool.close,
    the trainer's order, return in seconds and no worker is left, the stopped one included."""
    layout, agent = _agent()
    replay = Replay(2, 4000, 2, 4, torch.device("cpu"))
    inference = Inference(agent.policy, layout, SIZE, clients=2, device=torch.device("cpu")).start()
    pool = WorkerPool(ENV, 0, layout, SIZE, inference.clients, chunk=8, suite="gym").start()
    workers = [process.pid for process in pool.processes]
    ingest = Ingest(pool, replay)
    try:
        _receive_until(pool, replay, lambda got: {0, 1} <= {c.stream for c in got})
        _stop_with_a_chunk_waiting(pool, 0)
        ingest.start()
        _until(lambda: pool.blocked(2.0), 60, "the ingest thread blocked in the stopped worker's chunk")
        _bounded(lambda: (ingest.close(), pool.close()), 12, "closing")  # a bound on a hang, not a speed claim
        assert not [pid for pid in workers if _alive(pid)]
        assert not any(process.is_alive() for process in pool.processes)
        _until(lambda: not ingest.thread.is_alive(), 10, "the ingest thread ends")
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        ingest.close()
        pool.close()
        inference.close()
        replay.close()


def test_a_killed_inference_server_process_is_a_collection_error_for_every_call_of_the_trainer():
    """The calls the training loop makes on the server (weight sync, statistics) raise CollectionError,
    one line with the exit code: the loop saves a checkpoint and stops on that error."""
    layout, agent = _agent()
    inference = Inference(agent.policy, layout, SIZE, clients=1, device=torch.device("cpu"), process=True,
                          threads=3).start()
    try:
        assert inference.sync() and inference.sync.wait(60) and inference.stats()["inference/weight_syncs"] == 1
        # run.inference_threads reaches the server's process (3: neither the default of 1 nor torch's own here).
        assert inference.snapshot()[0]["threads"] == 3
        os.kill(inference.process.pid, signal.SIGKILL)
        inference.process.join(timeout=30)
        for call in (inference.sync, inference.stats, inference.sync):  # and again: no other error later
            with pytest.raises(CollectionError, match=r"^the inference server stopped \(exit code -9\)$"):
                call()
    finally:
        _bounded(inference.close, 30, "closing a dead server")


def _workers(run: dict[int, str]) -> list[int]:
    """The env workers among a run's processes: the children of the trainer's fork server."""
    forked = [pid for pid in run if "forkserver" in _cmdline(pid)]  # the server and its children
    return [pid for pid in forked if _stat(pid) is not None and int(_stat(pid)[1]) in forked]


def _server_pid(trainer: int) -> int:
    """The inference server: the trainer's first spawned child (the workers start once it is ready)."""
    spawned = [pid for pid in _descendants(trainer) if "spawn_main" in _cmdline(pid)
               and _stat(pid) is not None and int(_stat(pid)[1]) == trainer]
    return min(spawned, key=lambda pid: int(_stat(pid)[19]))


def test_a_killed_inference_server_stops_the_run_with_one_line_a_checkpoint_and_no_process_left(tmp_path):
    run_dir = tmp_path / "runs" / "faults"
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w+") as err:
        trainer = subprocess.Popen([sys.executable, "-m", "dreamer.train", *RUN], cwd=tmp_path, env=_environment(),
                                   stdout=out, stderr=err)
        try:
            _until(lambda: _training(run_dir) or trainer.poll() is not None, 300, "training started")
            assert trainer.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
            run = _descendants(trainer.pid)
            os.kill(_server_pid(trainer.pid), signal.SIGKILL)
            code = trainer.wait(timeout=120)
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
    stderr = [line for line in (tmp_path / "stderr").read_text().splitlines() if line.strip()]
    assert code == 3, "\n".join(stderr[-30:])
    assert len(stderr) == 1 and "inference server" in stderr[0] and "checkpoint saved" in stderr[0], stderr
    assert list((run_dir / "checkpoints").glob("ckpt-*.pt"))
    _until(lambda: not _left(run), 30, "the run's processes end")


@pytest.mark.parametrize("to", ["trainer", "group"])
def test_sigterm_with_a_stopped_worker_saves_and_exits_leaving_no_process(tmp_path, to):
    """SIGTERM to the trainer, or to its whole process group (the fork server, the server and the workers
    too: none of them may end before the trainer has saved)."""
    run_dir = tmp_path / "runs" / "faults"
    with open(tmp_path / "output", "w") as out:
        trainer = subprocess.Popen([sys.executable, "-m", "dreamer.train", *RUN], cwd=tmp_path, env=_environment(),
                                   stdout=out, stderr=out, start_new_session=True)
    run: dict[int, str] = {}
    try:
        _until(lambda: _training(run_dir) or trainer.poll() is not None, 300, "training started")
        assert trainer.poll() is None, (tmp_path / "output").read_text()[-3000:]
        run = _descendants(trainer.pid)
        os.kill(max(_workers(run), key=lambda pid: int(_stat(pid)[19])), signal.SIGSTOP)  # a worker
        time.sleep(1.0)
        (trainer.send_signal if to == "trainer" else lambda sig: os.killpg(trainer.pid, sig))(signal.SIGTERM)
        code = trainer.wait(timeout=90)  # one signal is enough: nothing waits on the stopped worker
        output = (tmp_path / "output").read_text()
        assert code == 0 and "SIGTERM received; saved at" in output, output[-3000:]
        assert "died" not in output and "restart" not in output, output[-3000:]
        assert list((run_dir / "checkpoints").glob("ckpt-*.pt"))
        _until(lambda: not _left(run), 30, "the run's processes end")
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait()
        for pid in _left(run):
            os.kill(pid, signal.SIGKILL)


SUBREAPER = textwrap.dedent("""
    import ctypes, os, subprocess, sys
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come here
    with open(sys.argv[1], "w") as out:
        trainer = subprocess.Popen([sys.executable, "-m", "dreamer.train", *sys.argv[2:]], stdout=out, stderr=out)
    print(trainer.pid, flush=True)
    sys.stdin.read()  # until the test is done, reaping every orphan meanwhile
""").strip()


def test_the_children_of_a_trainer_killed_under_a_subreaper_end_with_it(tmp_path):
    """Adopted by a subreaper, not by pid 1, the workers (a stopped one too), the server and the resource
    tracker still end."""
    run_dir = tmp_path / "runs" / "faults"
    helper = subprocess.Popen([sys.executable, "-c", SUBREAPER, str(tmp_path / "output"), *RUN], cwd=tmp_path,
                              env=_environment(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    trainer = None
    try:
        trainer = int(helper.stdout.readline())
        _until(lambda: _training(run_dir) or not _alive(trainer), 300, "training started")
        assert _alive(trainer), (tmp_path / "output").read_text()[-3000:]
        run = _descendants(trainer)
        workers = _workers(run)
        assert len(workers) >= 2 and any("spawn_main" in _cmdline(pid) for pid in run)  # and the server
        assert any("resource_tracker" in _cmdline(pid) for pid in run)
        os.kill(max(workers, key=lambda pid: int(_stat(pid)[19])), signal.SIGSTOP)  # a worker: it cannot look
        os.kill(trainer, signal.SIGKILL)
        _until(lambda: not _left(run), 30, "the trainer's children end")
    finally:
        if trainer is not None:
            for pid in _left(_descendants(helper.pid)):
                os.kill(pid, signal.SIGKILL)
        helper.stdin.close()
        helper.wait(timeout=30)


def test_kill_9_of_the_trainers_process_group_leaves_no_process_and_no_semaphore(tmp_path):
    run_dir = tmp_path / "runs" / "faults"
    shm = Path("/dev/shm")
    before = {path.name for path in shm.iterdir()}
    with open(tmp_path / "output", "w") as out:
        trainer = subprocess.Popen([sys.executable, "-m", "dreamer.train", *RUN], cwd=tmp_path, env=_environment(),
                                   stdout=out, stderr=out, start_new_session=True)
    try:
        _until(lambda: _training(run_dir) or trainer.poll() is not None, 300, "training started")
        assert trainer.poll() is None, (tmp_path / "output").read_text()[-3000:]
        run = _descendants(trainer.pid)
        # The run's semaphores carry the trainer's pid: other programs' semaphores on this machine are
        # told apart from them, and none of them is missed.
        ours = "sem." + semaphore_prefix(trainer.pid).lstrip("/") + "-"
        during = {path.name for path in shm.iterdir()} - before
        assert [name for name in during if name.startswith(ours)], during
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=30)
        _until(lambda: not _left(run), 30, "the run's processes end")
        _until(lambda: not [path for path in shm.iterdir() if path.name.startswith(ours)], 30,
               "the run's semaphores are unlinked")
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait()
