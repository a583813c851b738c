"""DeepMind Control suite (dm_control): proprioceptive vectors and/or rendered pixels, continuous actions.

Tasks are named `domain_task` (`walker_walk`, `cartpole_swingup`, `ball_in_cup_catch`, also `cup_catch`).
Observations, chosen by `obs`:
  proprio  `observation`: the task's observation dict flattened and concatenated in sorted key order (float32)
  pixels   `pixels` [3, H, W] uint8 rendered from one camera of the scene
  both     both keys
Each agent step repeats the action `repeat` times and sums the rewards (stopping early when the episode
ends). Actions lie in [-1, 1] and are mapped affinely onto the task's own box where it differs. DMC episodes
end by their time limit (1000 physics steps): that and `max_episode_steps` (agent steps) are done +
truncated; an episode is terminated only where a task sets the discount to 0 (the `lqr` tasks).

Rendering uses EGL unless MUJOCO_GL says otherwise; shadows and multisampling are switched off, which
makes software rendering several times faster at 64 x 64.
"""

from __future__ import annotations

import os

# The OpenGL backend is chosen when dm_control is first imported.
if "MUJOCO_GL" not in os.environ:
    os.environ["MUJOCO_GL"] = "egl"
if os.environ["MUJOCO_GL"] == "egl":
    os.environ.setdefault("PYOPENGL_PLATFORM", "egl")

import mujoco  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from tensordict import TensorDict, TensorDictBase  # noqa: E402
from torchrl.data import Bounded, Categorical, Composite, Unbounded  # noqa: E402
from torchrl.envs import EnvBase  # noqa: E402

from dreamer.envs import DMC_DOMAIN_ALIASES  # noqa: E402

# Camera used when env_cfg.camera is -1 (the reference's choice); other domains use camera 0.
DEFAULT_CAMERAS = {"quadruped": 2}
# Action bounds wider than this (e.g. lqr's +-1e10) are left as they are: the [-1, 1] action is passed through.
_MAX_RESCALED_BOUND = 1e6


def _suite():
    """dm_control's suite module; a renderer that cannot start (no libEGL under MUJOCO_GL=egl) is one line."""
    from . import EnvConfigError

    try:
        from dm_control import suite
    except (AttributeError, ImportError, OSError) as error:  # PyOpenGL without libEGL: 'NoneType' ... 'eglQueryString'
        backend = os.environ.get("MUJOCO_GL", "")
        if backend in ("", "disabled") or isinstance(error, ModuleNotFoundError):
            raise
        raise EnvConfigError(
            f"dm_control cannot start MuJoCo's {backend} renderer ({str(error).splitlines()[0]}): install its "
            f"library (EGL: libEGL.so.1, Debian/Ubuntu package libegl1; the Docker image has it), or, for "
            f"proprioceptive tasks, which render nothing, set MUJOCO_GL=disabled") from None
    return suite


def _tasks() -> dict[str, tuple[str, str]]:
    """`domain_task` name -> (dm_control domain, task), aliases included."""
    suite = _suite()

    names = {f"{domain}_{task}": (domain, task) for domain, task in suite.ALL_TASKS}
    for alias, domain in DMC_DOMAIN_ALIASES.items():
        for domain_, task in suite.ALL_TASKS:
            if domain_ == domain:
                names[f"{alias}_{task}"] = (domain, task)
    return names


def check_task(task: str) -> None:
    from . import EnvConfigError

    known = _tasks()
    if task not in known:
        raise EnvConfigError(f"unknown dmc task '{task}'; available: {', '.join(sorted(known))}")


def make(env_cfg: DictConfig, seed: int) -> EnvBase:
    from . import pixel_shape

    check_task(env_cfg.task)
    shape = pixel_shape(env_cfg, "dmc")
    return DMCEnv(
        env_cfg.task,
        seed=seed,
        obs=env_cfg.get("obs", "proprio"),
        repeat=int(env_cfg.get("repeat", 1)),
        size=(64, 64) if shape is None else shape[1:],
        camera=int(env_cfg.get("camera", -1)),
        max_episode_steps=int(env_cfg.max_episode_steps),
    )


