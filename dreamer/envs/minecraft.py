"""MineRL 0.4.4 diamond task: observation and action conversion, milestone rewards, the env spec.

The adapter (`MinecraftEnv`) wraps any gym-style env that speaks MineRL 0.4.4's dictionaries:
observations {"pov": HxWx3 uint8, "inventory": {item: count}, "equipped_items": {"mainhand": {"type": str}},
"life_stats": {"life", "food", "air"}}, actions {"forward"... "attack": 0/1, "camera": [pitch, yaw],
"place" / "equip" / "craft" / "nearbyCraft" / "nearbySmelt": item name or "none"}, and
`step(action) -> (obs, reward, done, info)`. The real one is built from `DiamondSpec` (needs MineRL and
JDK 8, so only the Docker image has it); the emulated benchmark env (`dreamer.envs.emulated`) is another.

Task definition (the reference's):
- 25 discrete actions (ACTIONS): movement, 15-degree camera steps, attack, jump, place, and the craft /
  smelt / equip actions that the milestones need; unset fields take no-op values.
- Sticky attack for 30 steps only when blocks break at normal speed (break_speed 1); sticky jump for 10
  steps; camera pitch kept within [-60, 60] degrees.
- Observation: `pixels` [3, 64, 64]; `vector` = inventory counts (log and log2 summed), their running
  maximum in the episode, one-hot of the main-hand item, health / 20, food / 20, air / 300.
- Reward: +1 the first step each of the 12 MILESTONES' count rises above its count at reset, plus
  0.01 x the change of health / 20. An `error` in MineRL's info ends the episode (truncated).
- `log_milestone_<item>` flags say which milestones the episode reached.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import torch
from omegaconf import DictConfig
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Bounded, Categorical, Composite, OneHot, Unbounded
from torchrl.envs import EnvBase

TASKS = ("diamond",)

MILESTONES = (
    "log", "planks", "stick", "crafting_table", "wooden_pickaxe", "cobblestone",
    "stone_pickaxe", "iron_ore", "furnace", "iron_ingot", "iron_pickaxe", "diamond",
)
# Inventory items observed: the milestones and the blocks and tools met on the way to a diamond.
# (MineRL can report every item; this fixed list keeps the vector small and the same for every env.)
ITEMS = MILESTONES + (
    "dirt", "stone", "coal", "torch", "gravel", "sand", "sapling", "apple", "wooden_axe", "stone_axe",
    "iron_axe", "wooden_sword", "stone_sword", "iron_sword", "diamond_pickaxe", "leaves", "flint",
)
EQUIPPED = ("air", "wooden_pickaxe", "stone_pickaxe", "iron_pickaxe", "wooden_axe", "stone_axe",
            "iron_axe", "other")
VECTOR_DIM = 2 * len(ITEMS) + len(EQUIPPED) + 3

# name -> the non-default fields of the MineRL action dict
ACTIONS: tuple[tuple[str, dict], ...] = (
    ("noop", {}),
    ("attack", {"attack": 1}),
    ("turn_up", {"camera": (-15.0, 0.0)}),
    ("turn_down", {"camera": (15.0, 0.0)}),
    ("turn_left", {"camera": (0.0, -15.0)}),
    ("turn_right", {"camera": (0.0, 15.0)}),
    ("forward", {"forward": 1}),
    ("back", {"back": 1}),
    ("left", {"left": 1}),
    ("right", {"right": 1}),
    ("jump", {"jump": 1, "forward": 1}),
    ("place_dirt", {"place": "dirt"}),
    ("craft_planks", {"craft": "planks"}),
    ("craft_stick", {"craft": "stick"}),
    ("craft_crafting_table", {"craft": "crafting_table"}),
    ("place_crafting_table", {"place": "crafting_table"}),
    ("craft_wooden_pickaxe", {"nearbyCraft": "wooden_pickaxe"}),
    ("craft_stone_pickaxe", {"nearbyCraft": "stone_pickaxe"}),
    ("craft_iron_pickaxe", {"nearbyCraft": "iron_pickaxe"}),
    ("equip_wooden_pickaxe", {"equip": "wooden_pickaxe"}),
    ("equip_stone_pickaxe", {"equip": "stone_pickaxe"}),
    ("equip_iron_pickaxe", {"equip": "iron_pickaxe"}),
    ("craft_furnace", {"nearbyCraft": "furnace"}),
    ("place_furnace", {"place": "furnace"}),
    ("smelt_iron_ingot", {"nearbySmelt": "iron_ingot"}),
)
KEYS = ("forward", "back", "left", "right", "jump", "sneak", "sprint", "attack")
ENUMS = {
    "place": ("none", "dirt", "stone", "cobblestone", "crafting_table", "furnace", "torch"),
    "equip": ("none", "air", "wooden_axe", "wooden_pickaxe", "stone_axe", "stone_pickaxe", "iron_axe",
              "iron_pickaxe"),
    "craft": ("none", "torch", "stick", "planks", "crafting_table"),
    "nearbyCraft": ("none", "wooden_axe", "wooden_pickaxe", "stone_axe", "stone_pickaxe", "iron_axe",
                    "iron_pickaxe", "furnace"),
    "nearbySmelt": ("none", "iron_ingot", "coal"),
}
STICKY_ATTACK, STICKY_JUMP, PITCH_LIMIT = 30, 10, 60.0
FLAG_KEYS = tuple(f"log_milestone_{item}" for item in MILESTONES)


def noop_action() -> dict:
    """MineRL 0.4.4's no-op action dict for the diamond spec."""
    action = {key: 0 for key in KEYS}
    action["camera"] = np.zeros(2, dtype=np.float32)
    action.update({key: "none" for key in ENUMS})
    return action


