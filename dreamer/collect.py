"""Synchronous collection: step every env once per call and return one replay record per env.

Record t of an env holds the carry that the policy had before seeing o[t] (state z[t-1], belief h[t-1],
action a[t-1], is_init) and, under `next`, o[t] with the reward and done flags that arrived with it.
The policy turns it into z[t], h[t], a[t]; a[t] goes to the env, or the env is reset when o[t] ended
the episode. The layout is the one `dreamer.agent` documents.

Faults: an env that raises in `step` or `reset` is closed and rebuilt; its episode ends as truncated at
the last good observation (repeated once with done set, reward 0), so replay never joins two episodes.
`max_restarts` failures in a row of the same env stop collection with a CollectionError. Non-finite
observations or rewards stop it at once: they mean the env is broken, not unlucky.

`WorkerPool` runs the same collector in `run.envs` worker processes, one env each, acting through the
batched inference server (`dreamer.inference`): each worker sends its records to the trainer in chunks of
`run.chunk` consecutive records over its own pipe; `Ingest`, a thread of the trainer, adds them to
replay beside the training loop's updates. A worker that dies (killed, crashed) is restarted in
place; the records it had not sent yet are lost, its replay stream is ended as truncated at the last
record the trainer received, and the new worker starts a fresh episode. A worker that stops stepping
(a hung simulator, a stopped process) is killed by the pool's own thread, never by the reader of the
pipes, which a stopped worker can block: a chunk's tensors are fetched from the process that sent them
(torch's file-descriptor sharing), and a message can stop halfway. Its death ends that read, and it is
restarted like any dead worker. Workers die with the trainer (`dreamer.reaper`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.envs import EnvBase, ExplorationType, set_exploration_type

from dreamer import reaper
from dreamer.agent import IMAGE_KEY, ActingPolicy, EnvLayout, ModelSize

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
        self.env_steps = [0] * n  # steps of each env since the collector started, for error messages
        self.failures = [0] * n  # failures in a row, per env
        self.faulted = [False] * n
        self.restarts = 0

    def _observe(self, td: TensorDictBase, first: bool, index: int) -> TensorDictBase:
        out = td.select(*self.keys).clone()
        if first:
            out.set("reward", torch.zeros(1))
            for flag in FLAGS:
                out.set(flag, torch.zeros(1, dtype=torch.bool))
        else:
            out.set("reward", td.get("reward").float().reshape(1))
            for flag in FLAGS:
                out.set(flag, td.get(flag).reshape(1))
        for key in [*self.keys, "reward"]:
            value = out.get(key)
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise CollectionError(
                    f"{self.suite} env {index} returned a non-finite {key} (nan or inf) at its step "
                    f"{self.env_steps[index]}; the environment is broken: fix it or its settings"
                )
        return out

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
        spec = env.action_spec
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
        episode = Episode(index, self.scores[index], self.lengths[index], self.faulted[index], stats)
        self.scores[index], self.lengths[index], self.faulted[index] = 0.0, 0, False
        return episode

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
            self.env_steps[i] += 1
            ended = bool(self.observed[i].get("done"))
            if ended:
                episodes.append(self._end_episode(i))
            try:
                if ended:
                    self._reset_or_rebuild(i)
                else:
                    self.states[i].set("action", self._env_action(env, action[i]))
                    self.states[i] = env.step(self.states[i]).get("next")
                    self.observed[i] = self._observe(self.states[i], first=False, index=i)
                    self.is_init[i] = False
                    self.failures[i] = 0
            except CollectionError:
                raise
            except Exception as error:  # the env broke: rebuild it, truncate its episode
                self._fail(i, error)
                self.is_init[i] = False
        self.carry = TensorDict(
            state=acted.get("state"), belief=acted.get("belief"), action=action, batch_size=[len(self.envs)]
        )
        return record, episodes

    def run_episodes(self, count: int, stop: Callable[[], bool] | None = None) -> list[Episode]:
        """Steps until `count` episodes have ended (evaluation), or until `stop()`; starts from fresh resets."""
        self.reset()
        finished: list[Episode] = []
        while len(finished) < count and not (stop and stop()):
            _, episodes = self.step()
            finished.extend(episodes)
        return finished[:count]

    def close(self) -> None:
        for env in self.envs:
            env.close()


class _RemotePolicy:
    """The acting policy of a worker process: one request to the inference server per step."""

    def __init__(self, client):
        self.client = client

    def __call__(self, record: TensorDictBase) -> TensorDictBase:
        answer = self.client(record[0])
        record.set("policy", answer.get("policy").unsqueeze(0))
        return record


@dataclass
class Chunk:
    """Consecutive records [k] of one env stream, and the episodes that ended in them."""

    stream: int
    records: TensorDictBase
    episodes: list[Episode]
    env_restarts: int  # env rebuilds inside the worker (the env raised), since its last chunk


def _worker_main(index: int, env_cfg: dict, seed: int, layout: EnvLayout, size: ModelSize, client,
                 writer: Connection, stop, chunk: int, suite: str, max_restarts: int, stepped,
                 trainer: int) -> None:
    """One env worker: steps its env with the server's actions and sends chunks until `stop` is set."""
    reaper.bind(trainer)  # first: it dies with the trainer, however that dies
    from omegaconf import OmegaConf

    from dreamer.envs import make_env

    # Stopping is the trainer's call (it saves first, then closes the pool): Ctrl-C or a SIGTERM sent to
    # the whole process group must not kill the workers under it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(1)
    cfg = OmegaConf.create(env_cfg)
    collector = None
    try:
        for attempt in range(1, max_restarts + 1):  # starting an env can fail now and then (MineRL does)
            try:
                env = make_env(cfg, seed, index)
                break
            except Exception as error:
                if attempt == max_restarts:
                    reason = str(error).splitlines()[0] if str(error) else ""
                    raise CollectionError(f"{suite} env {index} could not be created {attempt} times in a row, "
                                          f"last with {type(error).__name__}: {reason}; stopping") from None
        collector = Collector([env], lambda _: make_env(cfg, seed, index), _RemotePolicy(client), layout, size,
                              torch.device("cpu"), suite=suite, max_restarts=max_restarts)
        records, episodes, restarts = [], [], 0
        while not stop.is_set():
            record, ended = collector.step()
            records.append(record)
            stepped[index] += 1  # this worker's slot only: no lock
            episodes += [Episode(index, e.score, e.length, e.truncated_by_fault, e.stats) for e in ended]
            if len(records) >= chunk:
                writer.send(Chunk(index, torch.cat(records), episodes, collector.restarts - restarts))
                restarts = collector.restarts
                records, episodes = [], []
    except CollectionError as error:
        writer.send(str(error).replace(f"{suite} env 0 ", f"{suite} env {index} "))
    except (BrokenPipeError, EOFError):  # the trainer is gone
        pass
    finally:
        if collector is not None:
            collector.close()


