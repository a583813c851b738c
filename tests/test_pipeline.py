"""Collection at scale on CPU: the inference server, its weight sync, env worker processes and their faults.

Everything here is real: torchrl's inference server with the process-slot transport, spawned worker
processes running gymnasium's CartPole, SIGKILL. Only the inference server's death is provoked, by
shutting its thread down from outside (nothing in the product can make it die on purpose).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from torchrl.envs import ExplorationType, set_exploration_type

import dreamer.inference as inference_module
import dreamer.train as train_module
from dreamer.agent import EnvLayout, build_agent
from dreamer.workers import WorkerPool
from dreamer.config import CONFIG_DIR, compose_config
from dreamer.envs import make_env
from dreamer.inference import Inference, request_spec
from dreamer.replay import Replay
from tests.test_agent import _size
from tests.conftest import ROOT, run_train

SIZE = _size("size1m", deter=32, hidden=16, stoch=4, classes=4, depth=4, units=16, blocks=4)
ENV = {"suite": "gym", "task": "CartPole-v1", "max_episode_steps": 500}


def _agent():
    env = make_env(OmegaConf.create(ENV), 0)
    layout = EnvLayout.from_specs(env.observation_spec, env.action_spec)
    env.close()
    torch.manual_seed(0)
    return layout, build_agent(layout, SIZE)


def _request(layout: EnvLayout, seed: int) -> TensorDict:
    generator = torch.Generator().manual_seed(seed)
    request = request_spec(layout, SIZE)
    for key, value in request.items(include_nested=True, leaves_only=True):
        if value.is_floating_point():
            value.copy_(torch.randn(value.shape, generator=generator))
    request.set("is_init", torch.zeros(1, dtype=torch.bool))
    return request


def _direct(agent, request: TensorDict) -> TensorDict:
    torch.manual_seed(7)
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        return agent.policy(request.unsqueeze(0).clone()).get("policy")[0].apply(lambda x: x.float())


def _served(client, request: TensorDict) -> TensorDict:
    """The server's answer; the posterior's latent is sampled in any mode, from the same seed as _direct."""
    torch.manual_seed(7)  # the server thread draws from the process's default generator
    return client(request)


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_the_server_answers_like_the_policy_and_sees_new_weights_only_after_a_sync(process):
    layout, agent = _agent()
    inference = Inference(agent.policy, layout, SIZE, clients=2, device=torch.device("cpu"), explore=False,
                          process=process).start()
    # The posterior's latent is sampled in any mode; a server in its own process draws from its own
    # generator, so there only the belief (a function of the request and the weights) is compared.
    keys = ["belief"] if process else ["state", "belief", "action"]
    try:
        client = inference.clients[0]
        request = _request(layout, 1)
        before = _direct(agent, request).select(*keys)
        torch.testing.assert_close(_served(client, request).get("policy").select(*keys), before,
                                   rtol=1e-5, atol=1e-5)
        with torch.no_grad():  # the learner's update, in place
            for parameter in agent.policy.parameters():
                parameter.add_(0.3 * torch.randn_like(parameter))
        after = _direct(agent, request).select(*keys)
        assert not torch.allclose(after.get("belief"), before.get("belief"))
        torch.testing.assert_close(_served(client, request).get("policy").select(*keys), before,
                                   rtol=1e-5, atol=1e-5)  # its own copy: unchanged until a sync
        assert inference.sync() and inference.sync.wait()
        torch.testing.assert_close(_served(client, request).get("policy").select(*keys), after,
                                   rtol=1e-5, atol=1e-5)
        assert inference.stats()["inference/weight_syncs"] == 1
    finally:
        inference.close()


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_clients_asking_at_once_each_get_the_answer_to_their_own_request(process):
    """Passes of several rows: every request's row is gathered, answered and scattered to its own slot."""
    layout, agent = _agent()
    inference = Inference(agent.policy, layout, SIZE, clients=5, device=torch.device("cpu"), explore=False,
                          process=process, batch_wait=0).start()
    try:
        requests = [_request(layout, 20 + i) for i in range(5)]
        answers: list = [None] * 5

        def ask(i: int) -> None:
            for _ in range(20):
                answers[i] = inference.clients[i](requests[i]).get(("policy", "belief"))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(5)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        for i in range(5):
            torch.testing.assert_close(answers[i], _direct(agent, requests[i]).get("belief"), rtol=1e-5, atol=1e-5)
        assert inference.stats()["inference/batch"] > 1  # some passes served more than one request
    finally:
        inference.close()