def inventory_counts(inventory: dict) -> np.ndarray:
    counts = np.fromiter((inventory.get(item, 0) for item in ITEMS), dtype=np.float32, count=len(ITEMS))
    counts[ITEMS.index("log")] += float(inventory.get("log2", 0))  # both kinds of wood are "log"
    return counts


def equipped_one_hot(equipped: dict) -> np.ndarray:
    name = str(equipped.get("mainhand", {}).get("type", "air"))
    name = "air" if name in ("none", "") else name
    one_hot = np.zeros(len(EQUIPPED), dtype=np.float32)
    one_hot[EQUIPPED.index(name) if name in EQUIPPED else EQUIPPED.index("other")] = 1.0
    return one_hot


class _Episode:
    """The adapter's state within an episode (a plain object: an env's own attributes are a module's, slower
    to set at every step)."""

    __slots__ = ("steps", "pitch", "sticky", "baseline", "reached", "maximum", "health")

    def __init__(self):
        self.steps = 0
        self.pitch = 0.0
        self.sticky = {"attack": 0, "jump": 0}
        self.baseline = None  # milestone counts at reset
        self.reached = np.zeros(len(MILESTONES), dtype=bool)
        self.maximum = np.zeros(len(ITEMS), dtype=np.float32)
        self.health = None


