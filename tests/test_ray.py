"""Env workers as Ray actors (`run.collect=ray`, dreamer/ray_workers.py) on a local Ray cluster.

Real actors, a real local cluster (started by the pump, as a run without `run.ray_address` does) and
real signals: an actor's process is SIGKILLed as a node's loss or a crash would end it. Nothing is faked.
Skipped where the `ray` extra is not installed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from dreamer.inference import Inference
from dreamer.reaper import started_at
from dreamer.replay import Replay
from tests.conftest import ROOT
from tests.test_faults_workers import (ENV, SIZE, _agent, _alive, _bounded, _cmdline, _descendants, _environment,
                                       _receive_until, _until)

pytest.importorskip("ray")

from dreamer.ray_workers import RayPool  # noqa: E402  (after the skip: it needs no ray itself, its tests do)

pytestmark = pytest.mark.faults


def _actors(pool: RayPool) -> dict[int, str]:
    """{pid: start time} of the env actors' processes under the pool's pump (its local cluster)."""
    return {pid: started for pid, started in _descendants(pool.process.pid).items()
            if "ray::EnvWorker" in _cmdline(pid)}


def test_a_killed_actor_is_replaced_its_stream_ended_and_nothing_in_replay_lost():
    layout, agent = _agent()
    replay = Replay(2, 4000, 2, 4, torch.device("cpu"))
    inference = Inference(agent.policy, layout, SIZE, clients=2, device=torch.device("cpu")).start()
    ends, notes = [], []  # (stream, newest stored slot) at each replacement; the pool's lines

    def restarted(stream: int) -> None:
        ends.append((stream, len(replay.buffer._rbs[stream]) - 1))
        replay.end_stream(stream)

    pool = RayPool(ENV, 0, layout, SIZE, inference.clients, chunk=8, suite="gym", on_restart=restarted,
                   forget_slot=inference.forget_slot, announce=notes.append).start()
    cluster: dict[int, str] = {}
    try:
        _receive_until(pool, replay, lambda got: {0, 1} <= {c.stream for c in got}, seconds=240)
        assert any("2 Ray env workers on 1 node(s)" in note for note in notes), notes  # the placement, said
        cluster = _descendants(pool.process.pid)
        actors = _until(lambda: len(_actors(pool)) == 2 and _actors(pool), 60, "two actor processes")
        snapshots, stepped = [replay.stored(0), replay.stored(1)], list(pool.stepped)
        # Which actor serves stream 0 is Ray's business: kill one, and follow the stream that ends.
        victim = next(iter(actors))
        os.kill(victim, signal.SIGKILL)
        _bounded(lambda: _receive_until(pool, replay, lambda got: bool(ends) and len(
            replay.buffer._rbs[ends[0][0]]) > ends[0][1] + 1, seconds=240), 260, "the killed actor replaced")
        stream = ends[0][0]
        assert pool.restarts >= 1 and [s for s, _ in ends] == [stream]
        assert any(f"Ray env worker {stream} replaced" in note for note in notes), notes
        assert not _alive(victim)
        assert pool.stepped[1 - stream] > stepped[1 - stream]  # the other went on
        snapshot = snapshots[stream]
        stored = replay.stored(stream)[: snapshot.shape[0]]
        for key in ("state", "belief", "action", ("next", "observation"), ("next", "reward")):
            assert torch.equal(stored.get(key), snapshot.get(key)), key  # nothing already in replay is lost
        # Truncated after the last chunk the dead actor sent, however the pipe interleaved that chunk with
        # the replacement's notice; the replacement's first record starts a fresh episode.
        assert bool(replay.stored(stream)[ends[0][1]].get(("next", "done")))
        assert bool(replay.stored(stream)[ends[0][1] + 1].get("is_init"))
        cluster.update(_descendants(pool.process.pid))
    finally:
        pump = pool.process.pid
        _bounded(pool.close, 60, "closing the pool")
        inference.close()
        replay.close()
    # The pump ended its actors and its local cluster: nothing of it is left.
    assert not _alive(pump)
    left = [pid for pid, started in cluster.items() if _alive(pid) and started_at(pid) == started]
    assert not left, [_cmdline(pid) for pid in left]


def test_a_smoke_training_with_four_ray_workers_survives_a_killed_actor_and_leaves_no_process(tmp_path):
    """`python -m dreamer.train +exp=emulated +debug=smoke run.collect=ray run.envs=4 run.ray_envs_per_pump=2`:
    two pumps (the second joins the cluster the first starts), trains, an actor SIGKILLed mid-run is replaced,
    the run finishes, and no process of it (pumps, cluster, actors) is left."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "dreamer.train", "+exp=emulated", "+debug=smoke", "run.collect=ray",
               "run.envs=4", "run.ray_envs_per_pump=2", "run.chunk=16", "run.steps=1200", "env.step_latency=0.005",
               "run.eval_every=0", "run.eval_episodes=0", f"run.dir={run_dir}"]
    trainer = subprocess.Popen(command, cwd=ROOT, env=_environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    seen: dict[int, str] = {}
    try:
        def actors() -> dict[int, str]:
            found = _descendants(trainer.pid)
            seen.update(found)
            return {pid: s for pid, s in found.items() if "ray::EnvWorker" in _cmdline(pid)}

        _until(lambda: len(actors()) == 4, 300, "four actor processes")
        _until(lambda: trainer.poll() is not None or (run_dir / "metrics.jsonl").exists(), 300, "a first record")
        os.kill(next(iter(actors())), signal.SIGKILL)
        output, _ = trainer.communicate(timeout=600)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.communicate()
    assert trainer.returncode == 0, output[-3000:]
    assert "Ray env worker" in output and "replaced" in output, output[-3000:]
    assert "4 Ray env workers on 1 node(s)" in output and "2 pumps of up to 2 env workers" in output, output[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if r["kind"] == "train"]
    assert train and train[-1]["updates"] > 0 and train[-1]["env_steps"] >= 1200
    assert max(r.get("env/restarts", 0) for r in train) >= 1
    time.sleep(2)  # the reaper's last kills, if any were needed, happen as the trainer exits
    left = [pid for pid, started in seen.items() if _alive(pid) and started_at(pid) == started]
    assert not left, [_cmdline(pid) for pid in left]
