"""Synchronous collection: step every env once per call and return one replay record per env.

Record t of an env holds the carry that the policy had before seeing o[t] (state z[t-1], belief h[t-1],
action a[t-1], is_init) and, under `next`, o[t] with the reward and done flags that arrived with it.
The policy turns it into z[t], h[t], a[t]; a[t] goes to the env, or the env is reset when o[t] ended
the episode. The layout is the one `dreamer.agent` documents.

Faults: an env that raises in `step` or `reset` is closed and rebuilt; its episode ends as truncated at
the last good observation (repeated once with done set, reward 0), so replay never joins two episodes.
`max_restarts` failures in a row of the same env stop collection with a CollectionError. Non-finite
observations or rewards stop it at once: they mean the env is broken, not unlucky.

The worker processes that run this collector one env each live in `dreamer.workers`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.envs import EnvBase, ExplorationType, set_exploration_type

from dreamer.agent import IMAGE_KEY, ActingPolicy, EnvLayout, ModelSize, record_zeros

FLAGS = ("done", "terminated")
LOG_PREFIX = "log_"


class CollectionError(RuntimeError):
    """Collection cannot go on; the message is one line for the user."""


@dataclass
class Episode:
    env: int
    score: float
    length: int
    truncated_by_fault: bool = False
    stats: dict[str, float] = field(default_factory=dict)  # the env's log_<name> flags at the end


def shares(count: int, envs: int) -> list[int]:
    """The episodes each of `envs` envs gives to an evaluation of `count`: env i gives count // envs, one more
    for i < count % envs."""
    return [count // envs + (i < count % envs) for i in range(envs)]


class Collector:
    """Drives envs with the acting policy (random exploration, or the policy's mode for evaluation)."""

    def __init__(
        self,
        envs: list[EnvBase],
        rebuild: Callable[[int], EnvBase],
        policy: ActingPolicy,
        layout: EnvLayout,
        size: ModelSize,
        device: torch.device,
        explore: bool = True,
        suite: str = "env",
        max_restarts: int = 10,
    ):
        self.envs = envs
        self.rebuild = rebuild
        self.policy = policy
        self.layout = layout
        self.device = torch.device(device)
        self.explore = explore
        self.suite = suite
        self.max_restarts = max_restarts
        self.keys = list(layout.vector_keys) + ([IMAGE_KEY] if layout.image_shape is not None else [])
        n = len(envs)
        self.carry = record_zeros(layout, size, (n,)).select("state", "belief", "action")  # before any step
        self.observed: list[TensorDictBase] | None = None
        self.states: list[TensorDictBase] = []  # each env's own tensordict (e.g. step counters) between steps
        self.is_init = torch.ones(n, 1, dtype=torch.bool)
        self.scores = [0.0] * n
        self.lengths = [0] * n
        self.env_steps = [0] * n  # steps of each env since the collector started, for error messages
        self.failures = [0] * n  # failures in a row, per env
        self.faulted = [False] * n
        self.restarts = 0
        # Seconds spent, summed over calls of `step`: in the policy's call (for a worker: the inference
        # server's round trip), in the envs' own calls (step, reset, rebuild), and in all of `step`; the
        # rest of `step` is this class's own work (records, checks).
        self.seconds = {"policy": 0.0, "env": 0.0, "step": 0.0}
        self._action_specs: dict[int, tuple] = {}  # id(env) -> (env, its action spec)

    def _observe(self, td: TensorDictBase, first: bool, index: int) -> TensorDictBase:
        out = {key: td.get(key).clone() for key in self.keys}
        if first:
            out["reward"] = torch.zeros(1)
            for flag in FLAGS:
                out[flag] = torch.zeros(1, dtype=torch.bool)
        else:
            out["reward"] = td.get("reward").float().reshape(1)
            for flag in FLAGS:
                out[flag] = td.get(flag).reshape(1)
        for key in [*self.keys, "reward"]:
            value = out[key]
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise CollectionError(
                    f"{self.suite} env {index} returned a non-finite {key} (nan or inf) at its step "
                    f"{self.env_steps[index]}; the environment is broken: fix it or its settings"
                )
        return TensorDict(out, batch_size=td.batch_size, device=td.device)

    def _count_failure(self, index: int, error: Exception) -> None:
        self.failures[index] += 1
        self.restarts += 1
        if self.failures[index] >= self.max_restarts:
            reason = str(error).splitlines()[0] if str(error) else ""
            raise CollectionError(
                f"{self.suite} env {index} failed {self.failures[index]} times in a row, last with "
                f"{type(error).__name__}: {reason}; stopping"
            )

    def _replace(self, index: int) -> None:
        self._action_specs.pop(id(self.envs[index]), None)
        try:
            self.envs[index].close()
        except Exception:  # a broken env may not close cleanly; it is replaced either way
            pass
        self.envs[index] = self.rebuild(index)

    def _fail(self, index: int, error: Exception) -> None:
        """Rebuilds an env whose step raised and ends its episode as truncated (module docstring)."""
        self._count_failure(index, error)
        self._replace(index)
        self.states[index] = None
        last = self.observed[index].clone()
        last.set("reward", torch.zeros(1))
        last.set("done", torch.ones(1, dtype=torch.bool))
        last.set("terminated", torch.zeros(1, dtype=torch.bool))
        self.observed[index] = last
        self.faulted[index] = True

    def _reset(self, index: int) -> None:
        self.states[index] = self.envs[index].reset()
        self.observed[index] = self._observe(self.states[index], first=True, index=index)
        self.is_init[index] = True

    def _reset_or_rebuild(self, index: int) -> None:
        """Resets env `index`, rebuilding it while its reset raises (up to max_restarts in a row)."""
        while True:
            try:
                self._reset(index)
                return
            except CollectionError:
                raise
            except Exception as error:
                self._count_failure(index, error)
                self._replace(index)

    def reset(self) -> None:
        self.states = [None] * len(self.envs)
        self.observed = [None] * len(self.envs)
        for index in range(len(self.envs)):
            self._reset_or_rebuild(index)
        self.scores = [0.0] * len(self.envs)
        self.lengths = [0] * len(self.envs)

    def _env_action(self, env: EnvBase, action: torch.Tensor) -> torch.Tensor:
        known, spec = self._action_specs.get(id(env), (None, None))
        if known is not env:  # read once per env object (torchrl's spec lookup is slow for every step)
            spec = env.action_spec
            self._action_specs[id(env)] = (env, spec)
        if self.layout.discrete:
            return action.to(spec.dtype)
        # Continuous policies act in [-1, 1]; the env's box is an affine map of it.
        action = action.clamp(-1.0, 1.0)
        low, high = getattr(spec.space, "low", None), getattr(spec.space, "high", None)
        if low is None:
            return action.to(spec.dtype)
        return (low + (action + 1.0) * 0.5 * (high - low)).to(spec.dtype)

    def _end_episode(self, index: int) -> Episode:
        stats = {}
        state = self.states[index]
        if state is not None:
            for key in state.keys():
                if isinstance(key, str) and key.startswith(LOG_PREFIX):
                    stats[key[len(LOG_PREFIX):]] = float(state.get(key).float().mean())
        # The length counts agent steps: the episode's records less its first (the reset's observation).
        episode = Episode(index, self.scores[index], max(self.lengths[index] - 1, 0), self.faulted[index], stats)
        self.scores[index], self.lengths[index], self.faulted[index] = 0.0, 0, False
        return episode

    def step(self) -> tuple[TensorDictBase, list[Episode]]:
        """One step of every env: returns the records [n envs] (host) and the episodes that ended."""
        began = time.perf_counter()
        if self.observed is None:
            self.reset()
        record = self.carry.clone()
        record.set("is_init", self.is_init.clone())
        # One env (a worker's): its observation with a batch dimension, the same as a stack of one.
        record.set("next", self.observed[0].unsqueeze(0) if len(self.observed) == 1 else torch.stack(self.observed))
        exploration = ExplorationType.RANDOM if self.explore else ExplorationType.DETERMINISTIC
        asked = time.perf_counter()
        # torchrl's exploration type is one setting for the whole process: a policy that fixes its own
        # (the inline source's acting copy, stepping in a thread of its own; a worker's server) is called
        # without touching it.
        own = getattr(self.policy, "sets_exploration", False)
        host = self.device.type == "cpu"  # records and answers stay where they are: a shallow copy is the policy's
        with contextlib.nullcontext() if own else set_exploration_type(exploration):
            acted = self.policy(record.copy() if host else record.to(self.device)).get("policy")
        if not host:
            acted = acted.to("cpu")
        self.seconds["policy"] += time.perf_counter() - asked
        action = acted.get("action").float()
        episodes = []
        for i, env in enumerate(self.envs):
            self.scores[i] += float(self.observed[i].get("reward"))
            self.lengths[i] += 1
            self.env_steps[i] += 1
            ended = bool(self.observed[i].get("done"))
            if ended:
                episodes.append(self._end_episode(i))
            clock = time.perf_counter()
            try:
                if ended:
                    self._reset_or_rebuild(i)
                else:
                    self.states[i].set("action", self._env_action(env, action[i]))
                    clock = time.perf_counter()
                    self.states[i] = env.step(self.states[i]).get("next")
                    self.seconds["env"] += time.perf_counter() - clock
                    clock = None
                    self.observed[i] = self._observe(self.states[i], first=False, index=i)
                    self.is_init[i] = False
                    self.failures[i] = 0
            except CollectionError:
                raise
            except Exception as error:  # the env broke: rebuild it, truncate its episode
                self._fail(i, error)
                self.is_init[i] = False
            if clock is not None:  # a reset, a rebuild or a failed step: env time too
                self.seconds["env"] += time.perf_counter() - clock
        self.carry = TensorDict(
            state=acted.get("state"), belief=acted.get("belief"), action=action, batch_size=[len(self.envs)]
        )
        self.seconds["step"] += time.perf_counter() - began
        return record, episodes

    def run_episodes(self, count: int, stop: Callable[[], bool] | None = None,
                     each: Callable[[TensorDictBase, list[Episode]], None] | None = None) -> list[Episode]:
        """Steps until `count` episodes have ended (evaluation), or until `stop()`; starts from fresh resets.

        With n envs, env i gives its first `count // n` episodes (one more for i < count % n), however long
        they are: the first `count` to end would favour short episodes. An env past its share keeps stepping
        until the others are done; its further episodes are not counted. `each(records, ended)` sees every
        step's records and the episodes that ended in it (counted or not)."""
        self.reset()
        share = shares(count, len(self.envs))
        finished: list[Episode] = []
        while len(finished) < count and not (stop and stop()):
            record, episodes = self.step()
            if each is not None:
                each(record, episodes)
            for episode in episodes:
                if share[episode.env]:
                    share[episode.env] -= 1
                    finished.append(episode)
        return finished

    def close(self) -> None:
        for env in self.envs:
            env.close()
