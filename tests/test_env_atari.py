"""The Atari suite: key layout, both flavours, frame pooling against a raw emulator run, episode ends, seeding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torchrl.envs.utils import check_env_specs

import ale_py  # noqa: F401  (registers the ALE/* ids; CI installs the atari extra)
import gymnasium

from dreamer.envs import EnvConfigError, check_task, make_env, pixel_shape
from dreamer.envs.atari import available_tasks, pool_frames

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "env"


def config(flavour: str = "atari", **overrides):
    cfg = OmegaConf.load(CONFIGS / f"{flavour}.yaml")
    for key, value in overrides.items():
        cfg[key] = value
    return cfg


def one_hot(index: int, n: int) -> torch.Tensor:
    action = torch.zeros(n, dtype=torch.int64)
    action[index] = 1
    return action


def rollout(env, actions: list[int]) -> tuple[list[torch.Tensor], list[float]]:
    td = env.reset()
    frames, rewards = [td["pixels"].clone()], []
    n = env.action_spec.shape[-1]
    for index in actions:
        td["action"] = one_hot(index, n)
        td = env.step(td)["next"]
        frames.append(td["pixels"].clone())
        rewards.append(float(td["reward"]))
        if td["done"]:
            break
    return frames, rewards


@pytest.mark.parametrize(
    "flavour, shape, actions",
    [("atari", (1, 96, 96), 18), ("atari100k", (3, 64, 64), 6)],  # Pong's minimal set has 6 actions
)
def test_flavours_specs_and_shapes(flavour, shape, actions):
    env = make_env(config(flavour), seed=0)
    check_env_specs(env)
    assert env.observation_spec["pixels"].shape == shape == pixel_shape(config(flavour))
    assert env.observation_spec["pixels"].dtype == torch.uint8
    assert "OneHot" in type(env.action_spec).__name__
    assert env.action_spec.shape[-1] == actions
    td = env.reset()
    assert td["pixels"].shape == shape and td["pixels"].dtype == torch.uint8
    td["action"] = env.action_spec.rand()
    step = env.step(td)["next"]
    assert step["pixels"].shape == shape and step["pixels"].dtype == torch.uint8
    assert step["reward"].shape == (1,) and step["reward"].dtype == torch.float32
    for flag in ("done", "terminated", "truncated"):
        assert step[flag].shape == (1,) and step[flag].dtype == torch.bool
    assert step["pixels"].float().std() > 0  # a real screen, not a blank buffer
    env.close()


def test_full_action_space_has_18_actions():
    env = make_env(config("atari100k", actions="all", task="breakout"), seed=0)
    assert env.action_spec.shape[-1] == 18
    assert env.action_meanings()[:2] == ["NOOP", "FIRE"]
    env.close()
    env = make_env(config("atari100k", actions="needed", task="breakout"), seed=0)
    assert env.action_spec.shape[-1] == 4  # NOOP, FIRE, RIGHT, LEFT
    env.close()


def test_pool_frames_is_the_pixelwise_maximum():
    previous = np.array([[0, 200], [7, 7]], np.uint8)
    last = np.array([[10, 3], [255, 0]], np.uint8)
    np.testing.assert_array_equal(pool_frames(previous, last), [[10, 200], [255, 7]])


@pytest.mark.parametrize("gray", [True, False])
def test_observation_is_the_max_of_the_last_two_raw_frames(gray):
    # Native resolution, no no-ops, no sticky actions: the observation must equal the maximum of the last
    # two frames of a raw frameskip-1 emulator run seeded the same way and stepped with the same actions.
    seed, steps, repeat = 5, 60, 4
    env = make_env(config("atari", size=[210, 160], gray=gray, sticky=0.0, noops=0), seed=seed)
    raw = gymnasium.make(
        "ALE/Pong-v5",
        frameskip=1,
        repeat_action_probability=0.0,
        full_action_space=True,
        obs_type="grayscale" if gray else "rgb",
        disable_env_checker=True,
    )
    actions = np.random.default_rng(0).integers(0, 18, size=steps).tolist()
    frames, _ = rollout(env, actions)

    def layout(frame):
        return frame[None] if gray else frame.transpose(2, 0, 1)

    first, _ = raw.reset(seed=seed)
    np.testing.assert_array_equal(frames[0].numpy(), layout(first))
    pooled_differs = 0
    for t, action in enumerate(actions):
        screens = [raw.step(action)[0] for _ in range(repeat)]
        expected = layout(np.maximum(screens[-2], screens[-1]))
        np.testing.assert_array_equal(frames[t + 1].numpy(), expected, err_msg=f"step {t}")
        pooled_differs += int((expected != layout(screens[-1])).any())
    assert pooled_differs > 0  # the moving ball makes the pooled frame differ from the last one
    raw.close()
    env.close()


def test_resize_keeps_the_screen_content():
    small = make_env(config("atari", size=[64, 64], sticky=0.0, noops=0), seed=1)
    full = make_env(config("atari", size=[210, 160], sticky=0.0, noops=0), seed=1)
    actions = [0, 2, 3, 2, 3, 0, 1, 4] * 4
    (small_frames, _), (full_frames, _) = rollout(small, actions), rollout(full, actions)
    import cv2

    for a, b in zip(small_frames, full_frames):
        expected = cv2.resize(b[0].numpy(), (64, 64), interpolation=cv2.INTER_AREA)
        np.testing.assert_array_equal(a[0].numpy(), expected)


def test_losing_a_life_does_not_end_the_episode():
    # Breakout, FIRE every step: the ball is served and missed; 5 lives are lost in about 120 steps.
    env = make_env(config("atari", task="breakout", size=[64, 64], sticky=0.0, noops=0), seed=0)
    td = env.reset()
    lives = [env.ale.lives()]
    assert lives[0] == 5
    for _ in range(1000):
        td["action"] = one_hot(1, 18)
        td = env.step(td)["next"]
        lives.append(env.ale.lives())
        if td["done"]:
            break
    assert bool(td["done"]) and bool(td["terminated"]) and not bool(td["truncated"])
    assert lives[-1] == 0
    # every life but the last was lost while the episode went on
    assert sorted(set(lives[:-1]), reverse=True) == [5, 4, 3, 2, 1]
    env.close()


def test_time_limit_is_done_and_truncated():
    env = make_env(config("atari", size=[64, 64], max_episode_steps=5), seed=0)
    td = env.reset()
    flags = []
    for _ in range(5):
        td["action"] = env.action_spec.rand()
        td = env.step(td)["next"]
        flags.append((bool(td["done"]), bool(td["terminated"]), bool(td["truncated"])))
    assert flags[:4] == [(False, False, False)] * 4
    assert flags[4] == (True, False, True)
    td = env.reset()  # a new episode counts from zero again
    td["action"] = env.action_spec.rand()
    assert not bool(env.step(td)["next", "done"])
    env.close()


@pytest.mark.parametrize("sticky", [0.0, 0.25])
def test_same_seed_same_episode(sticky):
    actions = np.random.default_rng(1).integers(0, 18, size=150).tolist()
    runs = []
    for seed in (3, 3, 4):
        env = make_env(config("atari", size=[64, 64], sticky=sticky), seed=seed)
        runs.append(rollout(env, actions))
        env.close()
    (frames_a, rewards_a), (frames_b, rewards_b), (frames_c, _) = runs
    assert rewards_a == rewards_b
    assert all(torch.equal(a, b) for a, b in zip(frames_a, frames_b, strict=True))
    if sticky:  # the emulator's sticky-action draws follow the seed
        assert not all(torch.equal(a, c) for a, c in zip(frames_a, frames_c))


def test_reseeding_repeats_the_episode():
    env = make_env(config("atari", size=[64, 64]), seed=7)
    actions = np.random.default_rng(2).integers(0, 18, size=40).tolist()
    first = rollout(env, actions)
    env.set_seed(7)
    second = rollout(env, actions)
    assert first[1] == second[1]
    assert all(torch.equal(a, b) for a, b in zip(first[0], second[0], strict=True))


def test_unknown_task_is_one_line_with_the_game_list():
    with pytest.raises(EnvConfigError) as info:
        check_task(OmegaConf.create({"suite": "atari", "task": "pongg"}))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("unknown atari task 'pongg'; available: ")
    listed = message.split("available: ")[1].split(", ")
    for game in ("pong", "breakout", "ms_pacman", "private_eye", "montezuma_revenge"):
        assert game in listed
    assert "combat" not in listed  # a ROM without a single-player env
    assert listed == list(available_tasks())
    check_task(OmegaConf.create({"suite": "atari", "task": "james_bond"}))  # the reference's spelling


def test_bad_action_set_is_a_config_error():
    with pytest.raises(EnvConfigError, match="unknown atari actions 'some'"):
        make_env(config("atari", actions="some"), seed=0)