class MinecraftEnv(EnvBase):
    """torchrl env over a MineRL-0.4.4-style gym env (see the module docstring for the task)."""

    def __init__(self, env, max_episode_steps: int, break_speed: float = 100.0, size: tuple[int, int] = (64, 64)):
        super().__init__(batch_size=torch.Size([]))
        self._env = env
        self.max_episode_steps = int(max_episode_steps)
        self.sticky_attack_steps = STICKY_ATTACK if break_speed == 1 else 0
        height, width = size
        self.observation_spec = Composite(
            pixels=Bounded(0, 255, (3, height, width), dtype=torch.uint8),
            vector=Unbounded(VECTOR_DIM, dtype=torch.float32),
            **{f"log_milestone_{item}": Categorical(2, (1,), dtype=torch.bool) for item in MILESTONES},
        )
        self.action_spec = OneHot(len(ACTIONS))
        self.reward_spec = Unbounded(1, dtype=torch.float32)
        self.done_spec = Composite(
            done=Categorical(2, (1,), dtype=torch.bool),
            terminated=Categorical(2, (1,), dtype=torch.bool),
            truncated=Categorical(2, (1,), dtype=torch.bool),
        )
        self._new_episode()

    def _new_episode(self) -> None:
        self.episode = _Episode()

    def _convert(self, obs: dict) -> tuple[dict, float]:
        """Observation tensors by key, and the reward of the transition that produced `obs`."""
        episode = self.episode
        counts = inventory_counts(obs["inventory"])
        np.maximum(episode.maximum, counts, out=episode.maximum)
        life = obs["life_stats"]
        health = float(life["life"]) / 20.0
        milestone_counts = counts[: len(MILESTONES)]
        reward = 0.0
        if episode.baseline is None:
            episode.baseline = milestone_counts.copy()
        else:
            new = (milestone_counts > episode.baseline) & ~episode.reached
            reward += float(new.sum())
            episode.reached |= new
            reward += 0.01 * (health - episode.health)
        episode.health = health
        vector = np.concatenate([
            counts, episode.maximum, equipped_one_hot(obs["equipped_items"]),
            np.array([health, float(life["food"]) / 20.0, float(life["air"]) / 300.0], dtype=np.float32),
        ])
        pixels = torch.from_numpy(np.ascontiguousarray(obs["pov"])).permute(2, 0, 1).contiguous()
        out = {"pixels": pixels, "vector": torch.from_numpy(vector)}
        # The milestone flags [1] each: views of one fresh tensor (one conversion instead of one per flag).
        out.update(zip(FLAG_KEYS, torch.from_numpy(episode.reached.reshape(-1, 1).copy()).unbind(0)))
        return out, reward

    def minerl_action(self, index: int) -> dict:
        """The MineRL action dict for a discrete action, with sticky keys and the pitch limit applied."""
        name, fields = ACTIONS[index]
        action = noop_action()
        for key, value in fields.items():
            action[key] = np.array(value, dtype=np.float32) if key == "camera" else value
        episode = self.episode
        if name == "attack" and self.sticky_attack_steps:
            episode.sticky["attack"] = self.sticky_attack_steps
        if name == "jump":
            episode.sticky["jump"] = STICKY_JUMP
        for key in ("attack", "jump"):
            if episode.sticky[key] > 0:
                action[key] = 1
                episode.sticky[key] -= 1
        pitch = float(action["camera"][0])
        if abs(episode.pitch + pitch) > PITCH_LIMIT:
            action["camera"][0] = 0.0  # the step would look too far up or down: no pitch change
        episode.pitch += float(action["camera"][0])
        return action

    def _output(self, out: dict, terminated: bool, truncated: bool) -> TensorDict:
        """The step's or reset's tensordict: `out` with the done flags, built in one go."""
        out["terminated"], out["truncated"], out["done"] = torch.tensor(
            [[terminated], [truncated], [terminated or truncated]]).unbind(0)
        return TensorDict(out, batch_size=[])

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        self._new_episode()
        out, _ = self._convert(self._env.reset())
        return self._output(out, False, False)

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        index = int(tensordict.get("action").to(torch.uint8).argmax(-1))
        obs, _, done, info = self._env.step(self.minerl_action(index))
        self.episode.steps += 1
        out, reward = self._convert(obs)
        out["reward"] = torch.tensor([reward], dtype=torch.float32)
        error = bool(info.get("error")) if isinstance(info, dict) else False
        # MineRL's own end (death, or its time limit) and an error: the episode is over. Death is
        # terminal; a time limit or an error is a truncation.
        dead = bool(done) and float(obs["life_stats"]["life"]) <= 0
        truncated = error or (bool(done) and not dead) or self.episode.steps >= self.max_episode_steps
        return self._output(out, dead, truncated and not dead)

    def _step_proc_data(self, next_tensordict_out: TensorDictBase) -> TensorDictBase:
        # torchrl's step completes missing done flags and reshapes rewards against the specs, at every step;
        # `_step` already gives reward [1] and the three flags [1]. Its checks still run when asked for.
        if self.run_type_checks:
            return super()._step_proc_data(next_tensordict_out)
        return next_tensordict_out

    def _set_seed(self, seed: int | None) -> None:
        if seed is not None and hasattr(self._env, "seed"):
            self._env.seed(seed)

    def close(self, *, raise_if_closed: bool = True) -> None:
        if hasattr(self._env, "close"):
            self._env.close()
        super().close(raise_if_closed=raise_if_closed)