class DMCEnv(EnvBase):
    """One dm_control suite task with the project's key layout (see the module docstring)."""

    OBS_MODES = ("proprio", "pixels", "both")

    def __init__(
        self,
        task: str,
        seed: int = 0,
        obs: str = "proprio",
        repeat: int = 1,
        size: tuple[int, int] = (64, 64),
        camera: int = -1,
        max_episode_steps: int = 1000,
    ):
        from . import EnvConfigError

        if obs not in self.OBS_MODES:
            raise EnvConfigError(f"unknown dmc obs mode '{obs}'; available: {', '.join(self.OBS_MODES)}")
        if repeat < 1:
            raise EnvConfigError(f"dmc repeat must be at least 1, got {repeat}")
        if max_episode_steps < 1:
            raise EnvConfigError(f"max_episode_steps must be at least 1, got {max_episode_steps}")
        known = _tasks()
        if task not in known:
            check_task(task)
        super().__init__(device="cpu", batch_size=torch.Size([]))
        from dm_control import suite

        domain, task_name = known[task]
        self.task_name = task
        self.repeat = repeat
        self.max_episode_steps = max_episode_steps
        self.proprio = obs in ("proprio", "both")
        self.pixels = obs in ("pixels", "both")
        self._env = suite.load(domain, task_name, task_kwargs={"random": seed})
        self._steps = 0

        # Actions: [-1, 1] for the agent, mapped onto the task's box where it differs.
        action_spec = self._env.action_spec()
        low = np.broadcast_to(np.asarray(action_spec.minimum, np.float64), action_spec.shape)
        high = np.broadcast_to(np.asarray(action_spec.maximum, np.float64), action_spec.shape)
        rescale = np.isfinite(low) & np.isfinite(high) & (np.maximum(-low, high) <= _MAX_RESCALED_BOUND)
        self._low = np.where(rescale, low, -1.0)
        self._high = np.where(rescale, high, 1.0)
        self._identity_actions = bool(np.all(self._low == -1.0) and np.all(self._high == 1.0))
        self.action_spec = Bounded(low=-1.0, high=1.0, shape=action_spec.shape, dtype=torch.float32)

        observation = {}
        if self.proprio:
            self._obs_keys = sorted(self._env.observation_spec())
            dim = sum(int(np.prod(self._env.observation_spec()[k].shape)) for k in self._obs_keys)
            observation["observation"] = Unbounded(shape=(dim,), dtype=torch.float32)
        self._camera = None
        if self.pixels:
            height, width = size
            camera_id = DEFAULT_CAMERAS.get(domain, 0) if camera == -1 else camera
            physics = self._env.physics
            if not 0 <= camera_id < physics.model.ncam:
                raise EnvConfigError(
                    f"dmc task '{task}' has cameras 0..{physics.model.ncam - 1} (or -1: default), got {camera}"
                )
            # These are read when the rendering context is created, i.e. by the first camera below.
            quality = physics.model.vis.quality
            quality.offsamples = 0  # no multisampling
            quality.shadowsize = 0  # no shadow map
            offscreen = physics.model.vis.global_
            offscreen.offwidth, offscreen.offheight = width, height
            from dm_control.mujoco.engine import Camera

            self._camera = Camera(physics, height=height, width=width, camera_id=camera_id)
            self._camera.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
            observation["pixels"] = Bounded(low=0, high=255, shape=(3, height, width), dtype=torch.uint8)
        self.observation_spec = Composite(observation)
        self.reward_spec = Unbounded(shape=(1,), dtype=torch.float32)
        self.done_spec = Composite(
            done=Categorical(2, shape=(1,), dtype=torch.bool),
            terminated=Categorical(2, shape=(1,), dtype=torch.bool),
            truncated=Categorical(2, shape=(1,), dtype=torch.bool),
        )

    def _observe(self, time_step) -> dict[str, torch.Tensor]:
        out = {}
        if self.proprio:
            values = time_step.observation
            flat = np.concatenate([np.asarray(values[k], np.float32).ravel() for k in self._obs_keys])
            out["observation"] = torch.from_numpy(flat)
        if self.pixels:
            image = self._camera.render()  # [H, W, 3], a view of the camera's buffer
            out["pixels"] = torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1)))
        return out

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        self._steps = 0
        out = self._observe(self._env.reset())
        false = torch.zeros(1, dtype=torch.bool)
        out.update(done=false, terminated=false.clone(), truncated=false.clone())
        return TensorDict(out, batch_size=())

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        action = tensordict.get("action").detach().cpu().numpy().astype(np.float64).clip(-1.0, 1.0)
        if not self._identity_actions:
            action = self._low + (action + 1.0) * 0.5 * (self._high - self._low)
        reward = 0.0
        for _ in range(self.repeat):
            time_step = self._env.step(action)
            reward += time_step.reward or 0.0
            if time_step.last():
                break
        self._steps += 1
        terminated = time_step.last() and time_step.discount == 0.0
        done = time_step.last() or self._steps >= self.max_episode_steps
        out = self._observe(time_step)
        out.update(
            reward=torch.tensor([reward], dtype=torch.float32),
            done=torch.tensor([done]),
            terminated=torch.tensor([terminated]),
            truncated=torch.tensor([done and not terminated]),
        )
        return TensorDict(out, batch_size=())

    def _set_seed(self, seed: int | None) -> None:
        # All the randomness of a suite task (initial states, targets) comes from the task's generator.
        self._env.task._random = np.random.RandomState(seed)

    def close(self, *, raise_if_closed: bool = True) -> None:
        if self._camera is not None:
            self._camera.scene.free()
            self._camera = None
        if "_env" in self.__dict__:
            self._env.physics.free()
        super().close(raise_if_closed=raise_if_closed)
