"""Environments: `make_env(env_cfg, seed, index)` returns a torchrl EnvBase with the project's key layout.

Every suite gives observations (flat float32 vectors and/or `pixels` [C, H, W] uint8), `reward` [1]
float32, and `done` / `terminated` / `truncated` [1] bool; discrete actions are one-hot (OneHot spec),
continuous ones lie in [-1, 1]. Entries named `log_<name>` (bool [1], e.g. an achievement unlocked in the
current episode) are not observations: the collector reads them at the end of each episode for logging.
Episode boundaries (`is_init`) and the latent carry are added by the collector, not here.
"""

from __future__ import annotations

import importlib

from omegaconf import DictConfig
from torchrl.envs import EnvBase

# suite name -> module in this package exposing make(env_cfg, seed) and check_task(task)
SUITES = {
    "gym": "gym",
    "crafter": "crafter",
    "dmc": "dmc",
    "atari": "atari",
    "minecraft": "minecraft",
    "emulated": "emulated",
}


# dmc domain names accepted beside dm_control's own (`cup_catch` is `ball_in_cup_catch`)
DMC_DOMAIN_ALIASES = {"cup": "ball_in_cup"}


def frames_per_step(env_cfg) -> int:
    """Frames per agent step, as the reference counts them: the action repeat (dmc, atari), else 1."""
    return int(env_cfg.get("repeat", 1)) if env_cfg.get("suite") in ("dmc", "atari") else 1


class EnvConfigError(ValueError):
    """A bad environment setting; the message is one line for the user."""


# Each image suite's `size` setting: its default when unset, and whether it is [width, height] (crafter's
# own order) rather than [height, width]. Its `pixels` have 3 channels, atari's 1 with `gray`.
PIXEL_SIZES = {"dmc": ((64, 64), False), "atari": ((96, 96), False), "crafter": ((64, 64), True),
               "minecraft": ((64, 64), False), "emulated": ((64, 64), False)}


def pixel_shape(env_cfg, suite: str | None = None) -> tuple[int, int, int] | None:
    """The [C, H, W] of the `pixels` of `suite` (default: `env_cfg.suite`) from its settings, or None where it
    renders none (gym, dmc's proprio). The adapters build their images to it; no env is built here, so a
    suite's packages (ALE, Crafter, MineRL) need not be installed to know it."""
    suite = suite or env_cfg.get("suite")
    if suite not in PIXEL_SIZES or (suite == "dmc" and env_cfg.get("obs", "proprio") == "proprio"):
        return None
    default, width_first = PIXEL_SIZES[suite]
    size = env_cfg.get("size", None) or default
    if len(size) != 2 or not all(isinstance(n, int) and n > 0 for n in size):
        order = "[width, height]" if width_first else "[height, width]"
        raise EnvConfigError(f"{suite} size must be {order} in pixels, got {list(size)}")
    height, width = (size[1], size[0]) if width_first else (size[0], size[1])
    channels = 1 if suite == "atari" and env_cfg.get("gray", True) else 3
    return channels, int(height), int(width)


def suite_module(suite: str):
    if suite not in SUITES:
        raise EnvConfigError(f"unknown env suite '{suite}'; available: {', '.join(sorted(SUITES))}")
    return importlib.import_module(f"{__name__}.{SUITES[suite]}")


def check_task(env_cfg: DictConfig) -> None:
    """Raises EnvConfigError when the task does not exist in its suite (cheap: builds no environment)."""
    suite_module(env_cfg.suite).check_task(env_cfg.task)


def make_env(env_cfg: DictConfig, seed: int, index: int = 0) -> EnvBase:
    """One environment of the suite named by env_cfg.suite, seeded with seed + index."""
    return suite_module(env_cfg.suite).make(env_cfg, seed + index)
