"""Collection faults at the collector level: restarts, truncation, non-finite data."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDictBase
from torchrl.envs import EnvBase
from torchrl.envs.transforms import Transform

from dreamer.agent import EnvLayout, build_agent
from dreamer.collect import CollectionError, Collector
from dreamer.envs import make_env
from tests.test_agent import _size

CARTPOLE = OmegaConf.create({"suite": "gym", "task": "CartPole-v1", "max_episode_steps": 500})


class Sabotage(Transform):
    """Raises at chosen steps, or turns the observation into NaN: a fault injected into a real env."""

    def __init__(self, raise_at=(), nan_at=None):
        super().__init__()
        self.raise_at, self.nan_at, self.count = set(raise_at), nan_at, 0

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        self.count += 1
        if self.count in self.raise_at:
            raise RuntimeError("simulator crashed")
        if self.count == self.nan_at:
            next_tensordict.set("observation", torch.full_like(next_tensordict.get("observation"), float("nan")))
        return next_tensordict


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("AUTO_UNWRAP_TRANSFORMED_ENV", "True")


def _collector(factory) -> tuple[Collector, list]:
    built = []

    def rebuild(index: int) -> EnvBase:
        env = factory(len(built))
        built.append(env)
        return env

    envs = [rebuild(0)]
    layout = EnvLayout.from_specs(envs[0].observation_spec, envs[0].action_spec)
    size = _size("size1m", deter=32, hidden=16, classes=4, stoch=4, units=16, blocks=4)
    agent = build_agent(layout, size)
    return Collector(envs, rebuild, agent.policy, layout, size, "cpu", suite="gym"), built


def test_a_raising_env_is_rebuilt_and_its_episode_truncated():
    collector, built = _collector(
        lambda n: make_env(CARTPOLE, 0).append_transform(Sabotage(raise_at={3} if n == 0 else set())))
    records, ended = [], []
    for _ in range(6):
        record, episodes = collector.step()
        records.append(record)
        ended += episodes
    assert len(built) == 2 and collector.restarts == 1
    faulted = [e for e in ended if e.truncated_by_fault]
    assert len(faulted) == 1 and faulted[0].length == 3  # agent steps: two good ones and the one that raised
    done = [bool(r.get(("next", "done"))[0]) for r in records]
    terminated = [bool(r.get(("next", "terminated"))[0]) for r in records]
    is_init = [bool(r.get("is_init")[0]) for r in records]
    # Record 0 is the reset, records 1-2 two good steps; the third step raised: record 3 repeats the
    # last good observation with done set (truncated, reward 0), then the rebuilt env starts afresh.
    assert done[:5] == [False, False, False, True, False] and not any(terminated[:5])
    assert torch.equal(records[3].get(("next", "observation")), records[2].get(("next", "observation")))
    assert float(records[3].get(("next", "reward"))[0]) == 0.0
    assert is_init[4] and not is_init[3]


def test_ten_failures_in_a_row_raise_a_collection_error():
    collector, built = _collector(lambda n: make_env(CARTPOLE, 0).append_transform(Sabotage(raise_at={1})))
    with pytest.raises(CollectionError, match="gym env 0 failed 10 times in a row, last with RuntimeError: simulator"):
        for _ in range(40):
            collector.step()
    assert len(built) == 10


def test_non_finite_observations_stop_collection_naming_suite_key_and_step():
    collector, _ = _collector(lambda n: make_env(CARTPOLE, 0).append_transform(Sabotage(nan_at=5)))
    with pytest.raises(CollectionError, match=r"gym env 0 returned a non-finite observation \(nan or inf\) at its step 5"):
        for _ in range(10):
            collector.step()


def test_episodes_stop_early_when_asked_and_none_finished_is_summarized():
    from dreamer.evaluate import evaluate

    collector, _ = _collector(lambda i: make_env(CARTPOLE, 0, i))
    calls = []

    def stop_after_three_steps() -> bool:  # a CartPole episode lasts more than three steps
        calls.append(1)
        return len(calls) > 3

    assert collector.run_episodes(3, stop_after_three_steps) == [] and len(calls) == 4
    calls.clear()
    assert evaluate(collector, 3, stop_after_three_steps) == {"eval/episodes": 0}
    assert len(collector.run_episodes(2)) == 2  # without a stop, the episodes run to their end


def test_several_envs_each_play_their_share_of_an_evaluation_whatever_its_episodes_last():
    """Env 0's episodes end after 3 steps, env 1's last longer: the first 4 to end would all be env 0's
    (short ones favoured); each env gives 2, and the first env's first episode is the one kept in full."""
    from dreamer.evaluate import run_with_frames

    short = OmegaConf.create({**CARTPOLE, "max_episode_steps": 3})

    def build(index: int) -> EnvBase:
        return make_env(short if index == 0 else CARTPOLE, 0, index)

    envs = [build(0), build(1)]
    layout = EnvLayout.from_specs(envs[0].observation_spec, envs[0].action_spec)
    size = _size("size1m", deter=32, hidden=16, classes=4, stoch=4, units=16, blocks=4)
    agent = build_agent(layout, size)
    collector = Collector(envs, build, agent.policy, layout, size, "cpu", explore=False, suite="gym")
    finished = collector.run_episodes(4)
    assert sorted(e.env for e in finished) == [0, 0, 1, 1]
    assert all(e.length == 3 for e in finished if e.env == 0)
    assert all(e.length > 3 for e in finished if e.env == 1)
    finished, frames, first = run_with_frames(collector, 3)  # shares: 2 for env 0, 1 for env 1
    assert sorted(e.env for e in finished) == [0, 0, 1] and frames == []  # CartPole has no image
    assert len(first) == 3 + 1 and bool(first[0].get("is_init")) and bool(first[-1].get(("next", "done")))
