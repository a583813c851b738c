"""The experience source the training loop asks for records, and the updates it owes for them.

A source puts records into replay and tells the loop how many env steps it added and which episodes
ended; it acts with a policy whose weights it refreshes from the learner's. Two implementations:

- `InlineSource` (`run.collect=inline`): the trainer steps its `run.envs` envs itself, one batched policy
  call per step of all of them.
- `WorkerSource` (`run.collect=workers`): one env per worker process (`dreamer.workers`), acting through
  the batched inference server (`dreamer.inference`); an ingest thread adds their chunks to replay.
  `run.collect=auto` is this one on a CUDA learner, the inline one on CPU (`dreamer.config.Settings`).
  With `run.collect=ray` the same source's envs are Ray actors on any node of a cluster
  (`dreamer.ray_workers`), acting through the same server on this node.

Both act with a copy of the policy's weights, refreshed every `run.sync_every` updates without the
learner waiting (`dreamer.inference.WeightSync`), so acting never waits for the updates queued on the
learner's stream. On a CUDA learner the inline source's copy runs on a CUDA stream of its own (high
priority, a CUDA graph of the whole batch of envs), and its step runs one step ahead in a thread of its
own: while the loop queues and runs the owed updates, the next actions are computed beside them and the
envs step on the CPU (`InlineSource`). The update ratio is untouched (the loop owes and runs updates exactly as
before); what changes is the acting weights' age: at most `run.sync_every` updates plus the updates
queued on the device when a sync is applied, reported as `collect/weights_age` (updates). On a CPU
learner there is nothing to overlap: the inline source acts with the learner's own weights (age 0).

`Updates` runs what the ratio owes: sample, update, write-back, and the source's weight sync.
`scripts/bench_pipeline.py` measures these same pieces.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch
from tensordict import TensorDictBase

from dreamer.agent import ActingPolicy, EnvLayout, ModelSize
from dreamer.collect import CollectionError, Collector, Episode
from dreamer.config import setting
from dreamer.envs import make_env
from dreamer.inference import WeightSync, request_spec


class Source:
    """What the training loop needs from collection (module docstring)."""

    envs: int

    def start(self) -> None:
        """Starts collecting (after the learner's warm-up: its compile must not compete with collection)."""

    def gather(self) -> tuple[int, list[Episode]]:
        """The next records into replay: (env steps added, episodes ended)."""
        raise NotImplementedError

    def synced(self, updates: int) -> None:
        """After each update (`updates` so far): refreshes the acting weights when a sync is due."""

    def settle(self) -> None:
        """Until no step of this source runs in the training process (before an evaluation: torchrl's
        exploration type is one setting for the whole process, and an evaluation sets its own)."""

    def stats(self) -> dict[str, float]:
        """Figures for a metrics record, over the time since the previous call."""
        return {}

    @property
    def restarts(self) -> int:
        """Env rebuilds and worker restarts so far."""
        return 0

    def close(self) -> None:
        """Stops collecting; never waits long on a hung env or worker."""


class StepTimes:
    """Where a collector's step time went, between two calls of `since`: per step, in ms."""

    PARTS = ("policy", "env", "step", "loop")  # then, from the worker source only: served, wake

    def __init__(self):
        self.last: tuple[int, list[float] | None] = (0, None)

    def since(self, steps: int, seconds: list[float]) -> dict[str, float]:
        """steps: collector steps so far; seconds: the PARTS summed so far, and for workers the policy
        round trip's served and wake parts (`WorkerPool.timing`); {} when no step was taken."""
        last, self.last = self.last, (steps, list(seconds))
        if steps <= last[0]:
            return {}
        count = steps - last[0]
        before = last[1] or [0.0] * len(seconds)
        per = [(now - then) * 1e3 / count for now, then in zip(seconds, before)]
        policy, env, step, loop = per[:4]
        figures = {"collect/policy_ms": policy, "collect/env_ms": env, "collect/own_ms": step - policy - env,
                   "collect/between_ms": loop - step}
        if len(per) == 6:
            figures["collect/served_ms"], figures["collect/wake_ms"] = per[4], per[5]
        return figures


class ActingCopy:
    """The inline source's acting policy on a CUDA device: its own weights and CUDA stream (module docstring).

    A call takes the records [n envs] on the host and returns the policy's answer on the host. Inputs go
    through pinned buffers into static device buffers and the answer comes back through pinned buffers,
    all on this stream: nothing waits for the learner's stream (a tensordict `.to("cpu")` would
    synchronize the device).
    """

    sets_exploration = True  # it samples its actions (explores) whatever the process-wide setting says

    def __init__(self, policy: ActingPolicy, layout: EnvLayout, size: ModelSize, envs: int, device: torch.device,
                 cudagraph: bool, sync_every: int):
        from dreamer.inference import _Acting, _ServingGraph, _tensors

        self.device = torch.device(device)
        self.sync_every = sync_every
        self.acting = copy.deepcopy(policy).requires_grad_(False).eval()
        self.stream = torch.cuda.Stream(self.device, priority=-1)  # scheduled first beside the learner
        self.lock = threading.Lock()  # a call and a weight copy never interleave
        served = _Acting(self.acting, explore=True)
        example = request_spec(layout, size).expand(envs).clone().to(self.device)
        self.keys = list(example.keys(include_nested=True, leaves_only=True))
        with torch.cuda.stream(self.stream):
            if cudagraph:
                self.graph = _ServingGraph(served, example)
                self.inputs = self.graph.inputs
            else:
                self.graph, self.inputs = None, example
                self.served = served
            self.outputs = self.graph.outputs if self.graph else served(example.copy())
        self.stream.synchronize()
        self.out_keys = list(self.outputs.keys(include_nested=True, leaves_only=True))
        # Pinned host buffers for the inputs and the answer; reused by each call once the last has ended.
        self.staged = request_spec(layout, size).expand(envs).clone().pin_memory()
        self.host = {key: torch.empty(self.outputs.get(key).shape, dtype=self.outputs.get(key).dtype,
                                      pin_memory=True) for key in self.out_keys}
        target = _tensors(self.acting)
        self.version = self.pending = 0  # the learner's update count of the weights in use / being copied
        self.updates = 0
        self.ages: list[int] = []  # the weights' age at each call since the last stats

        def apply() -> None:  # in WeightSync's thread, once the staging copies have ended
            with self.lock, torch.cuda.stream(self.stream), torch.no_grad():
                torch._foreach_copy_(target, self.sync.staging)
                self.stream.synchronize()
                self.version = self.pending

        self.sync = WeightSync(_tensors(policy), [torch.empty_like(t) for t in target], apply)

    @torch.no_grad()
    def __call__(self, record: TensorDictBase) -> TensorDictBase:
        with self.lock, torch.cuda.stream(self.stream):
            self.staged.update_(record.select(*self.keys))  # into pinned memory: the upload is a plain DMA
            if self.graph is not None:  # copies the records into the graph's inputs, then replays it
                outputs = self.graph(self.staged)
            else:
                self.inputs.update_(self.staged, non_blocking=True)
                outputs = self.served(self.inputs.copy())
            for key in self.out_keys:
                self.host[key].copy_(outputs.get(key), non_blocking=True)
            self.stream.synchronize()
            self.ages.append(self.updates - self.version)
        for key, value in self.host.items():
            record.set(key, value.clone())
        return record

    def synced(self, updates: int) -> None:
        self.updates = updates
        if updates % self.sync_every == 0 and self.sync.idle.is_set():
            self.pending = updates
            self.sync()

    def stats(self) -> dict[str, float]:
        ages, self.ages = self.ages, []
        return {"collect/weights_age": sum(ages) / len(ages)} if ages else {}

    def close(self) -> None:
        self.sync.close()


class InlineSource(Source):
    """`run.collect=inline`: the trainer steps `run.envs` envs, one batched policy call per step.

    On a CUDA learner each step runs in a thread of its own, one step ahead of the loop: `gather` takes
    the step that thread has finished (its records already in replay) and starts the next one, which
    then acts and steps the envs while the loop queues and runs the updates owed for the last one. The
    records and their order are those of stepping in the loop's thread (the collector is the same,
    called once per `gather`); the thread only moves the collector's CPU time out of the loop's way, so
    the learner's queue does not drain while the envs step. On a CPU learner the step runs in the
    loop's thread: the acting policy is the learner's own, updated in place between steps.
    """

    def __init__(self, cfg, policy: ActingPolicy, layout: EnvLayout, size: ModelSize, device: torch.device,
                 cudagraph: bool, replay, ahead: bool | None = None):
        """`ahead`: step in a thread of its own (default: on a CUDA learner)."""
        self.envs, self.replay = cfg.run.envs, replay
        self.acting = ActingCopy(policy, layout, size, self.envs, device, cudagraph, cfg.run.sync_every) \
            if torch.device(device).type == "cuda" else None
        ahead = self.acting is not None if ahead is None else ahead
        self.ahead = ThreadPoolExecutor(1, thread_name_prefix="dreamer-inline-step") if ahead else None

        def build() -> Collector:
            return Collector(
                [make_env(cfg.env, cfg.seed, i) for i in range(self.envs)], lambda i: make_env(cfg.env, cfg.seed, i),
                self.acting or policy, layout, size, "cpu" if self.acting else device, suite=cfg.env.suite)

        # The envs are made, stepped and closed in one thread: an image env's EGL context (DeepMind Control's
        # renderer) becomes current on the thread that made it, and the last one made there could not be
        # rendered from another (its first step failed and the env was rebuilt, at every start).
        if self.ahead is None:
            self.collector = build()
        else:
            try:
                self.collector = self.ahead.submit(build).result()  # an env's error is raised here
            except BaseException:
                self.ahead.shutdown(wait=False)
                raise
        self.times, self.steps, self.looped, self.last = StepTimes(), 0, 0.0, None
        self.next: Future | None = None  # the step running ahead in that thread

    def _step(self) -> tuple[int, list[Episode]]:
        records, episodes = self.collector.step()
        self.replay.add(records)
        now = time.perf_counter()
        if self.last is not None:  # loop - step: the time between two steps (waiting for the next gather)
            self.looped += now - self.last
        self.last = now
        self.steps += 1
        return self.envs, episodes

    def gather(self) -> tuple[int, list[Episode]]:
        if self.ahead is None:
            return self._step()
        step = self.next or self.ahead.submit(self._step)
        self.next = None
        result = step.result()  # a CollectionError of the step is raised here
        self.next = self.ahead.submit(self._step)
        return result

    def synced(self, updates: int) -> None:
        if self.acting is not None:
            self.acting.synced(updates)

    def settle(self) -> None:
        if self.next is not None:
            wait([self.next])  # its result (or error) is taken by the next gather

    def stats(self) -> dict[str, float]:
        seconds = self.collector.seconds
        figures = self.times.since(self.steps, [seconds["policy"], seconds["env"], seconds["step"], self.looped])
        return {**figures, **(self.acting.stats() if self.acting else {"collect/weights_age": 0.0})}

    @property
    def restarts(self) -> int:
        return self.collector.restarts

    def close(self) -> None:
        """After the step running ahead (its records are not counted: the run ends before them).

        The envs close in the thread that made and stepped them (see __init__: an image env's EGL context
        stays current there, and freeing it from another thread fails). Only if that thread is still busy
        after 60 s do they close in the caller's."""
        closed, error = False, None
        if self.ahead is not None:
            if self.next is not None:
                wait([self.next], timeout=60)
            closing = self.ahead.submit(self.collector.close)
            if wait([closing], timeout=60).done:
                closed, error = True, closing.exception()
            self.ahead.shutdown(wait=False, cancel_futures=True)
        if self.acting is not None:
            self.acting.close()
        if not closed:
            self.collector.close()
        if error is not None:
            raise error


class WorkerSource(Source):
    """`run.collect=workers`: worker processes, the inference server on `device`, and the ingest thread.

    `run.inference=auto` puts a GPU server in a process of its own, also when it shares the learner's
    GPU: measured on one H200 (BENCHMARKS.md), the learner is busier and collection faster that way than
    with the server as a thread, whose Python competes with the trainer's for one interpreter lock. A
    CPU server runs as a thread of the trainer.
    """

    def __init__(self, cfg, policy: ActingPolicy, layout: EnvLayout, size: ModelSize, device: torch.device,
                 cudagraph: bool, replay, announce: Callable[[str], None] | None = print, ray: bool = False):
        self.cfg, self.policy, self.layout, self.size, self.ray = cfg, policy, layout, size, ray
        self.device, self.cudagraph, self.replay, self.announce = torch.device(device), cudagraph, replay, announce
        self.envs = cfg.run.envs
        self.inference = self.pool = self.ingest = None
        self.times = StepTimes()
        self._started: float | None = None
        from dreamer.workers import worker_context

        worker_context(cfg.env.suite, cfg.run.worker_start)  # a fork server imports during the warm-up

    def start(self) -> None:
        """The server (started), then the workers and the ingest thread. CollectionError, one line, when
        the server cannot start."""
        from omegaconf import OmegaConf

        from dreamer.inference import Inference
        from dreamer.workers import Ingest, WorkerPool

        cfg = self.cfg
        own_process = cfg.run.inference == "process" or (cfg.run.inference == "auto" and self.device.type == "cuda")
        began = time.monotonic()
        self.inference = Inference(self.policy, self.layout, self.size, self.envs, self.device, self.cudagraph,
                                   batch_wait=cfg.run.inference_wait_ms / 1000, process=own_process,
                                   threads=int(setting(cfg, "run.inference_threads")))
        try:
            self.inference.start()
        except RuntimeError as error:
            self.inference.close()
            self.inference = None
            raise CollectionError(f"the inference server did not start: {str(error).splitlines()[0]}") from None
        inference, replay = self.inference, self.replay

        def restarted(stream: int) -> None:  # a dead worker's stream ends where replay's data ends
            inference.forget_slot(stream)
            replay.end_stream(stream)

        served = time.monotonic()
        env_cfg = OmegaConf.to_container(cfg.env, resolve=True)
        if self.ray:
            from dreamer.ray_workers import RayPool

            # The pump holds the slots and never leaves a request in one when it replaces an actor: only a
            # dead pump's slots need forgetting (RayPool).
            self.pool = RayPool(env_cfg, cfg.seed, self.layout, self.size, inference.clients, cfg.run.chunk,
                                cfg.env.suite, on_restart=replay.end_stream, stall_seconds=cfg.run.worker_stall_s,
                                start_method=cfg.run.worker_start, address=setting(cfg, "run.ray_address"),
                                env_cpus=setting(cfg, "run.ray_env_cpus"),
                                env_memory_gb=setting(cfg, "run.ray_env_memory_gb"),
                                envs_per_pump=setting(cfg, "run.ray_envs_per_pump"), pump=setting(cfg, "run.ray_pump"),
                                forget_slot=inference.forget_slot, announce=self.announce).start()
        else:
            self.pool = WorkerPool(env_cfg, cfg.seed, self.layout, self.size, inference.clients, cfg.run.chunk,
                                   cfg.env.suite, on_restart=restarted, stall_seconds=cfg.run.worker_stall_s,
                                   start_method=cfg.run.worker_start).start()
        # At most a chunk per worker ahead of the loop (backpressure: see Ingest).
        self.ingest = Ingest(self.pool, replay, alive=lambda: inference.alive,
                             max_pending=self.envs * cfg.run.chunk).start()
        self._started = time.monotonic()  # until every worker has stepped: see gather
        if self.announce:
            workers = "Ray env workers (actors)" if self.ray else "env worker processes"
            self.announce(f"dreamer: {self.envs} {workers}, inference server on {self.device} "
                          f"({'its own process' if own_process else 'a thread'}, ready in {served - began:.1f} s)")

    def gather(self, timeout: float = 1.0) -> tuple[int, list[Episode]]:
        self.inference.check()  # here too: before the loop's next weight sync meets a dead server
        if self._started is not None and all(self.pool.stepped):  # the start-up's cost, said once
            if self.announce:
                self.announce(f"dreamer: all {self.envs} env workers stepping {time.monotonic() - self._started:.1f} s "
                              f"after their start")
            self._started = None
        return self.ingest.take(timeout=timeout)  # the chunks are added to replay by the ingest thread

    def synced(self, updates: int) -> None:
        if updates % self.cfg.run.sync_every == 0:
            self.inference.sync()  # never waits for the server

    def stats(self) -> dict[str, float]:
        return {**self.inference.stats(), **self.times.since(*self.pool.timing()), **self.pool.stats()}

    @property
    def restarts(self) -> int:
        return self.pool.restarts if self.pool else 0

    def close(self) -> None:
        for part in (self.ingest, self.pool, self.inference):
            if part is not None:
                part.close()


def make_source(cfg, policy: ActingPolicy, layout: EnvLayout, size: ModelSize, topology, cudagraph: bool,
                replay, collect: str) -> Source:
    """The source `collect` names (`run.collect` resolved, `dreamer.config.Settings`): inline on the
    learner's device, or workers (processes or Ray actors) with the server on the inference device."""
    if collect in ("workers", "ray"):
        return WorkerSource(cfg, policy, layout, size, topology.inference, cudagraph, replay, ray=collect == "ray")
    return InlineSource(cfg, policy, layout, size, topology.learner, cudagraph, replay)


class Updates:
    """The updates the ratio owes for the env steps collected: sample, update, write-back, weight sync.

    `counters` (the run's, saved in checkpoints): train_steps counts env steps collected while replay is
    ready, so refilling replay after a resume does not pile up a burst of owed updates; owed_updates are
    those not run yet (a stop keeps them owed). `seconds` sums the calling thread's time by part.
    """

    def __init__(self, learner, replay, ratio, source: Source, counters: dict, train_start: int,
                 write_back: bool = True):
        self.learner, self.replay, self.ratio, self.source = learner, replay, ratio, source
        self.counters, self.train_start, self.write_back = counters, train_start, write_back
        self.seconds = {"sample": 0.0, "update": 0.0, "write_back": 0.0, "sync": 0.0}

    def owe(self, steps: int) -> None:
        """Counts `steps` env steps just added (already in counters["env_steps"])."""
        if self.replay.ready() and self.counters["env_steps"] >= self.train_start:
            self.counters["train_steps"] += steps
            self.counters["owed_updates"] += self.ratio(self.counters["train_steps"])

    def run(self, stop: Callable[[], bool] = lambda: False) -> int:
        """Runs the owed updates (until `stop()`); returns how many ran."""
        ran = 0
        while self.counters["owed_updates"] and not stop():
            self.counters["owed_updates"] -= 1
            self.one()
            ran += 1
        return ran

    def one(self) -> None:
        clock = time.perf_counter()
        batch, handles = self.replay.sample()
        sampled = time.perf_counter()
        state, belief = self.learner.update(batch[:, :-1])
        updated = time.perf_counter()
        if self.write_back:
            self.replay.write_back(handles, state, belief)
        written = time.perf_counter()
        self.source.synced(self.learner.updates)
        now = time.perf_counter()
        for part, seconds in (("sample", sampled - clock), ("update", updated - sampled),
                              ("write_back", written - updated), ("sync", now - written)):
            self.seconds[part] += seconds
