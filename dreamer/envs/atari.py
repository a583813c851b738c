"""Atari 2600 games through the Arcade Learning Environment (ale-py, whose ROMs ship inside the wheel).

Tasks are game names in snake_case (`pong`, `breakout`, `ms_pacman`, ...), mapped to the gymnasium ids that
ale-py registers (`ALE/Pong-v5`). The gymnasium env is built with frame skip 1 and loads, seeds and resets
the emulator; this module then drives the emulator itself, following Machado et al. (2018):

- sticky actions: the emulator repeats the previous action with probability `sticky` at every frame;
- no-op starts: a uniform number of NOOPs in [0, noops] after every reset;
- action repeat `repeat` (frame skip) with the rewards summed and the observation the pixel-wise maximum of
  the last two frames (Atari sprites flicker between frames);
- resize to `size` with area interpolation, grayscale (the emulator's own palette luminance) when `gray`;
- the full 18-action set when `actions: all`, the game's minimal set when `actions: needed`;
- losing a life does not end the episode: episodes end at game over (terminated) or after
  `max_episode_steps` agent steps (truncated).

Driving the emulator directly, rather than stacking gymnasium wrappers, skips rendering a full screen at
every emulated frame and keeps the final frame of an episode (the wrappers return a stale one).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from omegaconf import DictConfig
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Bounded, Categorical, Composite, OneHot, Unbounded
from torchrl.envs import EnvBase

# Names the DreamerV3 reference uses that differ from the ROM ids.
ALIASES = {"james_bond": "jamesbond"}
ACTION_SETS = ("all", "needed")
NOOP = 0  # index of NOOP in both the full and the minimal action set


def ale_id(task: str) -> str:
    """`ms_pacman` -> `ALE/MsPacman-v5`."""
    rom = ALIASES.get(task, task)
    return f"ALE/{rom.title().replace('_', '')}-v5"


@functools.cache
def available_tasks() -> tuple[str, ...]:
    """Game names of the ROMs that ale-py ships and registers as single-player v5 envs (no emulator)."""
    import ale_py  # noqa: F401  (importing registers the ALE/* ids with gymnasium)
    import ale_py.roms
    import gymnasium

    return tuple(sorted(rom for rom in ale_py.roms.get_all_rom_ids() if ale_id(rom) in gymnasium.registry))


def check_task(task: str) -> None:
    from . import EnvConfigError

    known = available_tasks()
    if ALIASES.get(task, task) not in known:
        raise EnvConfigError(f"unknown atari task '{task}'; available: {', '.join(known)}")


def pool_frames(previous: np.ndarray, last: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The pixel-wise maximum of the last two frames of an action repeat."""
    return np.maximum(previous, last, out=out)


