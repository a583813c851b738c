"""The reference implementation's learning curves, as data (README.md here names their source).

`curve(env)` returns the curve for a run's env config (a dict, as in its config.yaml), or None where the
reference published none (gym tasks, Crafter's returns, Atari beyond the 100K benchmark, the emulated env).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent


@dataclass
class Curve:
    """Training-episode returns of the reference's seeds at `frames`: mean, min and max over seeds."""

    source: str  # file:task
    frames: np.ndarray
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray
    seeds: int

    def at(self, frames: float) -> tuple[float, float, float]:
        """(mean, min, max) at `frames`, interpolated linearly between the published points."""
        return tuple(float(np.interp(frames, self.frames, values)) for values in (self.mean, self.low, self.high))


def reference_task(env: dict) -> tuple[str, str] | None:
    """(file, task) of the reference curve for an env config, or None."""
    from dreamer.envs import DMC_DOMAIN_ALIASES

    suite, task = env.get("suite"), str(env.get("task"))
    if suite == "dmc":
        for alias, domain in DMC_DOMAIN_ALIASES.items():
            if task.startswith(alias + "_"):
                task = domain + task[len(alias):]
        return ("dmc_vision" if env.get("obs") == "pixels" else "dmc_proprio"), f"dmc_{task}"
    if suite == "atari" and float(env.get("sticky", 0.25)) == 0.0:  # the Atari 100k setting
        return "atari100k", f"atari_{task}"
    if suite == "minecraft":
        return "minecraft_diamond", "minecraft_diamond"
    return None


def load(file: str, task: str) -> Curve | None:
    """The curve of `task` in `file`.csv, or None when the file does not hold that task."""
    rows = []
    with open(HERE / f"{file}.csv", newline="") as handle:
        for row in csv.DictReader(handle):
            if row["task"] == task:
                rows.append((float(row["frames"]), float(row["mean"]), float(row["min"]), float(row["max"]),
                             int(row["seeds"])))
    if not rows:
        return None
    rows.sort()
    frames, mean, low, high, seeds = (np.array(column) for column in zip(*rows))
    return Curve(f"{file}:{task}", frames, mean, low, high, int(seeds.min()))


def curve(env: dict) -> Curve | None:
    """The reference curve for a run's env config, or None."""
    found = reference_task(env)
    return load(*found) if found else None
