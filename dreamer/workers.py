"""Env worker processes: each runs `dreamer.collect.Collector` on one env, acting through the inference server.

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
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch
from tensordict import TensorDictBase

from dreamer import reaper
from dreamer.agent import EnvLayout, ModelSize
from dreamer.collect import CollectionError, Collector, Episode

TIMES = 6  # timing slots per worker in WorkerPool.times: policy, env, step, loop, served, wake (WorkerPool.timing)


class _RemotePolicy:
    """The acting policy of a worker process: one request to the inference server per step."""

    # The server explores or not as it was built to (`Inference(explore=...)`); this process's exploration
    # setting has no effect on it, so the collector leaves it alone.
    sets_exploration = True

    def __init__(self, client):
        self.client = client

    def __call__(self, record: TensorDictBase) -> TensorDictBase:
        return self.client.act(record)


@dataclass
class Chunk:
    """Consecutive records [k] of one env stream, and the episodes that ended in them."""

    stream: int
    records: TensorDictBase
    episodes: list[Episode]
    env_restarts: int  # env rebuilds inside the worker (the env raised), since its last chunk


def first_env(cfg, seed: int, index: int, suite: str, max_restarts: int):
    """A worker's env `index`, built up to `max_restarts` times in a row (starting an env can fail now and
    then: MineRL does); CollectionError, one line, when every try failed."""
    from dreamer.envs import make_env

    for attempt in range(1, max_restarts + 1):
        try:
            return make_env(cfg, seed, index)
        except Exception as error:
            if attempt == max_restarts:
                reason = str(error).splitlines()[0] if str(error) else ""
                raise CollectionError(f"{suite} env {index} could not be created {attempt} times in a row, "
                                      f"last with {type(error).__name__}: {reason}; stopping") from None


def _worker_main(index: int, env_cfg: dict, seed: int, layout: EnvLayout, size: ModelSize, client,
                 writer: Connection, stop, chunk: int, suite: str, max_restarts: int, stepped, timing,
                 trainer: int) -> None:
    """One env worker: steps its env with the server's actions and sends chunks until `stop` is set."""
    reaper.bind(trainer)  # first: it dies with the trainer, however that dies
    from omegaconf import OmegaConf

    from dreamer.envs import make_env

    # Stopping is the trainer's call (it saves first, then closes the pool): Ctrl-C or a SIGTERM sent to
    # the whole process group must not kill the workers under it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # blocked in the fork server (worker_context)
    torch.set_num_threads(1)
    cfg = OmegaConf.create(env_cfg)
    collector = None
    try:
        env = first_env(cfg, seed, index, suite, max_restarts)
        collector = Collector([env], lambda _: make_env(cfg, seed, index), _RemotePolicy(client), layout, size,
                              torch.device("cpu"), suite=suite, max_restarts=max_restarts)
        records, episodes, restarts = [], [], 0
        slot = TIMES * index  # this worker's timing slots (see WorkerPool.timing)
        seconds, last = dict(collector.seconds), time.perf_counter()
        served, woken = client.served_seconds, client.wake_seconds
        while not stop.is_set():
            record, ended = collector.step()
            records.append(record)
            episodes += [Episode(index, e.score, e.length, e.truncated_by_fault, e.stats) for e in ended]
            if len(records) >= chunk:
                writer.send(Chunk(index, torch.cat(records), episodes, collector.restarts - restarts))
                restarts = collector.restarts
                records, episodes = [], []
            now = time.perf_counter()
            for offset, key in enumerate(("policy", "env", "step")):  # this worker's slots only: no lock
                timing[slot + offset] += collector.seconds[key] - seconds[key]
            timing[slot + 3] += now - last
            timing[slot + 4] += client.served_seconds - served
            timing[slot + 5] += client.wake_seconds - woken
            seconds, last = dict(collector.seconds), now
            served, woken = client.served_seconds, client.wake_seconds
            stepped[index] += 1
    except CollectionError as error:
        writer.send(str(error).replace(f"{suite} env 0 ", f"{suite} env {index} "))
    except (BrokenPipeError, EOFError):  # the trainer is gone
        pass
    finally:
        if collector is not None:
            collector.close()


def worker_context(suite: str, method: str = "forkserver"):
    """The multiprocessing context of the env workers (`run.worker_start`). forkserver: workers fork from
    a server process that imported their modules once (multiprocessing's forkserver, started at the first
    call), where spawned ones import torch, tensordict, torchrl and their suite afresh (about 4 s of CPU
    apiece, 16 per run, 64 for Minecraft) and hold their own copies of them; spawn where the platform has
    no fork server. The fork server is the trainer's child and exits when the trainer
    has died; workers die with it (`dreamer.reaper`). Call it early (the learner's warm-up) to have the
    server's imports done by the time the workers start."""
    if method == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    from dreamer.envs import SUITES

    context = multiprocessing.get_context("forkserver")
    # A worker still runs the trainer's main module (`python -m dreamer.train`: its imports are these, and
    # about 0.2 s more); naming that module here would import it twice in the worker.
    context.set_forkserver_preload(["__main__", __name__, f"dreamer.envs.{SUITES.get(suite, 'gym')}"])
    from multiprocessing import forkserver

    # The server starts with SIGTERM blocked (the calling thread's mask passes through its exec; it ignores
    # SIGINT itself): a signal to the trainer's process group must leave the workers to the trainer, which
    # saves first (see _worker_main). Blocked, not ignored: one arriving meanwhile still reaches the trainer.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return context


class WorkerPool:
    """`len(clients)` env worker processes (started as `worker_context` says), their chunk pipes, and
    their restarts.

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
                 on_restart: Callable[[int], None] | None = None, stall_seconds: float = 600.0,
                 start_method: str = "forkserver"):
        reaper.guard()  # before the pool makes its first semaphores
        self.args = (env_cfg, seed, layout, size)
        self.clients, self.chunk, self.suite, self.max_restarts = clients, chunk, suite, max_restarts
        self.on_restart = on_restart
        self.stall_seconds = stall_seconds
        self.stalls = 0  # workers killed for taking no step in stall_seconds
        self.context = worker_context(suite, start_method)
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
        # Seconds each worker spent so far in its steps (shared memory, one writer per slot), TIMES per
        # worker: the policy's round trip through the server, the env's own calls, the whole collector
        # step, and the whole loop (the chunk's sending included). See `timing`.
        self.times = self.context.RawArray("d", TIMES * n)
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
                  self.suite, self.max_restarts, self.stepped, self.times, os.getpid()))
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

    def timing(self) -> tuple[int, list[float]]:
        """(env steps taken by all workers, [policy, env, step, loop, served, wake] seconds summed over all
        workers) so far; the difference of two calls, divided by the steps, is where a worker's step time
        went. served and wake split the policy's round trip: from the request's submission to the server's
        ring, and from the ring to the worker running again (`RowClient`)."""
        times = list(self.times)
        return sum(self.stepped), [sum(times[k::TIMES]) for k in range(TIMES)]

    def blocked(self, seconds: float) -> bool:
        """Whether `receive` has been reading one worker's pipe for more than `seconds` s."""
        return self._reading is not None and time.monotonic() - self.reading_since > seconds

    def stats(self) -> dict[str, float]:
        """Figures of the pool itself for a metrics record (the Ray pool has some: `RayPool.stats`)."""
        return {}

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