class WorkerPool:
    """`len(clients)` env worker processes (spawned), their chunk pipes, and their restarts.

    `on_restart(stream)` runs in the caller of `receive` before a dead worker's replacement starts (the
    replay stream is ended there, and the inference slot cleared). A worker that takes no step for
    `stall_seconds` (a hung simulator, a stopped process) while no chunk of it waits unread is killed
    by the pool's thread and restarted the same way. A worker that dies `max_restarts` times without
    delivering a chunk in between stops collection with a CollectionError.

    The pool's thread (the watchdog) also starts the replacements: a worker dies with the thread that
    started it (`dreamer.reaper`), and this thread lives as long as the pool, unlike a reader's.
    """

    def __init__(self, env_cfg: dict, seed: int, layout: EnvLayout, size: ModelSize, clients: list,
                 chunk: int = 64, suite: str = "env", max_restarts: int = 10,
                 on_restart: Callable[[int], None] | None = None, stall_seconds: float = 600.0):
        reaper.guard()  # before the pool makes its first semaphores
        self.args = (env_cfg, seed, layout, size)
        self.clients, self.chunk, self.suite, self.max_restarts = clients, chunk, suite, max_restarts
        self.on_restart = on_restart
        self.stall_seconds = stall_seconds
        self.stalls = 0  # workers killed for taking no step in stall_seconds
        self.context = multiprocessing.get_context("spawn")
        self.stop = self.context.Event()
        n = len(clients)
        self.processes: list = [None] * n
        self.pipes: list[Connection | None] = [None] * n  # None: dead, its replacement not started yet
        self.progress = [0.0] * n  # when each worker was started, last stepped, or had a chunk waiting
        self.deaths = [0] * n  # deaths in a row, per worker
        self.restarts = 0  # worker restarts plus env rebuilds inside workers
        self.read_seconds = 0.0  # time spent reading and unpickling chunks (not waiting for them)
        # Env steps taken by each worker so far, chunks not yet sent included (shared memory, one writer
        # per slot): a rate over a short window is exact to the step, not to the chunk; the watchdog's
        # sign of life.
        self.stepped = self.context.RawArray("q", n)
        # Guards processes and pipes: the watchdog starts and kills workers, a reader drops dead ones.
        self._lock = threading.Lock()
        self._reading: int | None = None  # the worker whose pipe `receive` is reading from
        self.reading_since = 0.0  # since when
        self._replace: queue.SimpleQueue = queue.SimpleQueue()  # dead workers for the watchdog to start
        self._closing = False
        self._failure: BaseException | None = None  # what ended the watchdog, raised by `receive`
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name="dreamer-worker-watchdog")

    def start(self) -> WorkerPool:
        with self._lock:
            for index in range(len(self.clients)):
                self._spawn(index)
        self._watchdog.start()
        return self

    def _spawn(self, index: int) -> None:
        reader, writer = self.context.Pipe(duplex=False)
        env_cfg, seed, layout, size = self.args
        process = self.context.Process(
            target=_worker_main, name=f"dreamer-env-{index}", daemon=True,
            args=(index, env_cfg, seed, layout, size, self.clients[index], writer, self.stop, self.chunk,
                  self.suite, self.max_restarts, self.stepped, os.getpid()))
        process.start()
        reaper.register(process.pid)
        writer.close()  # the worker holds the only writer: its death closes the pipe
        self.processes[index], self.pipes[index] = process, reader
        self.progress[index] = time.monotonic()

    def _watch(self) -> None:
        try:
            self._watch_loop()
        except BaseException as error:  # e.g. no replacement could start: collection stops with it
            self._failure = error

    def _watch_loop(self) -> None:
        """The watchdog: starts replacements and kills workers that stopped stepping (class docstring)."""
        seen = list(self.stepped)
        while True:
            try:
                replace = self._replace.get(timeout=min(0.5, self.stall_seconds / 4))
            except queue.Empty:
                replace = None
            with self._lock:
                if self._closing:
                    return
                if replace is not None:
                    self._spawn(replace)
                now = time.monotonic()
                for index, (process, pipe) in enumerate(zip(self.processes, self.pipes)):
                    if self.stepped[index] != seen[index]:
                        seen[index] = self.stepped[index]
                        self.progress[index] = now
                    elif pipe is None or not process.is_alive():
                        continue
                    elif self._reading != index and pipe.poll():
                        # A chunk waiting unread is not a stall: the trainer did not read (an evaluation,
                        # or the reader holding back while the learner catches up).
                        self.progress[index] = now
                    elif now - self.progress[index] > self.stall_seconds:
                        process.kill()  # also a stopped one; its pipe reports the death to the reader
                        self.stalls += 1
                        self.progress[index] = now

    def _dead(self, index: int) -> None:
        """A worker's pipe closed: it is gone. Its replacement is started by the watchdog."""
        with self._lock:
            self._reading = None
            process, pipe = self.processes[index], self.pipes[index]
            if pipe is None:  # closed meanwhile by `close`
                return
            self.pipes[index] = None
            pipe.close()
            process.join(timeout=5)  # its pipe closed when it exited: at most the time to end a process
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
            if self._closing:
                return
            self.deaths[index] += 1
            self.restarts += 1
        if self.deaths[index] >= self.max_restarts:
            raise CollectionError(
                f"{self.suite} env worker {index} died {self.deaths[index]} times in a row "
                f"(last exit code {process.exitcode}); stopping"
            )
        if self.on_restart is not None:
            self.on_restart(index)
        self._replace.put(index)

    def receive(self, timeout: float) -> list[Chunk]:
        """The chunks that arrive within `timeout` s (all that are ready, at least one if any comes)."""
        if self._failure is not None:
            raise CollectionError(f"the env workers' watchdog failed with {type(self._failure).__name__}: "
                                  f"{str(self._failure).splitlines()[0] if str(self._failure) else ''}")
        with self._lock:
            pipes = [pipe for pipe in self.pipes if pipe is not None]
        if not pipes:  # every worker is dead and waits for its replacement
            time.sleep(timeout)
            return []
        chunks = []
        for pipe in wait(pipes, timeout):
            with self._lock:
                if pipe not in self.pipes:  # closed meanwhile by `close`
                    continue
                index = self.pipes.index(pipe)
                self._reading, self.reading_since = index, time.monotonic()
            start = time.perf_counter()
            try:
                message = pipe.recv()
            except (EOFError, OSError, pickle.UnpicklingError):  # the worker died, maybe mid-message
                message = None
            except BaseException:
                self._reading = None
                raise
            self.read_seconds += time.perf_counter() - start
            if message is None:
                self._dead(index)
                continue
            self._reading = None
            if isinstance(message, str):
                raise CollectionError(message)
            self.deaths[index] = 0
            self.restarts += message.env_restarts
            chunks.append(message)
        return chunks

    def blocked(self, seconds: float) -> bool:
        """Whether `receive` has been reading one worker's pipe for more than `seconds` s."""
        return self._reading is not None and time.monotonic() - self.reading_since > seconds

    def close(self, timeout: float = 5.0) -> None:
        """Stops every worker within about `timeout` s: those that do not end in time are killed (also a
        stopped one), and none is restarted from here on."""
        with self._lock:
            self._closing = True
        self.stop.set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p is not None and p.is_alive() for p in self.processes):
            for index, pipe in enumerate(self.pipes):
                # A worker blocked on a full pipe finishes its send, then sees stop. The bytes are read and
                # dropped, not unpickled: a stopped worker cannot block that (module docstring).
                if pipe is not None and index != self._reading and pipe.poll():
                    try:
                        os.read(pipe.fileno(), 1 << 16)
                    except OSError:
                        pass
            time.sleep(0.05)
        for process in self.processes:
            if process is not None and process.is_alive():  # blocked on the server, in its env, or stopped
                process.kill()
        for process in self.processes:
            if process is not None:
                process.join(timeout=5)
        # A reader blocked in a recv got its end of file with the kill above; it drops that pipe itself.
        wait_until = time.monotonic() + 2.0
        while self._reading is not None and time.monotonic() < wait_until:
            time.sleep(0.01)
        with self._lock:
            for index, pipe in enumerate(self.pipes):
                if pipe is not None and index != self._reading:
                    pipe.close()
                    self.pipes[index] = None
        if self._watchdog.is_alive():
            self._watchdog.join(timeout=5)


