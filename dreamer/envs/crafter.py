"""Crafter 1.8.3 (the reward-giving task): `pixels` [3, H, W] uint8, 17 one-hot actions, achievement logs.

Crafter's own episode end (its `length`, 10,000 steps by default; here `max_episode_steps`) is a time
limit: done and truncated. The player's death (crafter's info `discount` 0) is done and terminated.
`log_achievement_<name>` (one per crafter achievement, in crafter's order) is True once the achievement's
count is positive in the current episode; crafter resets the counts with each episode.
Crafter generates its worlds with opensimplex, which is several times faster with numba installed.
"""

from __future__ import annotations

from collections.abc import Mapping

import crafter
import crafter.constants
import numpy as np
import torch
from omegaconf import DictConfig
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Bounded, Categorical, Composite, OneHot, Unbounded
from torchrl.envs import EnvBase

TASKS = ("reward",)
ACTIONS: tuple[str, ...] = tuple(crafter.constants.actions)  # 17 names, index = crafter's action id
ACHIEVEMENTS: tuple[str, ...] = tuple(crafter.constants.achievements)  # 22 names, crafter's order
LOG_KEYS: tuple[str, ...] = tuple(f"log_achievement_{name}" for name in ACHIEVEMENTS)
IMAGE_KEY = "pixels"


def check_task(task: str) -> None:
    from . import EnvConfigError

    if task not in TASKS:
        raise EnvConfigError(f"unknown crafter task '{task}'; available: {', '.join(TASKS)}")


def achievement_flags(achievements: Mapping[str, int] | None) -> dict[str, torch.Tensor]:
    """crafter's info['achievements'] (name -> count this episode) -> {log key: bool [1]}.

    None (the state right after a reset) and names missing from the dict give False; unknown names are
    ignored.
    """
    achievements = achievements or {}
    return {
        key: torch.tensor([achievements.get(name, 0) > 0], dtype=torch.bool)
        for key, name in zip(LOG_KEYS, ACHIEVEMENTS)
    }


class CrafterEnv(EnvBase):
    """One crafter.Env as a torchrl environment (batch size [], CPU)."""

    def __init__(
        self,
        seed: int = 0,
        length: int | None = 10000,
        size: tuple[int, int] = (64, 64),
        area: tuple[int, int] = (64, 64),
        view: tuple[int, int] = (9, 9),
    ):
        super().__init__(device="cpu", batch_size=torch.Size([]))
        self._length = None if length is None else int(length)
        self._size = (int(size[0]), int(size[1]))  # crafter's order: (width, height)
        self._area = (int(area[0]), int(area[1]))
        self._view = (int(view[0]), int(view[1]))
        self._env: crafter.Env | None = None
        self._seed = int(seed)
        self._build(self._seed)

        width, height = self._size
        flag = Categorical(2, shape=(1,), dtype=torch.bool)
        self.observation_spec = Composite(
            {IMAGE_KEY: Bounded(0, 255, shape=(3, height, width), dtype=torch.uint8)}
            | {key: flag.clone() for key in LOG_KEYS}
        )
        self.action_spec = OneHot(len(ACTIONS))
        self.reward_spec = Unbounded(shape=(1,), dtype=torch.float32)
        self.done_spec = Composite(done=flag.clone(), terminated=flag.clone(), truncated=flag.clone())

    def _build(self, seed: int) -> None:
        # crafter seeds episode k's world with hash((seed, k)): a fresh Env restarts that sequence.
        self._env = crafter.Env(
            area=self._area, view=self._view, size=self._size, reward=True, length=self._length, seed=seed
        )

    def _set_seed(self, seed: int | None) -> None:
        if seed is None:
            seed = int(np.random.randint(0, 2**31 - 1))
        self._seed = int(seed)
        self._build(self._seed)

    @staticmethod
    def _pixels(obs: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(obs.transpose(2, 0, 1)))

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        obs = self._env.reset()
        false = torch.zeros(1, dtype=torch.bool)
        out = {IMAGE_KEY: self._pixels(obs), "done": false, "terminated": false.clone(), "truncated": false.clone()}
        out.update(achievement_flags(None))
        return TensorDict(out, batch_size=[])

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        # One-hot (bool by the spec's default; any dtype accepted) -> crafter's action index.
        action = int(tensordict.get("action").reshape(-1).to(torch.uint8).argmax())
        obs, reward, done, info = self._env.step(action)
        dead = info["discount"] == 0
        out = {
            IMAGE_KEY: self._pixels(obs),
            "reward": torch.tensor([reward], dtype=torch.float32),
            "done": torch.tensor([bool(done)]),
            "terminated": torch.tensor([bool(dead)]),
            "truncated": torch.tensor([bool(done) and not dead]),
        }
        out.update(achievement_flags(info["achievements"]))
        return TensorDict(out, batch_size=[])


def make(env_cfg: DictConfig, seed: int) -> EnvBase:
    from . import pixel_shape

    check_task(env_cfg.task)
    steps = env_cfg.get("max_episode_steps", 10000)
    _, height, width = pixel_shape(env_cfg, "crafter")
    return CrafterEnv(seed=seed, length=None if steps is None else int(steps), size=(width, height))
