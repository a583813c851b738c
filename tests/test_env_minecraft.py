"""The MineRL adapter against a fake MineRL env, and the emulated env.

MineRL cannot be installed here (it builds Minecraft at install time). `FakeMineRL` implements the part of
MineRL 0.4.4's interface the adapter uses -- `reset() -> obs`, `step(action) -> (obs, reward, done, info)`
with MineRL's observation and action dictionaries -- and fakes everything behind it: there is no world,
no rendering and no crafting; each test scripts the observations it needs and reads back the actions the
adapter sent. The env spec (`diamond_spec`) and `gym.make` need the real MineRL and are not tested here.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from torchrl.envs.utils import check_env_specs

from dreamer.envs import EnvConfigError, check_task, make_env, pixel_shape
from dreamer.envs.minecraft import ACTIONS, EQUIPPED, ITEMS, MILESTONES, VECTOR_DIM, MinecraftEnv

EMULATED = OmegaConf.load("configs/env/emulated.yaml")


def obs(inventory=None, life=20.0, food=20.0, air=300.0, mainhand="air", pov_value=0):
    return {
        "pov": np.full((64, 64, 3), pov_value, dtype=np.uint8),
        "inventory": {k: np.int64(v) for k, v in (inventory or {}).items()},
        "equipped_items": {"mainhand": {"type": mainhand, "damage": 0, "maxDamage": 0}},
        "life_stats": {"life": np.float32(life), "food": np.float32(food), "air": np.float32(air)},
    }


class FakeMineRL:
    """Plays back scripted observations; records the action dicts it receives (see the module docstring)."""

    def __init__(self, reset_obs, step_obs, done_at=None, info_at=None):
        self.reset_obs, self.step_obs = reset_obs, list(step_obs)
        self.done_at, self.info_at = done_at or set(), info_at or {}
        self.actions = []

    def reset(self):
        self.t = 0
        return self.reset_obs

    def step(self, action):
        self.actions.append(action)
        self.t += 1
        o = self.step_obs[min(self.t - 1, len(self.step_obs) - 1)]
        return o, 0.0, self.t in self.done_at, self.info_at.get(self.t, {})


def act(index: int) -> TensorDict:
    return TensorDict(action=torch.nn.functional.one_hot(torch.tensor(index), len(ACTIONS)).bool(), batch_size=[])


def run(env: MinecraftEnv, actions: list[int]):
    td = env.reset()
    out = [td]
    for a in actions:
        td = env.step(td.update(act(a))).get("next")
        out.append(td)
    return out


def test_observation_conversion():
    o = obs({"log": 2, "log2": 3, "dirt": 7, "diamond": 1}, life=10, food=5, air=150, mainhand="stone_pickaxe",
            pov_value=9)
    o["pov"][0, 1, 2] = 200
    env = MinecraftEnv(FakeMineRL(o, [obs({"log": 1})]), max_episode_steps=100)
    first, second = run(env, [0])
    assert first.get("pixels").shape == (3, 64, 64) and first.get("pixels").dtype == torch.uint8
    assert int(first.get("pixels")[2, 0, 1]) == 200  # HWC -> CHW
    vector = first.get("vector")
    assert vector.shape == (VECTOR_DIM,)
    n = len(ITEMS)
    assert vector[ITEMS.index("log")] == 5  # log and log2 summed
    assert vector[ITEMS.index("dirt")] == 7 and vector[ITEMS.index("diamond")] == 1
    equipped = vector[2 * n : 2 * n + len(EQUIPPED)]
    assert equipped.tolist() == [float(e == "stone_pickaxe") for e in EQUIPPED]
    assert vector[-3:].tolist() == pytest.approx([0.5, 0.25, 0.5])
    # The running maximum keeps the 5 logs after the count drops to 1.
    assert second.get("vector")[ITEMS.index("log")] == 1 and second.get("vector")[n + ITEMS.index("log")] == 5
    unknown = MinecraftEnv(FakeMineRL(obs(mainhand="golden_shovel"), [obs()]), 10).reset().get("vector")
    assert unknown[2 * n + EQUIPPED.index("other")] == 1


def test_action_mapping_fills_no_op_defaults():
    fake = FakeMineRL(obs(), [obs()])
    env = MinecraftEnv(fake, max_episode_steps=100)
    run(env, list(range(len(ACTIONS))))
    names = [name for name, _ in ACTIONS]
    sent = dict(zip(names, fake.actions))
    for name, action in sent.items():
        assert set(action) == {"forward", "back", "left", "right", "jump", "sneak", "sprint", "attack", "camera",
                               "place", "equip", "craft", "nearbyCraft", "nearbySmelt"}
    assert sent["noop"]["camera"].tolist() == [0, 0] and sent["noop"]["craft"] == "none"
    assert sent["attack"]["attack"] == 1 and sent["forward"]["forward"] == 1
    assert sent["turn_left"]["camera"].tolist() == [0, -15] and sent["turn_right"]["camera"].tolist() == [0, 15]
    assert sent["jump"]["jump"] == 1 and sent["jump"]["forward"] == 1
    assert sent["place_crafting_table"]["place"] == "crafting_table"
    assert sent["craft_planks"]["craft"] == "planks"
    assert sent["craft_iron_pickaxe"]["nearbyCraft"] == "iron_pickaxe"
    assert sent["equip_stone_pickaxe"]["equip"] == "stone_pickaxe"
    assert sent["smelt_iron_ingot"]["nearbySmelt"] == "iron_ingot"
    assert len(ACTIONS) == 25


def test_sticky_jump_sticky_attack_and_pitch_limit():
    fake = FakeMineRL(obs(), [obs()])
    env = MinecraftEnv(fake, max_episode_steps=1000, break_speed=100)
    jump, attack, up, noop = (next(i for i, (n, _) in enumerate(ACTIONS) if n == k)
                              for k in ("jump", "attack", "turn_up", "noop"))
    run(env, [jump] + [noop] * 12)
    assert [a["jump"] for a in fake.actions] == [1] * 10 + [0] * 3
    fake.actions.clear()
    run(env, [attack] + [noop] * 3)
    assert [a["attack"] for a in fake.actions] == [1, 0, 0, 0]  # no sticky attack at break speed 100
    slow = FakeMineRL(obs(), [obs()])
    run(MinecraftEnv(slow, max_episode_steps=1000, break_speed=1), [attack] + [noop] * 31)
    assert [a["attack"] for a in slow.actions] == [1] * 30 + [0] * 2
    fake.actions.clear()
    run(env, [up] * 6)
    assert [float(a["camera"][0]) for a in fake.actions] == [-15.0] * 4 + [0.0] * 2  # stops at -60


def test_milestone_rewards_once_per_episode_from_the_reset_baseline_and_the_health_term():
    steps = [
        obs({"log": 1}),                  # log: +1
        obs({"log": 2}),                  # more log: nothing
        obs({"log": 0, "planks": 4}),     # planks: +1
        obs({"log": 1, "planks": 4}),     # log again in the same episode: nothing
        obs({"log": 1, "planks": 4, "dirt": 5, "crafting_table": 1}, life=16),  # table +1, health -4/20 * 0.01
    ]
    fake = FakeMineRL(obs({"stick": 3}), steps)  # sticks held at reset are the baseline: no reward
    env = MinecraftEnv(fake, max_episode_steps=100)
    out = run(env, [0] * 5)
    rewards = [float(td.get("reward")) for td in out[1:]]
    assert rewards == pytest.approx([1.0, 0.0, 1.0, 0.0, 1.0 - 0.01 * 4 / 20])
    flags = {m: bool(out[-1].get(f"log_milestone_{m}")) for m in MILESTONES}
    assert flags["log"] and flags["planks"] and flags["crafting_table"] and not flags["stick"] and not flags["diamond"]
    # A new episode rewards the same milestones again.
    again = run(env, [0])
    assert float(again[1].get("reward")) == pytest.approx(1.0)
    assert not bool(again[0].get("log_milestone_log"))


def test_episode_ends_truncated_at_the_length_terminated_on_death_truncated_on_error():
    env = MinecraftEnv(FakeMineRL(obs(), [obs()]), max_episode_steps=5)
    out = run(env, [0] * 5)
    assert [bool(td.get("done")) for td in out] == [False] * 5 + [True]
    assert bool(out[-1].get("truncated")) and not bool(out[-1].get("terminated"))
    dead = MinecraftEnv(FakeMineRL(obs(), [obs(), obs(life=0)], done_at={2}), max_episode_steps=100)
    out = run(dead, [0, 0])
    assert bool(out[-1].get("terminated")) and not bool(out[-1].get("truncated"))
    broken = MinecraftEnv(FakeMineRL(obs(), [obs()], info_at={2: {"error": "socket closed"}}), max_episode_steps=100)
    out = run(broken, [0, 0])
    assert bool(out[1].get("done")) is False and bool(out[2].get("truncated")) and bool(out[2].get("done"))


def test_emulated_env_has_the_minecraft_specs_and_is_deterministic():
    cfg = EMULATED.copy()
    cfg.step_latency = 0.0
    env = make_env(cfg, seed=3)
    check_env_specs(env)
    assert env.action_spec.shape == (25,) and env.observation_spec["vector"].shape == (VECTOR_DIM,)
    assert env.observation_spec["pixels"].shape == (3, 64, 64) == pixel_shape(cfg)
    first = [td.get("pixels") for td in run(env, [1] * 8)]
    second = [td.get("pixels") for td in run(make_env(cfg, seed=3), [1] * 8)]
    other = [td.get("pixels") for td in run(make_env(cfg, seed=4), [1] * 8)]
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not torch.equal(first[0], other[0])


def test_emulated_crafting_tree_reaches_every_milestone():
    cfg = EMULATED.copy()
    cfg.step_latency = 0.0
    env = make_env(cfg, seed=0)
    index = {name: i for i, (name, _) in enumerate(ACTIONS)}
    plan = (["attack"] * 40 + ["craft_planks"] * 8 + ["craft_stick"] * 3 + ["craft_crafting_table", "place_crafting_table",
            "craft_wooden_pickaxe", "equip_wooden_pickaxe"] + ["attack"] * 120 + ["craft_furnace", "place_furnace",
            "craft_stone_pickaxe", "equip_stone_pickaxe"] + ["attack"] * 120 + ["smelt_iron_ingot"] * 6
            + ["craft_stick", "craft_iron_pickaxe", "equip_iron_pickaxe"] + ["attack"] * 40)
    out = run(env, [index[name] for name in plan])
    assert all(bool(out[-1].get(f"log_milestone_{m}")) for m in MILESTONES)
    assert sum(float(td.get("reward")) for td in out[1:]) == pytest.approx(12.0, abs=0.2)


def test_emulated_latency_is_close_to_the_setting():
    cfg = EMULATED.copy()
    cfg.step_latency = 0.02
    env = make_env(cfg, seed=0)
    td = env.reset()
    start = time.perf_counter()
    for _ in range(25):
        td = env.step(td.update(act(0))).get("next")
    mean = (time.perf_counter() - start) / 25
    assert 0.8 * 0.02 <= mean <= 1.2 * 0.02


def test_tasks_are_checked():
    with pytest.raises(EnvConfigError, match="unknown emulated task 'nether'; available: diamond"):
        check_task(OmegaConf.create({"suite": "emulated", "task": "nether"}))
    with pytest.raises(EnvConfigError, match="MineRL is not installed here: run inside the Docker image"):
        check_task(OmegaConf.create({"suite": "minecraft", "task": "diamond"}))


def test_pixel_shape_is_each_suites_image_from_its_settings_alone():
    """What the learner reads, known without building an env (scripts/preset_costs.py); the env tests of each
    suite check it against the built env's spec."""
    cfg = EMULATED.copy()
    cfg.step_latency, cfg.size = 0.0, [48, 80]
    assert pixel_shape(cfg) == (3, 48, 80) == make_env(cfg, seed=0).observation_spec["pixels"].shape
    assert pixel_shape(OmegaConf.create({"suite": "crafter", "size": [96, 64]})) == (3, 64, 96)  # [width, height]
    assert pixel_shape(OmegaConf.create({"suite": "atari"})) == (1, 96, 96)
    assert pixel_shape(OmegaConf.create({"suite": "atari", "gray": False, "size": [64, 64]})) == (3, 64, 64)
    assert pixel_shape(OmegaConf.create({"suite": "dmc", "obs": "proprio"})) is None
    assert pixel_shape(OmegaConf.create({"suite": "dmc", "obs": "both"})) == (3, 64, 64)
    assert pixel_shape(OmegaConf.create({"suite": "gym"})) is None
    for size in ([64], [64, 64, 3], [64.5, 64], [0, 64]):
        with pytest.raises(EnvConfigError, match=r"^emulated size must be \[height, width\] in pixels, got "):
            pixel_shape(OmegaConf.create({"suite": "emulated", "size": size}))