class Ingest:
    """Moves the workers' chunks into replay from a thread of its own.

    The training loop's thread then only samples, updates and writes back: reading a chunk (unpickling,
    a shared-memory handle per tensor) and adding it to replay (a copy into its stream's storage) run
    here, beside the loop's updates instead of between them. `take` hands the loop what was added since
    its last call. A collection failure in the thread (a worker that keeps dying, a broken env, the
    inference server gone) is raised by the next `take`, after the steps added before it.

    Backpressure: with `max_pending` steps added and not yet taken, the thread stops reading until the
    loop takes them; the workers' pipes then fill and the workers wait. A learner slower than
    collection thus slows collection down to the train ratio, instead of owing updates for every step
    collected meanwhile.
    """

    def __init__(self, pool: WorkerPool, replay, alive: Callable[[], bool] | None = None,
                 max_pending: int | None = None, poll: float = 0.2):
        self.pool, self.replay, self.alive, self.poll = pool, replay, alive, poll
        self.max_pending = max_pending
        self._taken = threading.Event()
        self.add_seconds = 0.0  # this thread's time adding chunks to replay (reading: pool.read_seconds)
        self.error: BaseException | None = None
        self._steps, self._episodes = 0, []
        self._lock = threading.Lock()
        self._arrived = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="dreamer-ingest")

    def start(self) -> Ingest:
        self.thread.start()
        return self

    def _loop(self) -> None:
        # A CUDA stream of this thread's own, with no work on it: a library's wait for "the current
        # stream" here then never waits for the learner's updates queued on the trainer's stream.
        own = torch.cuda.stream(torch.cuda.Stream()) if torch.cuda.is_initialized() else contextlib.nullcontext()
        with own:
            self._receive_loop()

    def _receive_loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self.alive is not None and not self.alive():
                    raise CollectionError("the inference server stopped")
                if self.max_pending is not None and self._steps >= self.max_pending:
                    self._taken.wait(self.poll)  # the loop has not taken the last ones yet
                    self._taken.clear()
                    continue
                for chunk in self.pool.receive(timeout=self.poll):
                    start = time.perf_counter()
                    self.replay.add_chunk(chunk.stream, chunk.records)
                    self.add_seconds += time.perf_counter() - start
                    with self._lock:
                        self._steps += chunk.records.shape[0]
                        self._episodes += chunk.episodes
                    self._arrived.set()
        except BaseException as error:  # handed to the training loop by take()
            self.error = error
            self._arrived.set()

    def take(self, timeout: float) -> tuple[int, list[Episode]]:
        """(env steps added, episodes ended) since the last call; waits up to `timeout` s when there are none."""
        if not self._steps and self.error is None:
            self._arrived.wait(timeout)
        with self._lock:
            self._arrived.clear()
            steps, episodes = self._steps, self._episodes
            self._steps, self._episodes = 0, []
        self._taken.set()
        if not steps and self.error is not None:
            raise self.error
        return steps, episodes

    def close(self, timeout: float = 5.0) -> None:
        """Stops the thread (after the chunk in hand); the pool is closed by its owner afterwards.

        A thread that has been reading one worker's pipe for a second is blocked by a worker stopped
        halfway through a message: it is not waited for, the pool's close kills that worker, which
        ends the read.
        """
        self._stop.set()
        deadline = time.monotonic() + timeout
        while self.thread.is_alive() and time.monotonic() < deadline:
            if self.pool.blocked(1.0):
                return
            self.thread.join(0.05)


