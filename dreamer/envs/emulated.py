"""The emulated Minecraft env: a benchmark stand-in, never a learning task.

It speaks MineRL 0.4.4's dictionaries behind the same adapter as the real env (`MinecraftEnv`), so its
observation and action specs are exactly the Minecraft task's, and it spends a configurable time per step
and per reset (50 ms per step emulates one MineRL instance). Its content is deterministic for a seed: a
textured view that turns with the camera, and a small crafting tree (attacking yields wood, then stone,
iron ore and diamond as better pickaxes are equipped; crafting and smelting follow Minecraft's recipes
loosely) so that every milestone can be reached and the reward path is exercised.
"""

from __future__ import annotations

import time

import numpy as np
from omegaconf import DictConfig
from torchrl.envs import EnvBase

from dreamer.envs.minecraft import ITEMS, MinecraftEnv

TASKS = ("diamond",)
# What every fourth attack yields, by the tool in hand.
DIGS = {"air": ("log",), "wooden_pickaxe": ("log", "cobblestone"),
        "stone_pickaxe": ("cobblestone", "iron_ore", "log"), "iron_pickaxe": ("diamond", "cobblestone", "iron_ore")}
# crafted item -> (ingredients, amount made, needs a placed crafting table / furnace)
RECIPES = {
    "planks": ({"log": 1}, 4, None),
    "stick": ({"planks": 2}, 4, None),
    "crafting_table": ({"planks": 4}, 1, None),
    "wooden_pickaxe": ({"planks": 3, "stick": 2}, 1, "crafting_table"),
    "stone_pickaxe": ({"cobblestone": 3, "stick": 2}, 1, "crafting_table"),
    "iron_pickaxe": ({"iron_ingot": 3, "stick": 2}, 1, "crafting_table"),
    "furnace": ({"cobblestone": 8}, 1, "crafting_table"),
    "iron_ingot": ({"iron_ore": 1}, 1, "furnace"),
}


class EmulatedMineRL:
    """A MineRL-0.4.4-format gym env with deterministic content and emulated latency."""

    def __init__(self, step_latency: float, reset_latency: float, size=(64, 64), seed: int = 0, fail_every: int = 0):
        self.step_latency, self.reset_latency = float(step_latency), float(reset_latency)
        self.fail_every = int(fail_every)  # fault injection: raise on every n-th step of this instance
        self.lifetime_steps = 0
        self.height, self.width = size
        self.seed(seed)

    def seed(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        # A panorama four views wide: turning the camera slides the view across it.
        self.texture = rng.integers(0, 256, (self.height, 4 * self.width, 3), dtype=np.uint8)

    def _wait(self, start: float, latency: float) -> None:
        remaining = latency - (time.perf_counter() - start)
        if remaining > 0:
            time.sleep(remaining)

    def _obs(self) -> dict:
        offset = int(self.yaw / 15.0) % 4 * (self.width // 4) + int(self.pitch)
        view = np.roll(self.texture, -offset, axis=1)[:, : self.width]
        # Time passes: the view drifts (its shift taken modulo 256: the same view, and int16 holds it at any
        # step, where 3 x steps overflows it past step 10,922 of an episode).
        view = (view.astype(np.int16) + 3 * self.steps % 256) % 256
        return {
            "pov": view.astype(np.uint8),
            "inventory": {item: np.int64(self.inventory.get(item, 0)) for item in ITEMS + ("log2",)},
            "equipped_items": {"mainhand": {"type": self.equipped, "damage": 0, "maxDamage": 0}},
            "life_stats": {"life": np.float32(self.life), "food": np.float32(self.food), "air": np.float32(300)},
        }

    def reset(self) -> dict:
        start = time.perf_counter()
        self.steps, self.attacks, self.yaw, self.pitch = 0, 0, 0.0, 0.0
        self.inventory: dict[str, int] = {}
        self.placed: set[str] = set()
        self.equipped, self.life, self.food = "air", 20.0, 20.0
        obs = self._obs()
        self._wait(start, self.reset_latency)
        return obs

    def _craft(self, item: str) -> None:
        needs, amount, station = RECIPES[item]
        if station and station not in self.placed:
            return
        if all(self.inventory.get(k, 0) >= v for k, v in needs.items()):
            for k, v in needs.items():
                self.inventory[k] -= v
            self.inventory[item] = self.inventory.get(item, 0) + amount

    def step(self, action: dict) -> tuple[dict, float, bool, dict]:
        start = time.perf_counter()
        self.steps += 1
        self.lifetime_steps += 1
        if self.fail_every and self.lifetime_steps % self.fail_every == 0:
            raise RuntimeError(f"injected fault at step {self.lifetime_steps} (env.fail_every={self.fail_every})")
        self.pitch += float(action["camera"][0])
        self.yaw += float(action["camera"][1])
        if action["attack"]:
            self.attacks += 1
            if self.attacks % 4 == 0:
                digs = DIGS.get(self.equipped, DIGS["air"])
                found = digs[(self.attacks // 4) % len(digs)]
                self.inventory[found] = self.inventory.get(found, 0) + 1
        for key in ("craft", "nearbyCraft", "nearbySmelt"):
            if action[key] != "none":
                self._craft(action[key])
        if action["place"] != "none" and self.inventory.get(action["place"], 0) > 0:
            self.inventory[action["place"]] -= 1
            self.placed.add(action["place"])
        if action["equip"] != "none" and (action["equip"] == "air" or self.inventory.get(action["equip"], 0) > 0):
            self.equipped = action["equip"]
        if self.steps % 100 == 0:  # hunger and a little damage, deterministically
            self.food = max(0.0, self.food - 1.0)
            self.life = max(1.0, self.life - 1.0) if self.food < 10 else min(20.0, self.life + 1.0)
        obs = self._obs()
        self._wait(start, self.step_latency)
        return obs, 0.0, False, {}

    def close(self) -> None:
        pass


def check_task(task: str) -> None:
    from . import EnvConfigError

    if task not in TASKS:
        raise EnvConfigError(f"unknown emulated task '{task}'; available: {', '.join(TASKS)}")


def make(env_cfg: DictConfig, seed: int) -> EnvBase:
    from . import pixel_shape

    size = pixel_shape(env_cfg, "emulated")[1:]
    backend = EmulatedMineRL(env_cfg.step_latency, env_cfg.reset_latency, size, seed, env_cfg.get("fail_every", 0))
    return MinecraftEnv(backend, env_cfg.max_episode_steps, env_cfg.break_speed, size)