class AtariEnv(EnvBase):
    """One ALE game with the key layout of `dreamer.envs`: `pixels` [C, H, W] uint8 and one-hot actions."""

    def __init__(
        self,
        task: str,
        size: tuple[int, int] = (96, 96),
        gray: bool = True,
        sticky: float = 0.25,
        noops: int = 30,
        repeat: int = 4,
        actions: str = "all",
        max_episode_steps: int = 27000,
    ):
        import ale_py  # noqa: F401
        import cv2
        import gymnasium

        super().__init__(device="cpu", batch_size=torch.Size([]))
        self._cv2 = cv2
        self.task = task
        self.size = (int(size[0]), int(size[1]))  # (height, width)
        self.gray = bool(gray)
        self.noops = int(noops)
        self.repeat = int(repeat)
        self.max_episode_steps = int(max_episode_steps)
        # frameskip=1: the repeat happens here. No frame cap inside the emulator: the step limit is ours.
        self._gym = gymnasium.make(
            ale_id(task),
            frameskip=1,
            repeat_action_probability=float(sticky),
            full_action_space=actions == "all",
            max_num_frames_per_episode=None,
            disable_env_checker=True,
        ).unwrapped
        self.ale = self._gym.ale
        self.action_set = list(self.ale.getLegalActionSet() if actions == "all" else self.ale.getMinimalActionSet())
        screen = tuple(self.ale.getScreenDims())  # (210, 160)
        frame_shape = screen if self.gray else (*screen, 3)
        self._previous = np.zeros(frame_shape, np.uint8)  # second-to-last frame of the repeat
        self._last = np.zeros(frame_shape, np.uint8)  # last frame of the repeat
        self._pooled = np.zeros(frame_shape, np.uint8)
        self._grab = self.ale.getScreenGrayscale if self.gray else self.ale.getScreenRGB
        self._rng = np.random.default_rng()
        self._pending_seed: int | None = None
        self._steps = 0

        channels = 1 if self.gray else 3
        self.observation_spec = Composite(
            pixels=Bounded(low=0, high=255, shape=(channels, *self.size), dtype=torch.uint8), shape=()
        )
        self.action_spec = OneHot(len(self.action_set), dtype=torch.int64)
        self.reward_spec = Unbounded(shape=(1,), dtype=torch.float32)
        self.done_spec = Composite(
            done=Categorical(2, shape=(1,), dtype=torch.bool),
            terminated=Categorical(2, shape=(1,), dtype=torch.bool),
            truncated=Categorical(2, shape=(1,), dtype=torch.bool),
            shape=(),
        )

    def action_meanings(self) -> list[str]:
        return [action.name for action in self.action_set]

    def _set_seed(self, seed: int | None) -> None:
        self._rng = np.random.default_rng(seed)
        self._pending_seed = None if seed is None else int(seed)

    def _observation(self, pool: bool) -> torch.Tensor:
        frame = pool_frames(self._previous, self._last, out=self._pooled) if pool else self._last
        height, width = self.size
        if frame.shape[:2] != (height, width):
            frame = self._cv2.resize(frame, (width, height), interpolation=self._cv2.INTER_AREA)
        image = frame[None] if self.gray else frame.transpose(2, 0, 1)
        return torch.from_numpy(np.ascontiguousarray(image))

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        if self._pending_seed is not None:
            # Seeds the emulator (sticky actions, game randomness), reloads the ROM and resets the game.
            self._gym.reset(seed=self._pending_seed)
            self._pending_seed = None
        else:
            self.ale.reset_game()
        for _ in range(int(self._rng.integers(0, self.noops + 1))):
            self.ale.act(self.action_set[NOOP])
            if self.ale.game_over():
                self.ale.reset_game()
        self._grab(self._last)
        self._steps = 0
        false = torch.zeros(1, dtype=torch.bool)
        return TensorDict(
            pixels=self._observation(pool=False), done=false, terminated=false.clone(), truncated=false.clone()
        )

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        action = self.action_set[int(tensordict.get("action").argmax(-1))]
        reward, over, last = 0.0, False, self.repeat - 1
        for frame in range(self.repeat):
            reward += self.ale.act(action)
            over = self.ale.game_over()
            if frame == last - 1:
                self._grab(self._previous)
            if frame == last or over:
                self._grab(self._last)
                break
        # At a game over before the last two frames there is one fresh frame only: no pooling.
        pool = self.repeat > 1 and frame >= last - 1
        self._steps += 1
        truncated = not over and self._steps >= self.max_episode_steps
        return TensorDict(
            pixels=self._observation(pool),
            reward=torch.tensor([reward], dtype=torch.float32),
            done=torch.tensor([over or truncated]),
            terminated=torch.tensor([over]),
            truncated=torch.tensor([truncated]),
        )

    def close(self, *, raise_if_closed: bool = True) -> None:
        if getattr(self, "_gym", None) is not None:
            self._gym.close()
            self._gym = None
        super().close(raise_if_closed=raise_if_closed)


def make(env_cfg: DictConfig, seed: int) -> EnvBase:
    from . import EnvConfigError, pixel_shape

    check_task(env_cfg.task)
    actions = str(env_cfg.get("actions", "all"))
    if actions not in ACTION_SETS:
        raise EnvConfigError(f"unknown atari actions '{actions}'; available: {', '.join(ACTION_SETS)}")
    channels, height, width = pixel_shape(env_cfg, "atari")
    sticky = env_cfg.get("sticky", 0.25)
    sticky = (0.25 if sticky else 0.0) if isinstance(sticky, bool) else float(sticky)
    env = AtariEnv(
        env_cfg.task,
        size=(height, width),
        gray=channels == 1,
        sticky=sticky,
        noops=int(env_cfg.get("noops", 30)),
        repeat=int(env_cfg.get("repeat", 4)),
        actions=actions,
        max_episode_steps=int(env_cfg.max_episode_steps),
    )
    env.set_seed(seed)
    return env