def _receive_until(pool: WorkerPool, replay: Replay, condition, seconds: float = 180.0) -> list:
    chunks = []
    deadline = time.monotonic() + seconds
    while not condition(chunks):
        assert time.monotonic() < deadline, f"no progress: {len(chunks)} chunks from {[c.stream for c in chunks]}"
        for chunk in pool.receive(timeout=1.0):
            replay.add_chunk(chunk.stream, chunk.records)
            chunks.append(chunk)
    return chunks


def test_workers_send_consecutive_chunks_and_a_killed_worker_is_restarted_losing_nothing_in_replay():
    layout, agent = _agent()
    replay = Replay(2, 4000, 2, 4, torch.device("cpu"))
    inference = Inference(agent.policy, layout, SIZE, clients=2, device=torch.device("cpu")).start()
    ends = []  # (stream, newest stored slot) at each restart

    def restarted(stream: int) -> None:
        inference.forget_slot(stream)
        ends.append((stream, len(replay.buffer._rbs[stream]) - 1))
        replay.end_stream(stream)

    pool = WorkerPool(ENV, 0, layout, SIZE, inference.clients, chunk=8, suite="gym", on_restart=restarted).start()
    try:
        first = _receive_until(pool, replay, lambda got: sum(c.stream == 0 for c in got) >= 2)
        for chunk in first:
            records = chunk.records
            assert records.shape[0] == 8 and records.get("is_init").shape == (8, 1)
            # Consecutive: the carry of record t + 1 is the posterior after record t, so within an
            # episode the previous action stored in t + 1 is the one chosen at t (never all zero).
            continuing = ~records.get("is_init")[1:, 0]
            assert (records.get("action")[1:][continuing].sum(-1) == 1).all()
        assert any(c.records.get("is_init").any() for c in first if c.stream == 0)  # the worker's first reset
        snapshot = replay.stored(0)

        os.kill(pool.processes[0].pid, signal.SIGKILL)
        # The replacement's first chunk: the first of stream 0 from a receive that began after the restart
        # (the dead worker's pipe is gone by then; one receive can return several chunks of a stream).
        replacement, deadline = [], time.monotonic() + 180.0
        while not replacement:
            assert time.monotonic() < deadline, "no chunk from the replacement worker"
            restarted = bool(ends)
            for chunk in pool.receive(timeout=1.0):
                replay.add_chunk(chunk.stream, chunk.records)
                if restarted and chunk.stream == 0:
                    replacement.append(chunk)
        assert pool.restarts >= 1 and [stream for stream, _ in ends] == [0]
        stored = replay.stored(0)[: snapshot.shape[0]]
        end_slot = ends[0][1]
        assert end_slot >= snapshot.shape[0] - 1
        for key in ("state", "belief", "action", ("next", "observation"), ("next", "reward")):
            assert torch.equal(stored.get(key), snapshot.get(key)), key  # nothing already in replay is lost
        assert bool(replay.stored(0)[end_slot].get(("next", "done")))  # truncated there
        assert bool(replacement[0].records.get("is_init")[0])  # the replacement starts a fresh episode
    finally:
        pool.close()
        inference.close()


