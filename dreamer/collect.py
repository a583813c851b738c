"""Synchronous collection: step every env once per call and return one replay record per env.

Record t of an env holds the carry that the policy had before seeing o[t] (state z[t-1], belief h[t-1],
action a[t-1], is_init) and, under `next`, o[t] with the reward and done flags that arrived with it.
The policy turns it into z[t], h[t], a[t]; a[t] goes to the env, or the env is reset when o[t] ended
the episode. The layout is the one `dreamer.agent` documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.envs import EnvBase, ExplorationType, set_exploration_type

from dreamer.agent import ActingPolicy, EnvLayout, ModelSize, IMAGE_KEY

FLAGS = ("done", "terminated")


@dataclass
class Episode:
    env: int
    score: float
    length: int


class Collector:
    """Drives a list of envs with the acting policy (random exploration, or its mode for evaluation)."""

    def __init__(
        self,
        envs: list[EnvBase],
        policy: ActingPolicy,
        layout: EnvLayout,
        size: ModelSize,
        device: torch.device,
        explore: bool = True,
    ):
        self.envs = envs
        self.policy = policy
        self.layout = layout
        self.device = torch.device(device)
        self.explore = explore
        self.keys = list(layout.vector_keys) + ([IMAGE_KEY] if layout.image_shape is not None else [])
        n = len(envs)
        self.carry = TensorDict(
            state=torch.zeros(n, size.latent),
            belief=torch.zeros(n, size.deter),
            action=torch.zeros(n, layout.action_dim),
            batch_size=[n],
        )
        self.observed: list[TensorDictBase] | None = None
        self.states: list[TensorDictBase] = []  # each env's own tensordict (e.g. step counters) between steps
        self.is_init = torch.ones(n, 1, dtype=torch.bool)
        self.scores = [0.0] * n
        self.lengths = [0] * n

    def _observe(self, td: TensorDictBase, first: bool) -> TensorDictBase:
        out = td.select(*self.keys).clone()
        if first:
            out.set("reward", torch.zeros(1))
            for flag in FLAGS:
                out.set(flag, torch.zeros(1, dtype=torch.bool))
        else:
            out.set("reward", td.get("reward").float().reshape(1))
            for flag in FLAGS:
                out.set(flag, td.get(flag).reshape(1))
        return out

    def _env_action(self, env: EnvBase, action: torch.Tensor) -> torch.Tensor:
        spec = env.action_spec
        if self.layout.discrete:
            return action.to(spec.dtype)
        # Continuous policies act in [-1, 1]; the env's box is an affine map of it.
        action = action.clamp(-1.0, 1.0)
        low, high = getattr(spec.space, "low", None), getattr(spec.space, "high", None)
        if low is None:
            return action.to(spec.dtype)
        return (low + (action + 1.0) * 0.5 * (high - low)).to(spec.dtype)

    def reset(self) -> None:
        self.states = [env.reset() for env in self.envs]
        self.observed = [self._observe(state, first=True) for state in self.states]
        self.is_init.fill_(True)
        self.scores = [0.0] * len(self.envs)
        self.lengths = [0] * len(self.envs)

    def step(self) -> tuple[TensorDictBase, list[Episode]]:
        """One step of every env: returns the records [n envs] (host) and the episodes that ended."""
        if self.observed is None:
            self.reset()
        record = self.carry.clone()
        record.set("is_init", self.is_init.clone())
        record.set("next", torch.stack(self.observed))
        exploration = ExplorationType.RANDOM if self.explore else ExplorationType.DETERMINISTIC
        with set_exploration_type(exploration):
            acted = self.policy(record.to(self.device)).get("policy").to("cpu")
        action = acted.get("action").float()
        episodes = []
        for i, env in enumerate(self.envs):
            self.scores[i] += float(self.observed[i].get("reward"))
            self.lengths[i] += 1
            if bool(self.observed[i].get("done")):
                episodes.append(Episode(i, self.scores[i], self.lengths[i]))
                self.scores[i], self.lengths[i] = 0.0, 0
                self.states[i] = env.reset()
                self.observed[i] = self._observe(self.states[i], first=True)
                self.is_init[i] = True
            else:
                self.states[i].set("action", self._env_action(env, action[i]))
                self.states[i] = env.step(self.states[i]).get("next")
                self.observed[i] = self._observe(self.states[i], first=False)
                self.is_init[i] = False
        self.carry = TensorDict(
            state=acted.get("state"), belief=acted.get("belief"), action=action, batch_size=[len(self.envs)]
        )
        return record, episodes

    def run_episodes(self, count: int) -> list[Episode]:
        """Steps until `count` episodes have ended (evaluation); starts from fresh resets."""
        self.reset()
        finished: list[Episode] = []
        while len(finished) < count:
            _, episodes = self.step()
            finished.extend(episodes)
        return finished[:count]

    def close(self) -> None:
        for env in self.envs:
            env.close()
