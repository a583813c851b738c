"""The experience sources of `dreamer.pipeline` and the updates the loop owes, on the CPU.

Everything is real (CartPole envs, worker processes, the inference server's thread, replay, the learner)
except the acting policy of the first test: a deterministic rule on the observation instead of the
agent's sampled actions, so that the two sources' records can be compared one for one.
"""

from __future__ import annotations

import threading
import time

import torch
from tensordict import TensorDict
from torch import nn
from torchrl.trainers.algorithms import DreamerV3UpdateRatio

from dreamer.agent import EnvLayout, build_agent
from dreamer.config import compose_config, validate
from dreamer.envs import make_env
from dreamer.learner import Learner
from dreamer.pipeline import InlineSource, Updates, WorkerSource
from dreamer.replay import Replay
from tests.test_agent import _size

SIZE = _size("size1m", deter=32, hidden=16, stoch=4, classes=4, depth=4, units=16, blocks=4)


def _cfg(*overrides: str):
    return compose_config(["+debug=smoke", "run.dir=.", *overrides])


class LeanPolicy(nn.Module):
    """Pushes the cart toward where the pole leans; its carry is a function of the observation."""

    def __init__(self, latent: int, deter: int):
        super().__init__()
        self.latent, self.deter = latent, deter
        self.scale = nn.Parameter(torch.ones(()))  # a weight for the sources to copy

    @torch.no_grad()
    def forward(self, record):
        obs = record.get(("next", "observation")).float()
        lean = obs[..., 2:3] + 0.5 * obs[..., 3:4]
        action = torch.cat([(lean < 0).float(), (lean >= 0).float()], -1)
        total = obs.sum(-1, keepdim=True) * self.scale
        record.set("policy", TensorDict(
            state=total.expand(*obs.shape[:-1], self.latent).clone(),
            belief=(total + record.get("belief")[..., :1]).expand(*obs.shape[:-1], self.deter).clone(),
            action=action, batch_size=obs.shape[:-1]))
        return record


def _layout(cfg) -> EnvLayout:
    env = make_env(cfg.env, 0)
    try:
        return EnvLayout.from_specs(env.observation_spec, env.action_spec)
    finally:
        env.close()


def _stream(replay: Replay, stream: int, count: int) -> TensorDict:
    _, _, records = replay.snapshot(stream, 0)
    return records[:count]


def test_inline_and_worker_sources_give_the_same_records():
    envs, steps = 3, 40
    cfg = _cfg(f"run.envs={envs}", "run.collect=workers", "run.chunk=8", "seed=5", "env.max_episode_steps=15")
    settings = validate(cfg)
    layout = _layout(cfg)
    policy = LeanPolicy(settings.size.latent, settings.size.deter)
    device = torch.device("cpu")

    inline_replay = Replay(envs, 4096, 4, 8, device, seed=0, context_dtype=torch.float32)
    inline = InlineSource(cfg, policy, layout, settings.size, device, False, inline_replay)
    try:
        for _ in range(steps):
            assert inline.gather()[0] == envs
    finally:
        inline.close()

    worker_replay = Replay(envs, 4096, 4, 8, device, seed=0, context_dtype=torch.float32)
    workers = WorkerSource(cfg, policy, layout, settings.size, device, False, worker_replay, announce=None)
    try:
        workers.start()
        deadline = time.monotonic() + 120
        while min(len(m) for m in worker_replay.buffer._rbs) < steps:
            assert time.monotonic() < deadline, "the workers did not deliver their records in 120 s"
            workers.gather(timeout=1.0)
    finally:
        workers.close()

    for stream in range(envs):
        a, b = _stream(inline_replay, stream, steps), _stream(worker_replay, stream, steps)
        assert a.shape == b.shape == torch.Size([steps])
        for key in a.keys(include_nested=True, leaves_only=True):
            assert torch.equal(a.get(key), b.get(key)), (stream, key)
        # Episodes ended (15-step limit): the resets are compared too.
        assert bool(a.get("is_init")[1:].any())
    inline_replay.close()
    worker_replay.close()