@pytest.mark.parametrize("service,start", [("thread", "forkserver"), ("process", "spawn")])
def test_a_smoke_run_with_four_workers_trains_and_logs_the_server(workdir, service, start):
    result = run_train(["+debug=smoke", "run.name=workers", "run.collect=workers", "run.envs=4", "run.chunk=16",
                        "run.steps=384", "run.train_start=192", "run.sync_every=2", f"run.inference={service}",
                        f"run.worker_start={start}"], workdir, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    where = "its own process" if service == "process" else "a thread"
    assert f"4 env worker processes, inference server on cpu ({where}, ready in " in result.stdout
    assert result.stdout.count("all 4 env workers stepping ") == 1  # the start-up's cost, said once
    records = [json.loads(line) for line in (workdir / "runs" / "workers" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert train[-1]["env_steps"] >= 384 and train[-1]["updates"] > 0
    assert train[-1]["inference/weight_syncs"] >= 1 and train[-1]["inference/batch"] >= 1
    assert train[-1]["inference/p99_ms"] >= train[-1]["inference/p50_ms"] > 0
    assert train[-1]["inference/queue_ms"] >= 0
    # The policy's round trip split: the server's part (submission to ring) and the worker's wake-up, both
    # inside the round trip the worker timed around its request.
    timed = [r for r in train if "collect/served_ms" in r]
    assert timed and all(r["collect/served_ms"] > 0 and r["collect/wake_ms"] >= 0 for r in timed)
    assert all(r["collect/served_ms"] + r["collect/wake_ms"] <= r["collect/policy_ms"] + 1e-6 for r in timed)
    # A record's window can hold chunks that were collected before it began (no pass or update in it):
    # busy is checked over the run, not in the last record alone.
    for key in ("inference/busy", "learner/busy"):
        assert all(r[key] >= 0 for r in train) and any(r[key] > 0 for r in train), key
    assert all(r["learner/busy"] <= 1.01 for r in train)
    # scripts/run_figures.py: the same records split at the first update
    figures = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_figures.py"), "runs/workers"], cwd=workdir,
                             capture_output=True, text=True, timeout=120)
    assert figures.returncode == 0, figures.stderr
    line = json.loads(figures.stdout)
    assert line["collecting"]["updates_per_s"] == 0 and line["training"]["updates_per_s"] > 0
    assert line["training_over_collecting"] > 0 and line["training"]["learner/busy"] > 0
    alone = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_figures.py"), "runs/workers", "--collecting"],
                           cwd=workdir, capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0, alone.stderr
    alone = json.loads(alone.stdout)
    assert alone["collecting"] == line["collecting"] and "training" not in alone
    assert alone["collecting_env_steps_per_s_mean"] > 0
    assert any(r["kind"] == "final_eval" for r in records)


@pytest.fixture
def smoke_cfg(tmp_path):
    return compose_config([
        "+debug=smoke", "run.collect=workers", "run.envs=2", "run.chunk=8", "run.steps=100000",
        f"run.dir={tmp_path / 'run'}", "run.eval_every=0", "run.name=dies", "logger.wandb=false"])


def test_the_inference_server_dying_stops_training_with_a_message_and_a_checkpoint(smoke_cfg, monkeypatch):
    class Dying(Inference):
        def start(self):  # the server thread stops after its 20th batch (provoked from outside)
            super().start()

            def stop_later():
                deadline = time.monotonic() + 120  # never let a slow machine turn this into a hang
                while self.server.stats()["batches"] < 20 and time.monotonic() < deadline:
                    time.sleep(0.05)
                self.server.shutdown()

            threading.Thread(target=stop_later, daemon=True).start()
            return self

    monkeypatch.setattr(inference_module, "Inference", Dying)
    with pytest.raises(train_module.RunError, match="the inference server stopped .*checkpoint saved at"):
        train_module.train(smoke_cfg)
    assert list((Path(smoke_cfg.run.dir) / "checkpoints").glob("ckpt-*.pt"))


def _unbuildable_pool(layout: EnvLayout, inference: Inference) -> WorkerPool:
    """One worker whose env cannot be created: it gives up after 2 attempts."""
    broken = {**ENV, "task": "NoSuchTask-v0"}
    return WorkerPool(broken, 0, layout, SIZE, inference.clients, chunk=8, suite="gym", max_restarts=2).start()


def _raises_within(step, error: type[BaseException], match: str, seconds: float = 120) -> None:
    """Calls `step` until it raises `error` with a message matching `match`; fails after `seconds`."""
    deadline = time.monotonic() + seconds
    with pytest.raises(error, match=match):
        while time.monotonic() < deadline:
            step()


def test_a_worker_whose_env_cannot_be_created_stops_collection_in_one_line():
    from dreamer.collect import CollectionError

    layout, agent = _agent()
    inference = Inference(agent.policy, layout, SIZE, clients=1, device=torch.device("cpu")).start()
    pool = _unbuildable_pool(layout, inference)
    try:
        _raises_within(lambda: pool.receive(timeout=1.0), CollectionError,
                       r"gym env 0 could not be created 2 times in a row, last with \w+")
    finally:
        pool.close()
        inference.close()


def test_the_ingest_thread_fills_replay_hands_over_every_step_and_then_the_collection_error():
    """Real worker processes: the thread adds a healthy worker's chunks to replay and `take` counts each
    added step exactly once; with a worker whose env cannot be created, `take` raises its one line."""
    from dreamer.collect import CollectionError
    from dreamer.workers import Ingest

    layout, agent = _agent()
    replay = Replay(2, 4000, 2, 4, torch.device("cpu"))
    inference = Inference(agent.policy, layout, SIZE, clients=1, device=torch.device("cpu")).start()
    pool = WorkerPool(ENV, 0, layout, SIZE, inference.clients, chunk=8, suite="gym").start()
    ingest = Ingest(pool, replay, alive=lambda: inference.alive).start()
    taken, deadline = 0, time.monotonic() + 120
    try:
        while taken < 24:
            assert time.monotonic() < deadline, f"only {taken} steps arrived"
            steps, episodes = ingest.take(timeout=1.0)
            taken += steps
            assert all(episode.length > 0 for episode in episodes)
        ingest.close()
        taken += ingest.take(timeout=0)[0]  # what arrived while it stopped
        assert taken == replay.added == len(replay) and taken % 8 == 0
        # Backpressure: with 8 steps not taken, the thread reads no more (one read takes at most a chunk
        # per worker), however far ahead the worker could run meanwhile.
        ingest = Ingest(pool, replay, max_pending=8).start()
        time.sleep(3.0)
        assert 8 <= ingest.take(timeout=0)[0] <= 8 + 8
        assert ingest.take(timeout=60)[0] > 0  # taking lets it go on
    finally:
        ingest.close()
        pool.close()
    pool = _unbuildable_pool(layout, inference)
    ingest = Ingest(pool, replay).start()
    try:
        _raises_within(lambda: ingest.take(timeout=1.0), CollectionError,
                       r"gym env 0 could not be created 2 times in a row")
    finally:
        ingest.close()
        pool.close()
        inference.close()
        replay.close()


def test_a_worker_whose_chunks_wait_unread_is_not_taken_for_hung():
    """The trainer reads nothing for twice the stall limit (an evaluation, say) while the worker's chunks
    wait in its pipe: the worker is not killed."""
    layout, agent = _agent()
    inference = Inference(agent.policy, layout, SIZE, clients=1, device=torch.device("cpu")).start()
    pool = WorkerPool(ENV, 0, layout, SIZE, inference.clients, chunk=8, suite="gym").start()
    try:
        deadline = time.monotonic() + 120
        while not pool.receive(timeout=1.0):
            assert time.monotonic() < deadline, "no chunk arrived"
        pool.stall_seconds = 2.0  # once started (a worker's start-up alone takes seconds)
        time.sleep(4.0)
        assert pool.receive(timeout=1.0)
        assert pool.stalls == 0 and pool.restarts == 0
    finally:
        pool.close()
        inference.close()


def test_a_hung_worker_is_killed_and_restarted():
    """The emulated env's reset sleeps for an hour: the worker sends nothing and is killed after the stall
    limit, then restarted; hanging every time, it stops collection after max_restarts deaths."""
    from dreamer.collect import CollectionError

    env = dict(OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "env" / "emulated.yaml")), reset_latency=3600.0)
    probe = make_env(OmegaConf.create({**env, "reset_latency": 0.0}), 0)
    layout = EnvLayout.from_specs(probe.observation_spec, probe.action_spec)
    probe.close()
    agent = build_agent(layout, SIZE)
    inference = Inference(agent.policy, layout, SIZE, clients=1, device=torch.device("cpu")).start()
    restarts = []
    pool = WorkerPool(env, 0, layout, SIZE, inference.clients, chunk=8, suite="emulated", max_restarts=2,
                      on_restart=restarts.append, stall_seconds=3.0).start()
    try:
        deadline = time.monotonic() + 120
        with pytest.raises(CollectionError, match="emulated env worker 0 died 2 times in a row"):
            while time.monotonic() < deadline:
                pool.receive(timeout=0.5)
        assert pool.stalls == 2 and restarts == [0]
    finally:
        pool.close()
        inference.close()