def start_workers(cfg, policy: ActingPolicy, layout: EnvLayout, size: ModelSize, device: torch.device,
                  cudagraph: bool, replay) -> tuple:
    """`run.collect=workers`: the inference server on `device` (started), then `run.envs` workers feeding
    `replay`; returns (inference, pool). Raises CollectionError, one line, when the server cannot start.

    `run.inference=auto` puts a GPU server in a process of its own, also when it shares the learner's GPU:
    measured on one H200 (BENCHMARKS.md), the learner is busier and collection faster that way than with
    the server as a thread, whose Python competes with the trainer's for one interpreter lock. A CPU
    server runs as a thread of the trainer.
    """
    from omegaconf import OmegaConf

    from dreamer.inference import Inference

    own_process = cfg.run.inference == "process" or (cfg.run.inference == "auto" and device.type == "cuda")
    inference = Inference(policy, layout, size, cfg.run.envs, device, cudagraph,
                          batch_wait=cfg.run.inference_wait_ms / 1000, process=own_process)
    try:
        inference.start()
    except RuntimeError as error:
        inference.close()
        raise CollectionError(f"the inference server did not start: {str(error).splitlines()[0]}") from None

    def restarted(stream: int) -> None:  # a dead worker's stream ends where replay's data ends
        inference.forget_slot(stream)
        replay.end_stream(stream)

    pool = WorkerPool(OmegaConf.to_container(cfg.env, resolve=True), cfg.seed, layout, size, inference.clients,
                      cfg.run.chunk, cfg.env.suite, on_restart=restarted, stall_seconds=cfg.run.worker_stall_s)
    pool.start()
    print(f"dreamer: {cfg.run.envs} env worker processes, inference server on {device} "
          f"({'its own process' if own_process else 'a thread'})", flush=True)
    return inference, pool
