"""DeepMind Control suite environments: specs, observations, action mapping, repeat, seeding, episode ends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torchrl.envs.utils import check_env_specs

from dreamer.agent import EnvLayout
from dreamer.envs import EnvConfigError, check_task, make_env, pixel_shape
from dreamer.envs import dmc  # sets MUJOCO_GL before dm_control is imported

from dm_control import suite  # noqa: E402  (after dreamer.envs.dmc on purpose)


def config(**overrides):
    base = dict(
        suite="dmc", task="walker_walk", obs="proprio", repeat=1, size=[64, 64], camera=-1, max_episode_steps=1000
    )
    return OmegaConf.create({**base, **overrides})


def actions(count: int, dim: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(count, dim, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def run(env, acts: torch.Tensor):
    """Steps through `acts` (stopping at the episode end); returns the `next` tensordicts."""
    td, out = env.reset(), []
    for action in acts:
        td.set("action", action)
        td = env.step(td).get("next")
        out.append(td)
        if td.get("done").item():
            break
    return out


def test_config_file_matches_the_defaults():
    cfg = OmegaConf.load(Path(__file__).resolve().parent.parent / "configs/env/dmc.yaml")
    assert cfg == config()


@pytest.mark.parametrize("obs", ["proprio", "pixels"])
def test_specs(obs):
    env = make_env(config(obs=obs), seed=0)
    check_env_specs(env, seed=0)
    env.close()


def test_proprio_observation():
    env = make_env(config(), seed=0)
    spec = env.observation_spec
    assert list(spec.keys()) == ["observation"]
    assert spec["observation"].shape == (24,) and spec["observation"].dtype == torch.float32
    td = env.reset()
    # The flat vector is the observation dict in sorted key order: height (1), orientations (14), velocity (9).
    raw = env._env.task.get_observation(env._env.physics)
    expected = np.concatenate([np.asarray(raw[k], np.float32).ravel() for k in sorted(raw)])
    assert sorted(raw) == ["height", "orientations", "velocity"]
    np.testing.assert_allclose(td["observation"].numpy(), expected, rtol=1e-6)
    layout = EnvLayout.from_specs(spec, env.action_spec)
    assert layout.vector_keys == ("observation",) and layout.vector_dim == 24 and layout.image_shape is None
    assert layout.action_dim == 6 and not layout.discrete
    env.close()


def test_pixels_observation():
    env = make_env(config(obs="pixels", size=[48, 80]), seed=0)
    assert list(env.observation_spec.keys()) == ["pixels"]
    spec = env.observation_spec["pixels"]
    assert spec.shape == (3, 48, 80) == pixel_shape(config(obs="pixels", size=[48, 80])) and spec.dtype == torch.uint8
    first = env.reset()["pixels"]
    assert first.shape == (3, 48, 80) and first.dtype == torch.uint8
    assert first.float().std() > 10  # a real picture, not a blank buffer
    (after,) = run(env, torch.ones(1, 6))
    assert not torch.equal(after["pixels"], first)  # the image follows the physics
    layout = EnvLayout.from_specs(env.observation_spec, env.action_spec)
    assert layout.image_shape == (3, 48, 80) and layout.vector_keys == ()
    env.close()


def test_both_observations():
    env = make_env(config(obs="both"), seed=0)
    td = env.reset()
    assert td["observation"].shape == (24,) and td["pixels"].shape == (3, 64, 64)
    env.close()


def test_default_camera_is_two_for_quadruped():
    images = {}
    for camera in (-1, 0, 2):
        env = make_env(config(task="quadruped_run", obs="pixels", camera=camera), seed=0)
        images[camera] = env.reset()["pixels"]
        env.close()
    assert torch.equal(images[-1], images[2])
    assert not torch.equal(images[-1], images[0])


def test_action_bounds_and_rescaling():
    env = make_env(config(), seed=0)
    spec = env.action_spec
    assert spec.shape == (6,) and spec.dtype == torch.float32
    assert torch.all(spec.space.low == -1) and torch.all(spec.space.high == 1)
    env.close()
    # quadruped's own box is not [-1, 1]: the agent's [-1, 1] is mapped onto it (and clipped to it).
    env = make_env(config(task="quadruped_walk"), seed=0)
    box = env._env.action_spec()
    assert torch.all(env.action_spec.space.low == -1) and torch.all(env.action_spec.space.high == 1)
    run(env, torch.ones(1, 12))
    np.testing.assert_allclose(env._env.physics.data.ctrl, box.maximum)
    run(env, -torch.ones(1, 12) * 5)
    np.testing.assert_allclose(env._env.physics.data.ctrl, box.minimum)
    run(env, torch.zeros(1, 12))
    np.testing.assert_allclose(env._env.physics.data.ctrl, (box.minimum + box.maximum) / 2)
    env.close()


def test_same_seed_same_episode():
    acts = actions(30, 6)
    first = [make_env(config(), seed=seed) for seed in (3, 3, 4)]
    resets = [env.reset()["observation"] for env in first]
    assert torch.equal(resets[0], resets[1]) and not torch.equal(resets[0], resets[2])
    a, b = run(first[0], acts), run(first[1], acts)
    assert all(torch.equal(x["observation"], y["observation"]) for x, y in zip(a, b))
    assert all(torch.equal(x["reward"], y["reward"]) for x, y in zip(a, b))
    # set_seed re-seeds an existing env: it then starts like a fresh env of that seed.
    first[2].set_seed(3)
    assert torch.equal(first[2].reset()["observation"], resets[0])
    for env in first:
        env.close()


def test_repeat_sums_the_rewards_of_the_physics_steps():
    seed, acts = 7, actions(10, 6, seed=1)
    env = make_env(config(repeat=2), seed=seed)
    raw = suite.load("walker", "walk", task_kwargs={"random": seed})
    raw.reset()
    steps = run(env, acts)
    assert len(steps) == 10
    for action, td in zip(acts, steps):
        rewards = [raw.step(action.double().numpy()).reward for _ in range(2)]
        assert td["reward"].item() == pytest.approx(sum(rewards), rel=1e-5)
        assert td["reward"].item() != pytest.approx(rewards[0], rel=1e-3)  # both steps count
    observation = raw.task.get_observation(raw.physics)
    flat = np.concatenate([np.asarray(observation[k], np.float32).ravel() for k in sorted(observation)])
    np.testing.assert_allclose(steps[-1]["observation"].numpy(), flat, rtol=1e-6)
    env.close()


def test_max_episode_steps_truncates():
    env = make_env(config(max_episode_steps=20), seed=0)
    steps = run(env, actions(100, 6))
    assert len(steps) == 20
    assert steps[-1]["done"].item() and steps[-1]["truncated"].item() and not steps[-1]["terminated"].item()
    assert not any(td["done"].item() for td in steps[:-1])
    env.close()


def test_time_limit_ends_walker_after_500_agent_steps():
    env = make_env(config(repeat=2, max_episode_steps=10**6), seed=0)
    steps = run(env, actions(600, 6))
    assert len(steps) == 500  # 1000 physics steps at repeat 2
    assert steps[-1]["truncated"].item() and not steps[-1]["terminated"].item()
    assert not any(td["terminated"].item() for td in steps)
    env.close()


def test_time_limit_stops_the_repeat_early():
    # cartpole: 1000 physics steps; at repeat 3 that is 333 full agent steps and a last one of a single step.
    env = make_env(config(task="cartpole_swingup", repeat=3, max_episode_steps=10**6), seed=0)
    steps = run(env, actions(400, 1))
    assert len(steps) == 334
    assert steps[-1]["done"].item() and steps[-1]["truncated"].item() and not steps[-1]["terminated"].item()
    assert env._env.physics.time() == pytest.approx(1000 * env._env.control_timestep())
    env.close()


def test_task_names():
    for task in ("walker_walk", "cartpole_swingup", "cheetah_run", "reacher_easy", "quadruped_run", "cup_catch"):
        check_task(config(task=task))
    assert dmc._tasks()["cup_catch"] == ("ball_in_cup", "catch")
    assert dmc._tasks()["point_mass_easy"] == ("point_mass", "easy")
    assert len(dmc._tasks()) >= len(suite.ALL_TASKS)


def test_unknown_task_is_one_line():
    with pytest.raises(EnvConfigError) as error:
        check_task(config(task="walker_fly"))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("unknown dmc task 'walker_fly'; available: ")
    available = message.split("available: ")[1].split(", ")
    assert "walker_walk" in available and "cup_catch" in available and "ball_in_cup_catch" in available
    assert available == sorted(available)
    with pytest.raises(EnvConfigError, match="unknown dmc task"):
        make_env(config(task="walker_fly"), seed=0)


def test_bad_settings():
    with pytest.raises(EnvConfigError, match="obs mode"):
        make_env(config(obs="rgb"), seed=0)
    with pytest.raises(EnvConfigError, match="cameras"):
        make_env(config(obs="pixels", camera=9), seed=0)


def test_a_renderer_that_cannot_start_is_one_line(tmp_path):
    """Where libEGL.so.1 is missing, PyOpenGL's EGL platform fails inside dm_control's import with an
    AttributeError on a None library. That failure is faked here (an import hook raises it for dm_control,
    in a fresh interpreter), as this machine has the library; the check is the line the user gets."""
    script = (
        "import sys\n"
        "from omegaconf import OmegaConf\n"
        "from dreamer.envs import EnvConfigError, check_task\n"  # torchrl, imported first, looks for dm_control
        "class NoEGL:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'dm_control' or name.startswith('dm_control.'):\n"
        "            raise AttributeError(\"'NoneType' object has no attribute 'eglQueryString'\")\n"
        "sys.meta_path.insert(0, NoEGL())\n"
        "try:\n"
        "    check_task(OmegaConf.create({'suite': 'dmc', 'task': 'walker_walk'}))\n"
        "except EnvConfigError as error:\n"
        "    print(error)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "MUJOCO_GL": "egl"},
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == (
        "dm_control cannot start MuJoCo's egl renderer ('NoneType' object has no attribute 'eglQueryString'): "
        "install its library (EGL: libEGL.so.1, Debian/Ubuntu package libegl1; the Docker image has it), or, "
        "for proprioceptive tasks, which render nothing, set MUJOCO_GL=disabled")