def test_a_killed_inference_server_process_stops_training_with_a_message_and_a_checkpoint(smoke_cfg, monkeypatch):
    class Killed(Inference):
        def start(self):  # SIGKILL the server's process once training has synced weights to it
            super().start()

            def kill_later():
                deadline = time.monotonic() + 180  # never let a slow machine turn this into a hang
                while self.sync.applied < 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
                os.kill(self.process.pid, signal.SIGKILL)

            threading.Thread(target=kill_later, daemon=True).start()
            return self

    monkeypatch.setattr(inference_module, "Inference", Killed)
    smoke_cfg.run.inference = "process"
    with pytest.raises(train_module.RunError, match="the inference server stopped .*checkpoint saved at"):
        train_module.train(smoke_cfg)
    assert list((Path(smoke_cfg.run.dir) / "checkpoints").glob("ckpt-*.pt"))


class _BreaksInAnotherProcess(torch.nn.Module):
    """A submodule that cannot be rebuilt in a spawned process: stands in for a server that fails to start."""

    def __init__(self):
        super().__init__()
        self.creator = os.getpid()

    def __setstate__(self, state):
        if state["creator"] != os.getpid():
            raise RuntimeError("cannot be rebuilt in this process")
        super().__setstate__(state)


def test_a_server_process_that_dies_while_starting_is_reported_at_once():
    layout, agent = _agent()
    agent.policy.add_module("broken", _BreaksInAnotherProcess())
    inference = Inference(agent.policy, layout, SIZE, clients=1, device=torch.device("cpu"), process=True)
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"the inference server process did not start \(exit code 1"):
            inference.start()
        assert time.monotonic() - start < 60  # not the 600 s start-up limit
    finally:
        inference.close()
