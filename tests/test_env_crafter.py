"""Crafter suite: specs, key layout, seeding, episode ends and achievement logs."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torchrl.envs.utils import check_env_specs

import crafter  # noqa: F401  (the crafter extra is installed in CI: fail loudly without it)
from dreamer.agent import EnvLayout
from dreamer.envs import EnvConfigError, check_task, make_env, pixel_shape
from dreamer.envs.crafter import ACHIEVEMENTS, LOG_KEYS, CrafterEnv, achievement_flags

STEP_KEYS = {"pixels", "reward", "done", "terminated", "truncated", *LOG_KEYS}


def config(**overrides):
    return OmegaConf.create({"suite": "crafter", "task": "reward", "max_episode_steps": 10000, **overrides})


@pytest.fixture(scope="module")
def env():
    return make_env(config(), seed=0)


def test_specs_pass_torchrl_check(env):
    check_env_specs(env, seed=3)


def test_pixels_and_actions(env):
    assert env.observation_spec["pixels"].shape == (3, 64, 64)
    assert env.observation_spec["pixels"].dtype == torch.uint8
    pixels = env.reset()["pixels"]
    assert pixels.shape == (3, 64, 64) and pixels.dtype == torch.uint8
    assert pixels.float().std() > 0  # a rendered world, not a blank frame
    assert "OneHot" in type(env.action_spec).__name__
    assert env.action_spec.shape == (17,)
    layout = EnvLayout.from_specs(env.observation_spec, env.action_spec)
    assert layout.image_shape == (3, 64, 64) and layout.vector_keys == ()
    assert layout.discrete and layout.action_dim == 17


def test_size_setting_is_honoured():
    env = make_env(config(size=[96, 64]), seed=0)  # crafter's order: width, height
    assert env.observation_spec["pixels"].shape == (3, 64, 96) == pixel_shape(config(size=[96, 64]))
    assert env.reset()["pixels"].shape == (3, 64, 96)


def test_random_steps_key_layout_and_rewards(env):
    td = env.reset()
    assert set(td.keys()) == STEP_KEYS - {"reward"}
    rewards = []
    for _ in range(300):
        td.set("action", env.action_spec.rand())
        td = env.step(td).get("next")
        assert set(td.keys()) == STEP_KEYS
        assert td["pixels"].shape == (3, 64, 64) and td["pixels"].dtype == torch.uint8
        assert td["reward"].shape == (1,) and td["reward"].dtype == torch.float32
        for key in ("done", "terminated", "truncated", *LOG_KEYS):
            assert td[key].shape == (1,) and td[key].dtype == torch.bool, key
        rewards.append(float(td["reward"]))
        if td["done"]:
            td = env.reset()
    rewards = torch.tensor(rewards)
    assert torch.isfinite(rewards).all()
    # Crafter's rewards: +-0.1 per health point changed, +1 per new achievement.
    assert rewards.abs().max() <= 2.0


def test_action_index_reaches_crafter():
    env = CrafterEnv(seed=0)
    td = env.reset()
    inner, seen = env._env, []

    def recording_step(action):
        seen.append(action)
        return inner.__class__.step(inner, action)

    inner.step = recording_step
    for index in (0, 5, 16):
        td.set("action", torch.nn.functional.one_hot(torch.tensor(index), 17).bool())
        td = env.step(td).get("next")
    td.set("action", torch.nn.functional.one_hot(torch.tensor(3), 17).float())  # any dtype is read
    env.step(td)
    assert seen == [0, 5, 16, 3]


def test_seeding():
    first = make_env(config(), seed=7).reset()["pixels"]
    again = make_env(config(), seed=7).reset()["pixels"]
    other = make_env(config(), seed=8).reset()["pixels"]
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    env = make_env(config(), seed=8)
    env.set_seed(7)
    assert torch.equal(env.reset()["pixels"], first)


def test_time_limit_is_truncation_not_termination():
    env = make_env(config(max_episode_steps=5), seed=0)
    rollout = env.rollout(20, break_when_any_done=True)
    assert rollout.shape == (5,)
    done, terminated, truncated = (rollout["next", key].squeeze(-1) for key in ("done", "terminated", "truncated"))
    assert done.tolist() == [False] * 4 + [True]
    assert truncated.tolist() == [False] * 4 + [True]
    assert not terminated.any()


def test_death_is_termination_not_truncation():
    env = CrafterEnv(seed=0, length=10000)
    td = env.reset()
    env._env._player.health = 0
    td.set("action", torch.nn.functional.one_hot(torch.tensor(0), 17).bool())
    td = env.step(td).get("next")
    assert bool(td["done"]) and bool(td["terminated"]) and not bool(td["truncated"])


def test_achievement_flags_conversion():
    assert len(ACHIEVEMENTS) == 22 and ACHIEVEMENTS[0] == "collect_coal" and ACHIEVEMENTS[-1] == "wake_up"
    assert LOG_KEYS == tuple(f"log_achievement_{name}" for name in ACHIEVEMENTS)
    counts = {name: 0 for name in ACHIEVEMENTS}
    flags = achievement_flags(counts)
    assert list(flags) == list(LOG_KEYS)
    assert not any(bool(flag) for flag in flags.values())
    assert all(flag.shape == (1,) and flag.dtype == torch.bool for flag in flags.values())
    counts["collect_wood"] = 1
    counts["wake_up"] = 3
    flags = achievement_flags(counts)
    on = {key for key, flag in flags.items() if bool(flag)}
    assert on == {"log_achievement_collect_wood", "log_achievement_wake_up"}
    assert not any(bool(flag) for flag in achievement_flags(None).values())


def test_achievements_in_an_episode():
    env = CrafterEnv(seed=0)
    td = env.reset()
    assert not any(bool(td[key]) for key in LOG_KEYS)
    # Count the player's achievements upward by hand: the next step's flag follows the counter.
    env._env._player.achievements["collect_sapling"] += 1
    td.set("action", torch.nn.functional.one_hot(torch.tensor(0), 17).bool())
    td = env.step(td).get("next")
    assert bool(td["log_achievement_collect_sapling"])
    assert float(td["reward"]) >= 0.9  # crafter's +1 for a new achievement (minus at most a health point)
    td = env.reset()
    assert not any(bool(td[key]) for key in LOG_KEYS)


def test_unknown_task_raises_one_line():
    check_task(config())
    with pytest.raises(EnvConfigError) as error:
        check_task(config(task="diamonds"))
    message = str(error.value)
    assert message == "unknown crafter task 'diamonds'; available: reward"
    assert "\n" not in message