def test_the_inline_source_makes_steps_and_closes_its_envs_in_one_thread(monkeypatch):
    """As on a CUDA learner, the source steps one step ahead in a thread of its own (`ahead=True`). Its real
    CartPole envs are made to behave as an image env under EGL does (the faked part): a renderer context
    is current on the thread that made the env, and stepping or closing the env from another thread fails.
    A step that fails rebuilds the env (counted in `restarts`), so each env's first step would show it."""
    made_on, stepped_on, closed_on = {}, {}, {}

    def make_bound_env(*args, **kwargs):
        env, here = make_env(*args, **kwargs), threading.current_thread().name
        made_on[id(env)] = here
        step, close = env._step, env.close

        def _step(tensordict):
            if threading.current_thread().name != here:
                raise RuntimeError("the renderer's context is current on another thread")
            stepped_on[id(env)] = here
            return step(tensordict)

        def _close(**kwargs):
            if threading.current_thread().name != here:
                raise RuntimeError("the renderer's context is current on another thread")
            closed_on[id(env)] = here
            return close(**kwargs)
        env._step, env.close = _step, _close
        return env

    monkeypatch.setattr("dreamer.pipeline.make_env", make_bound_env)
    cfg = _cfg("run.envs=2", "seed=3")
    settings = validate(cfg)
    layout = _layout(cfg)
    policy = LeanPolicy(settings.size.latent, settings.size.deter)
    replay = Replay(2, 4096, 4, 8, torch.device("cpu"), seed=0, context_dtype=torch.float32)
    source = InlineSource(cfg, policy, layout, settings.size, torch.device("cpu"), False, replay, ahead=True)
    for _ in range(5):
        assert source.gather()[0] == 2
    assert source.restarts == 0  # no step failed (nor rebuilt an env)
    source.close()
    replay.close()
    assert len(made_on) == 2 and all(name.startswith("dreamer-inline-step") for name in made_on.values())
    assert stepped_on == made_on and closed_on == made_on


def test_the_update_ratio_holds_through_the_inline_source():
    cfg = _cfg("run.envs=2", "run.train_ratio=48", "run.train_start=0", "batch_size=4", "batch_length=8")
    settings = validate(cfg)
    layout = _layout(cfg)
    torch.manual_seed(0)
    agent = build_agent(layout, SIZE)
    device = torch.device("cpu")
    replay = Replay(2, 4096, 4, 8, device, seed=0, context_dtype=torch.float32)
    learner = Learner(agent, settings.loss, settings.optimizer, device, compile=False, cudagraph=False, bf16=False)
    source = InlineSource(cfg, agent.policy, layout, SIZE, device, False, replay)
    counters = {"env_steps": 0, "train_steps": 0, "episodes": 0, "owed_updates": 0}
    updates = Updates(learner, replay, DreamerV3UpdateRatio(settings.updates_per_step), source, counters, 0)
    try:
        collected, first = 0, None
        for _ in range(60):
            steps, _ = source.gather()
            counters["env_steps"] += steps
            updates.owe(steps)
            updates.run()
            if replay.ready():
                collected += steps
                first = steps if first is None else first
        # train_ratio x env steps since replay was ready / (batch x length); torchrl's schedule grants one
        # update at its first call and counts the steps from there on.
        owed = 1 + 48 * (collected - first) / (4 * 8)
        assert collected > 100 and abs(learner.updates - owed) <= 1, (learner.updates, owed)
        assert counters["owed_updates"] == 0
        figures = source.stats()
        assert figures["collect/weights_age"] == 0.0  # a CPU learner acts with its own weights
        assert figures["collect/env_ms"] > 0 and figures["collect/policy_ms"] > 0
    finally:
        source.close()
        replay.close()


def test_a_policy_that_sets_its_own_exploration_is_called_without_touching_the_process_wide_setting():
    """The inline source's acting copy steps in a thread of its own beside the loop (and its evaluations):
    the collector leaves torchrl's process-wide exploration type alone for it, and sets it for others."""
    from torchrl.envs import ExplorationType, exploration_type, set_exploration_type

    from dreamer.collect import Collector

    cfg = _cfg("run.envs=1")
    settings = validate(cfg)
    layout = _layout(cfg)
    seen = []

    class Recording(LeanPolicy):
        def forward(self, record):
            seen.append(exploration_type())
            return super().forward(record)

    for sets_own in (True, False):
        policy = Recording(settings.size.latent, settings.size.deter)
        policy.sets_exploration = sets_own
        collector = Collector([make_env(cfg.env, 0)], lambda i: make_env(cfg.env, 0), policy, layout, settings.size,
                              "cpu", explore=True)
        with set_exploration_type(ExplorationType.DETERMINISTIC):
            collector.step()
        collector.close()
    assert seen == [ExplorationType.DETERMINISTIC, ExplorationType.RANDOM]
