"""gymnasium environments with vector observations (classic control): the embedded default's suite."""

from __future__ import annotations

import gymnasium
from omegaconf import DictConfig
from torchrl.envs import DoubleToFloat, EnvBase, StepCounter, TransformedEnv
from torchrl.envs.libs.gym import GymEnv


def check_task(task: str) -> None:
    from . import EnvConfigError

    if task not in gymnasium.registry:
        known = sorted(k for k in gymnasium.registry if "/" not in k and not k.startswith("_"))
        raise EnvConfigError(f"unknown gym task '{task}'; available: {', '.join(known)}")


def make(env_cfg: DictConfig, seed: int) -> EnvBase:
    env = TransformedEnv(GymEnv(env_cfg.task, device="cpu"), DoubleToFloat())
    # StepCounter marks the time limit as truncated (done, not terminated).
    env.append_transform(StepCounter(max_steps=int(env_cfg.max_episode_steps)))
    env.set_seed(seed)
    return env