def minerl_available() -> bool:
    return importlib.util.find_spec("minerl") is not None


def check_task(task: str) -> None:
    from . import EnvConfigError

    if task not in TASKS:
        raise EnvConfigError(f"unknown minecraft task '{task}'; available: {', '.join(TASKS)}")
    if not minerl_available():
        raise EnvConfigError(
            "MineRL is not installed here: run inside the Docker image (see the README), or install "
            "JDK 8 and `pip install -e .[minecraft]`; to benchmark without it use env=emulated"
        )


def diamond_spec(max_episode_steps: int, break_speed: float, size: tuple[int, int]):
    """The MineRL 0.4.4 env spec of the task (imports MineRL: only where it is installed)."""
    from minerl.herobraine.env_specs.simple_embodiment import SimpleEmbodimentEnvSpec
    from minerl.herobraine.hero import handlers
    from minerl.herobraine.hero.handler import Handler

    class BreakSpeed(Handler):
        """Agent-start multiplier of block breaking speed."""

        def __init__(self, multiplier: float):
            self.multiplier = multiplier

        def to_string(self) -> str:
            return f"break_speed({self.multiplier})"

        def xml_template(self) -> str:
            return "<BreakSpeedMultiplier>{{multiplier}}</BreakSpeedMultiplier>"

    class DiamondSpec(SimpleEmbodimentEnvSpec):
        def __init__(self):
            super().__init__(name="DreamerDiamond-v0", max_episode_steps=max_episode_steps, resolution=size)

        def create_observables(self):
            return [
                handlers.POVObservation(self.resolution),
                handlers.FlatInventoryObservation(list(dict.fromkeys(ITEMS + ("log2",)))),
                handlers.EquippedItemObservation(items=list(EQUIPPED), _default="air", _other="other"),
                handlers.ObservationFromCurrentLocation(),
                handlers.ObservationFromLifeStats(),
            ]

        def create_actionables(self):
            return [
                *[handlers.KeybasedCommandAction(key, key) for key in KEYS],
                handlers.CameraAction(),
                handlers.PlaceBlock(list(ENUMS["place"]), _other="none", _default="none"),
                handlers.EquipAction(list(ENUMS["equip"]), _other="none", _default="none"),
                handlers.CraftAction(list(ENUMS["craft"]), _other="none", _default="none"),
                handlers.CraftNearbyAction(list(ENUMS["nearbyCraft"]), _other="none", _default="none"),
                handlers.SmeltItemNearby(list(ENUMS["nearbySmelt"]), _other="none", _default="none"),
            ]

        def create_rewardables(self):
            return []  # rewards are computed by the adapter

        def create_agent_start(self):
            return [BreakSpeed(break_speed)]

        def create_agent_handlers(self):
            return []

        def create_server_world_generators(self):
            return [handlers.DefaultWorldGenerator(force_reset=True)]

        def create_server_quit_producers(self):
            return [handlers.ServerQuitFromTimeUp(time_limit_ms=max_episode_steps * 50),
                    handlers.ServerQuitWhenAnyAgentFinishes()]

        def create_server_decorators(self):
            return []

        def create_server_initial_conditions(self):
            return [handlers.TimeInitialCondition(allow_passage_of_time=True),
                    handlers.SpawningInitialCondition(allow_spawning=True)]

        def is_from_folder(self, folder: str) -> bool:
            return False

        def get_docstring(self) -> str:
            return "Obtain a diamond: 12 milestone rewards, once per episode."

        def determine_success_from_rewards(self, rewards: list) -> bool:
            return False

    return DiamondSpec()


def make(env_cfg: DictConfig, seed: int) -> EnvBase:
    import gym

    from . import pixel_shape

    size = pixel_shape(env_cfg, "minecraft")[1:]
    spec = diamond_spec(int(env_cfg.max_episode_steps), float(env_cfg.break_speed), size)
    if spec.name not in gym.envs.registry.env_specs:
        spec.register()
    env = MinecraftEnv(gym.make(spec.name), env_cfg.max_episode_steps, env_cfg.break_speed, size)
    env.set_seed(seed)
    return env
