"""Env workers as Ray actors (`run.collect=ray`): envs on any node of a Ray cluster, acting through the
batched inference server on the learner's node.

Three parts:

- `EnvWorker`, the actor (one env, on whichever node Ray places it): `dreamer.collect.Collector` steps the
  env in a thread of the actor, exactly as a worker process does. Its policy is a mailbox: each step's
  request (the record's leaves packed in one row of bytes, `dreamer.inference.Rows`) leaves as the
  reply of a call of `exchange`, and the next call brings its answer. Every `run.chunk` records the
  finished chunk rides on a reply. Rows travel as bytes and chunks as numpy arrays (`Packed`), which Ray
  moves as they are; tensors would go through torch's pickling.
- The pump (`_pump_main`), a process of the trainer's node that is the run's Ray driver: it keeps one
  `exchange` call in flight per actor; each reply's request goes into that env stream's slot of the
  inference server (the slot a worker process would own: `RowClient.post`), the server is woken once for
  the sweep and answers it in one pass, and each answer leaves with the stream's next call. A step
  therefore costs one Ray call, whose reply carries the observation and whose argument carries the
  action. Chunks go on to the trainer over a pipe, as their bytes (a worker process's go through shared
  memory). The pump owns the actors: when it ends, Ray ends them.
  torchrl's Ray transport for its inference server was not used: a step through it takes about four Ray
  calls (requests and answers pass through queue actors) and its own server beside the run's.
- `RayPool`, in the trainer: the worker pool's interface (`dreamer.workers.WorkerPool`) for `Ingest` and
  `dreamer.pipeline.WorkerSource`.

Faults, as for worker processes: an actor that dies (its process or its node lost: Ray raises on its
call) or that takes no step for `run.worker_stall_s` (killed by the pump) is replaced by a new actor,
which Ray places on any node with room; its records not yet sent are lost, its replay stream is ended
at the last record the trainer received, and the new actor starts a fresh episode. An actor that dies
`max_restarts` times without delivering a chunk in between stops collection with a CollectionError, as
does a pump that does. An env that raises inside the actor is rebuilt there by the collector. The pump
dies with the trainer (`dreamer.reaper`).

Timing (`WorkerPool.timing`'s six parts per env): policy, env, step and loop are the actor's collector's
own; served is the server's part of the policy's round trip (from the pump's post to the answer) and wake
the rest of it: the Ray call, both ways.
"""

from __future__ import annotations

import math
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from dreamer import reaper
from dreamer.agent import EnvLayout, ModelSize
from dreamer.collect import CollectionError, Collector, Episode
from dreamer.inference import RowClient, Rows, request_spec, response_spec
from dreamer.workers import TIMES, Chunk, first_env, worker_context

# Bytes of Ray's object store on a local cluster, where the actors' chunks wait for the pump: room for a
# few chunks per env, at least 512 MB.
LOCAL_STORE_PER_ENV, LOCAL_STORE_MIN = 8 * 2**20, 512 * 2**20


@dataclass
class Reply:
    """What one `exchange` call returns: the next request, or the error that ended the actor's collection."""

    request: bytes | None = None  # the request's row (`Rows` of the request spec)
    chunk: Chunk | None = None  # the chunk finished since the last reply
    steps: int = 0  # collector steps finished since the last reply
    seconds: list[float] = field(default_factory=list)  # policy, env, step, loop since the last reply
    error: str | None = None


@dataclass
class Packed:
    """A chunk's records as numpy arrays (tensordict's own `numpy()`), from the actor through the pump to the
    trainer: Ray and a pipe move an array as its bytes, where a tensor goes through torch's pickling (Ray)
    or into a shared memory file of its own (a pipe: one per leaf and chunk, with a descriptor to hand over)."""

    batch_size: tuple
    arrays: dict  # the records' leaves as numpy arrays, nested as the records' keys

    @classmethod
    def of(cls, records: TensorDictBase) -> Packed:
        return cls(tuple(records.batch_size), records.numpy())

    def tensordict(self) -> TensorDict:
        return TensorDict(self.arrays, batch_size=self.batch_size)


class _Closed(Exception):
    """The actor was asked to close while its collector waited for an answer."""


class _Mailbox:
    """The collector's policy inside an `EnvWorker`: each request goes out through `exchange`."""

    sets_exploration = True  # the server explores as it was built to; this process's setting has no effect

    def __init__(self, worker: EnvWorker):
        self.worker = worker

    def __call__(self, record: TensorDictBase) -> TensorDictBase:
        return self.worker._ask(record)


class EnvWorker:
    """One env stepped by a collector in a thread of this Ray actor (module docstring)."""

    def __init__(self, index: int, env_cfg: dict, seed: int, layout: EnvLayout, size: ModelSize, chunk: int,
                 suite: str, max_restarts: int):
        torch.set_num_threads(1)
        self.index, self.chunk, self.suite = index, chunk, suite
        self.request_rows, self.response_rows = Rows(request_spec(layout, size)), Rows(response_spec(layout, size))
        self._row = self.request_rows.allocate(1)
        self._in = self.request_rows.views(self._row)
        self._answer = self.response_rows.allocate(1)  # the last answer, and its leaves' views
        self._out = [(key[1], view) for key, view in self.response_rows.views(self._answer) if key[0] == "policy"]
        self._answers: queue.SimpleQueue = queue.SimpleQueue()  # exchange -> the collector's thread
        self._replies: queue.SimpleQueue = queue.SimpleQueue()  # the collector's thread -> exchange
        self._closed = threading.Event()
        self._collector: Collector | None = None
        self._finished: Chunk | None = None  # the chunk the next reply carries
        # Collector steps since the last reply, and the collector's policy, env and step seconds and the
        # clock at the last reply (a reply carries their differences: `Reply`).
        self._steps, self._seconds = 0, [0.0, 0.0, 0.0, time.perf_counter()]
        self._thread = threading.Thread(target=self._run, args=(env_cfg, seed, layout, size, max_restarts),
                                        daemon=True, name="dreamer-env-worker")
        self._thread.start()

    def where(self) -> tuple[str, str]:
        """(Ray's node id, the host's name) of this actor."""
        import ray

        return ray.get_runtime_context().get_node_id(), socket.gethostname()

    def exchange(self, answer: bytes | None) -> Reply:
        """Hands the collector the answer to its last request (None before the first) and returns its next
        request, after the env's step."""
        if answer is not None:
            self._answers.put(answer)
        return self._replies.get()

    def close(self) -> None:
        """Ends the collector's thread and closes the env (before the actor is killed)."""
        self._closed.set()
        self._answers.put(None)
        self._thread.join(timeout=30)

    def _run(self, env_cfg: dict, seed: int, layout: EnvLayout, size: ModelSize, max_restarts: int) -> None:
        from omegaconf import OmegaConf

        from dreamer.envs import make_env

        cfg, index = OmegaConf.create(env_cfg), self.index
        try:
            env = first_env(cfg, seed, index, self.suite, max_restarts)
            self._collector = collector = Collector(
                [env], lambda _: make_env(cfg, seed, index), _Mailbox(self), layout, size, torch.device("cpu"),
                suite=self.suite, max_restarts=max_restarts)
            records, episodes, restarts = [], [], 0
            while not self._closed.is_set():
                record, ended = collector.step()
                self._steps += 1
                records.append(record)
                episodes += [Episode(index, e.score, e.length, e.truncated_by_fault, e.stats) for e in ended]
                if len(records) >= self.chunk:
                    self._finished = Chunk(index, Packed.of(torch.cat(records)), episodes,
                                           collector.restarts - restarts)
                    restarts = collector.restarts
                    records, episodes = [], []
        except _Closed:
            pass
        except CollectionError as error:
            self._replies.put(Reply(error=str(error).replace(f"{self.suite} env 0 ", f"{self.suite} env {index} ")))
        except BaseException as error:  # a bug, not the env: stop the run with it
            reason = str(error).splitlines()[0] if str(error) else ""
            self._replies.put(Reply(error=f"{self.suite} env {index}'s Ray worker failed with "
                                          f"{type(error).__name__}: {reason}"))
        finally:
            if self._collector is not None:
                self._collector.close()

    def _ask(self, record: TensorDictBase) -> TensorDictBase:
        """The mailbox's call, in the collector's thread: the request out, then its answer's policy keys
        set in `record` [1]."""
        for key, view in self._in:
            view.copy_(record.get(key))
        seconds = self._collector.seconds
        total = [seconds["policy"], seconds["env"], seconds["step"], time.perf_counter()]
        delta = [now - then for now, then in zip(total, self._seconds)]  # the last one: the loop's time
        self._seconds = total
        self._replies.put(Reply(self._row[0].numpy().tobytes(), self._finished, self._steps, delta))
        self._finished, self._steps = None, 0
        answer = self._answers.get()
        if answer is None:
            raise _Closed
        self._answer[0].numpy()[:] = np.frombuffer(answer, np.uint8)
        policy = {key: view.clone() for key, view in self._out}
        record.set("policy", TensorDict(policy, batch_size=record.batch_size))
        return record


@dataclass
class Restarted:
    """From the pump: the actor of `stream` was replaced (its stream ends at the records sent before this)."""

    stream: int
    reason: str


@dataclass
class Note:
    """From the pump: a line for the run's output."""

    text: str


@dataclass
class Cluster:
    """From the pump that started a local cluster: that cluster's processes ({pid: start time})."""

    processes: dict[int, str]


def _connect(address: str | None, envs: int, env_cpus: float):
    """Joins the cluster at `address`, or starts a local one (this process's children) where it is None.

    A local cluster counts max(cores, envs x env_cpus) CPUs, so that every env actor is placed on the one
    node as worker processes would be (their CPUs are mostly waiting on their envs)."""
    import logging

    import ray

    common = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True,
                  configure_logging=True)
    if address is not None:
        return ray.init(address=address, **common)
    cpus = max(os.cpu_count() or 1, math.ceil(envs * env_cpus))
    return ray.init(num_cpus=cpus, object_store_memory=max(LOCAL_STORE_MIN, envs * LOCAL_STORE_PER_ENV), **common)


class _Pump:
    """The pump's loop (module docstring): one `exchange` in flight per actor."""

    def __init__(self, actor_class, args: tuple, clients: list, writer: Connection, stop, max_restarts: int,
                 stall_seconds: float, stepped, times, taken, options: dict, suite: str, began: float | None = None):
        self.actor_class, self.args, self.clients, self.writer, self.stop = actor_class, args, clients, writer, stop
        # Backpressure, as a worker process's full pipe gives it: at most one chunk per env stream sent and
        # not yet taken by the trainer (`taken`, shared); beyond that the pump stops answering and the
        # actors wait.
        self.taken, self.sent, self.paused = taken, 0, None
        self.max_restarts, self.stall_seconds, self.options, self.suite = max_restarts, stall_seconds, options, suite
        self.stepped, self.times = stepped, times
        n = len(clients)
        self.actors: list = [None] * n
        self.calls: dict = {}  # the exchange call in flight -> its stream
        self.sent_at = [0.0] * n  # when each stream's call left
        self.served = [0.0] * n  # the server's part of each stream's last round trip
        self.deaths = [0] * n  # deaths in a row, per stream
        self.placing: dict = {}  # `where` calls not answered yet -> stream
        self.hosts: dict[int, str] = {}
        self.announced = False
        self.started = time.monotonic()
        self.began = began if began is not None else self.started  # the pump's start, before Ray's
        self.connected = self.started  # Ray's start done (the pump is made after it)

    def _start(self, stream: int) -> None:
        env_cfg, seed, layout, size, chunk, max_restarts = self.args
        actor = self.actor_class.options(**self.options).remote(stream, env_cfg, seed, layout, size, chunk,
                                                                 self.suite, max_restarts)
        self.actors[stream] = actor
        self.placing[actor.where.remote()] = stream
        self.calls[actor.exchange.remote(None)] = stream
        self.sent_at[stream], self.served[stream] = time.monotonic(), 0.0

    def _replace(self, stream: int, reason: str) -> None:
        import ray

        self.deaths[stream] += 1
        if self.deaths[stream] >= self.max_restarts:
            raise CollectionError(f"{self.suite} env worker {stream} (a Ray actor) died {self.deaths[stream]} times "
                                  f"in a row, last: {reason}; stopping")
        for call, owner in list(self.calls.items()) + list(self.placing.items()):
            if owner == stream:
                self.calls.pop(call, None)
                self.placing.pop(call, None)
        try:
            ray.kill(self.actors[stream], no_restart=True)
        except Exception:  # already gone with its node
            pass
        self.hosts.pop(stream, None)
        self.writer.send(Restarted(stream, reason))
        self._start(stream)

    def _placement(self) -> None:
        """Notes where the actors run, once all are placed; says so while some wait for room."""
        import ray

        if self.placing:
            ready, _ = ray.wait(list(self.placing), num_returns=len(self.placing), timeout=0)
            for call in ready:
                stream = self.placing.pop(call)
                try:
                    self.hosts[stream] = ray.get(call)[1]
                except Exception:  # it died: its exchange call says so
                    pass
        if not self.announced and not self.placing:
            counts: dict[str, int] = {}
            for host in self.hosts.values():
                counts[host] = counts.get(host, 0) + 1
            where = ", ".join(f"{host} ({count})" for host, count in sorted(counts.items()))
            now = time.monotonic()
            self.writer.send(Note(f"{len(self.actors)} Ray env workers on {len(counts)} node(s): {where}; all placed "
                                  f"{now - self.began:.1f} s after the pump's start (Ray's own start "
                                  f"{self.connected - self.began:.1f} s)"))
            self.announced = True
        elif not self.announced and time.monotonic() - self.started > 60:
            resources = ray.available_resources()
            self.writer.send(Note(f"{len(self.placing)} of {len(self.actors)} Ray env workers wait for a node with "
                                  f"room ({self.options.get('num_cpus')} CPUs each; the cluster has "
                                  f"{resources.get('CPU', 0):g} CPUs free)"))
            self.started = time.monotonic()

    def run(self) -> None:
        import ray
        from ray.exceptions import RayError

        for stream in range(len(self.actors)):
            self._start(stream)
        checked = time.monotonic()
        while not self.stop.is_set():
            if not self.announced or self.placing:
                self._placement()
            if self.sent - self.taken.value >= len(self.clients):
                self.paused = self.paused or time.monotonic()
                time.sleep(0.01)
                continue
            if self.paused is not None:  # the actors waited for the trainer, not for their envs: no stall
                held, self.paused = time.monotonic() - self.paused, None
                self.sent_at = [at + held for at in self.sent_at]
            ready, _ = ray.wait(list(self.calls), num_returns=1, timeout=0.1)
            if ready:  # and every other call answered by now: one server pass for all of them
                ready, _ = ray.wait(list(self.calls), num_returns=len(self.calls), timeout=0)
            posted = []
            try:  # one call of Ray's for the sweep; one per reply where some actor failed
                replies = ray.get(ready)
            except RayError:
                replies = None
            for index, call in enumerate(ready):
                stream = self.calls.pop(call)
                try:
                    reply: Reply = ray.get(call) if replies is None else replies[index]
                except RayError as error:  # the actor died, its node is gone, or its reply was lost with it
                    self._replace(stream, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
                    continue
                if reply.error is not None:
                    raise CollectionError(reply.error)
                if reply.chunk is not None:
                    self.writer.send(reply.chunk)
                    self.sent += 1
                    self.deaths[stream] = 0
                self._count(stream, reply)
                self.clients[stream].post(np.frombuffer(reply.request, np.uint8), ring=False)
                posted.append(stream)
            if posted:
                self.clients[posted[0]].ring()  # once for the sweep: the server's pass finds every request
            for stream in posted:
                client = self.clients[stream]
                before = client.served_seconds
                answer = client.answer().numpy().tobytes()  # Ray packs bytes as they are, a tensor through pickle
                self.served[stream] = client.served_seconds - before
                self.calls[self.actors[stream].exchange.remote(answer)] = stream
                self.sent_at[stream] = time.monotonic()
            now = time.monotonic()
            if now - checked > 1.0:
                checked = now
                for call, stream in list(self.calls.items()):
                    if now - self.sent_at[stream] > self.stall_seconds:
                        self._replace(stream, f"no env step in {self.stall_seconds:g} s")

    def _count(self, stream: int, reply: Reply) -> None:
        """The actor's step times into the shared timing slots (`WorkerPool.timing`)."""
        if not reply.steps:
            return
        slot = TIMES * stream
        policy, env, step, loop = reply.seconds
        for offset, value in enumerate((policy, env, step, loop, self.served[stream],
                                        max(policy - self.served[stream], 0.0))):
            self.times[slot + offset] += value
        self.stepped[stream] += reply.steps

    def close(self) -> None:
        import ray

        closing = [actor.close.remote() for actor in self.actors if actor is not None]
        ray.wait(closing, num_returns=len(closing), timeout=10)  # each closes its env
        for actor in self.actors:
            if actor is not None:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:
                    pass


def _pump_main(address: str | None, options: dict, args: tuple, clients: list, writer: Connection, stop,
               max_restarts: int, stall_seconds: float, stepped, times, taken, suite: str, trainer: int) -> None:
    """The pump process: joins (or starts) the cluster, runs the pump until `stop` is set, then ends the
    actors and leaves the cluster."""
    reaper.bind(trainer)  # first: it dies with the trainer, however that dies
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # stopping is the trainer's call (see dreamer.workers)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    torch.set_num_threads(1)
    pump = None
    began = time.monotonic()
    try:
        import ray

        _connect(address, len(clients), options["num_cpus"])
        if address is None:
            # Ray's own processes of a local cluster: most end with this process, not all of them (its
            # agents outlive a killed raylet). The trainer ends what is left (`RayPool`, `dreamer.reaper`).
            writer.send(Cluster({pid: reaper.started_at(pid) for pid in reaper.descendants(os.getpid())}))
        pump = _Pump(ray.remote(EnvWorker), args, clients, writer, stop, max_restarts, stall_seconds, stepped,
                     times, taken, options, suite, began)
        pump.run()
    except CollectionError as error:
        _send(writer, str(error))
    except (BrokenPipeError, EOFError):  # the trainer is gone
        pass
    except Exception as error:
        reason = str(error).splitlines()[0] if str(error) else ""
        _send(writer, f"the Ray env workers stopped: {type(error).__name__}: {reason}")
    finally:
        try:
            if pump is not None:
                pump.close()
        finally:
            ray = sys.modules.get("ray")
            if ray is not None and ray.is_initialized():
                ray.shutdown()


def _send(writer: Connection, message) -> None:
    try:
        writer.send(message)
    except (BrokenPipeError, EOFError, OSError):
        pass


class RayPool:
    """`WorkerPool`'s interface over env workers that are Ray actors, fed by one pump process.

    `on_restart(stream)` runs in the caller of `receive` when an actor was replaced, once the chunks it
    sent are in the caller's hands (a replacement read after one of them waits for the next `receive`);
    `forget_slot(stream)` (the inference server's) also runs when the pump itself died, whose
    requests may be left in the slots; a pump that dies `max_restarts` times without a chunk in between
    stops collection. `announce` prints the pump's notes (the actors' placement).
    """

    def __init__(self, env_cfg: dict, seed: int, layout: EnvLayout, size: ModelSize, clients: list,
                 chunk: int = 64, suite: str = "env", max_restarts: int = 10,
                 on_restart: Callable[[int], None] | None = None, stall_seconds: float = 600.0,
                 start_method: str = "forkserver", address: str | None = None, env_cpus: float = 1.0,
                 env_memory_gb: float = 0.0, forget_slot: Callable[[int], None] | None = None,
                 announce: Callable[[str], None] | None = print):
        reaper.guard()
        # Without their error queues: the pump's start passes every descriptor of its arguments at once.
        self.clients = [client.without_errors() if isinstance(client, RowClient) else client for client in clients]
        self.suite, self.max_restarts = suite, max_restarts
        self.on_restart, self.forget_slot, self.announce = on_restart, forget_slot, announce
        self.address, self.stall_seconds = address, stall_seconds
        self.args = (env_cfg, seed, layout, size, chunk, max_restarts)
        self.options = {"num_cpus": float(env_cpus), "max_concurrency": 2, "max_restarts": 0}
        if env_memory_gb:
            self.options["memory"] = int(env_memory_gb * 2**30)
        self.context = worker_context(suite, start_method)
        self.stop = self.context.Event()
        n = len(clients)
        self.stepped = self.context.RawArray("q", n)
        self.times = self.context.RawArray("d", TIMES * n)
        self.taken = None  # chunks this pool has read from the current pump (a shared counter, see _Pump)
        self.cluster: dict[int, str] = {}  # the processes of the pump's local Ray cluster
        self.process = None
        self.pipe: Connection | None = None
        self.restarts = 0  # actor replacements, pump restarts and env rebuilds inside actors
        self.stalls = 0  # actors replaced for taking no step in stall_seconds
        self.deaths = 0  # pump deaths in a row
        self.read_seconds = 0.0
        self._reading = False
        self.reading_since = 0.0
        self._closing = False
        self._pump_cpu: tuple | None = None  # (pid, clock, CPU seconds) of the pump at the last `stats`
        self.held: Restarted | None = None  # a replacement whose stream's chunks the caller stores first

    def start(self) -> RayPool:
        self._spawn()
        return self

    def _spawn(self) -> None:
        reader, writer = self.context.Pipe(duplex=False)
        self.taken = self.context.RawValue("q", 0)
        self.process = self.context.Process(
            target=_pump_main, name="dreamer-ray-pump", daemon=True,
            args=(self.address, self.options, self.args, self.clients, writer, self.stop, self.max_restarts,
                  self.stall_seconds, self.stepped, self.times, self.taken, self.suite, os.getpid()))
        self.process.start()
        reaper.register(self.process.pid)
        writer.close()
        self.pipe = reader

    def _dead(self) -> None:
        """The pump's pipe closed: every stream ends, and a new pump starts new actors."""
        self.pipe.close()
        self.pipe = None
        self.process.join(timeout=30)  # its exit ends its actors
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        reaper.kill_same(self.cluster)  # what its local cluster left behind
        self.cluster = {}
        if self._closing:
            return
        self.deaths += 1
        if self.deaths >= self.max_restarts:
            raise CollectionError(f"the Ray env workers' pump died {self.deaths} times in a row (last exit code "
                                  f"{self.process.exitcode}); stopping")
        for stream in range(len(self.clients)):
            if self.forget_slot is not None:
                self.forget_slot(stream)
            if self.on_restart is not None:
                self.on_restart(stream)
        self.restarts += len(self.clients)
        self._spawn()

    def receive(self, timeout: float) -> list[Chunk]:
        """The chunks that arrive within `timeout` s (those ready, at most one per env stream; at least one
        if any comes)."""
        if self.held is not None:  # a replacement read last time after chunks of its stream: theirs came first
            self._restarted(self.held)
            self.held = None
        if self.pipe is None or not wait([self.pipe], timeout):
            return []
        chunks = []
        while self.pipe is not None and len(chunks) < len(self.clients) and self.pipe.poll():
            self._reading, self.reading_since = True, time.monotonic()
            start = time.perf_counter()
            try:
                message = self.pipe.recv()
            except (EOFError, OSError):
                message = None
            finally:
                self._reading = False
            self.read_seconds += time.perf_counter() - start
            if isinstance(message, Restarted) and any(c.stream == message.stream for c in chunks):
                self.held = message  # the caller stores those chunks before the stream ends
                break
            if message is None and chunks:
                break  # the caller stores these before every stream ends; the next call reads the end again
            if message is None:
                self._dead()
            elif isinstance(message, Chunk):
                message.records = message.records.tensordict()
                self.deaths = 0
                self.restarts += message.env_restarts
                self.taken.value += 1
                chunks.append(message)
            elif isinstance(message, Restarted):
                self._restarted(message)
            elif isinstance(message, Note):
                if self.announce:
                    self.announce(f"dreamer: {message.text}")
            elif isinstance(message, Cluster):
                self.cluster.update({pid: started for pid, started in message.processes.items() if started})
                for pid in message.processes:
                    reaper.register(pid)  # ended with the trainer, however it ends
            else:
                raise CollectionError(str(message))
        return chunks

    def _restarted(self, message: Restarted) -> None:
        self.restarts += 1
        self.stalls += message.reason.startswith("no env step")
        if self.announce:
            self.announce(f"dreamer: Ray env worker {message.stream} replaced ({message.reason})")
        if self.on_restart is not None:
            self.on_restart(message.stream)

    def timing(self) -> tuple[int, list[float]]:
        """As `WorkerPool.timing` (module docstring: what served and wake mean here)."""
        times = list(self.times)
        return sum(self.stepped), [sum(times[k::TIMES]) for k in range(TIMES)]

    def blocked(self, seconds: float) -> bool:
        return self._reading and time.monotonic() - self.reading_since > seconds

    def stats(self) -> dict[str, float]:
        """collect/pump_busy: the pump's CPU time (user and system) over the wall time since the last call.
        The pump is one process: near 1.0 it is what limits the Ray workers' steps."""
        now, cpu = time.monotonic(), _cpu_seconds(self.process.pid) if self.process is not None else None
        last, self._pump_cpu = self._pump_cpu, (self.process.pid if self.process else None, now, cpu)
        if cpu is None or last is None or last[0] != self._pump_cpu[0] or last[2] is None or now <= last[1]:
            return {}
        return {"collect/pump_busy": (cpu - last[2]) / (now - last[1])}

    def close(self, timeout: float = 20.0) -> None:
        """Stops the pump, which ends its actors and leaves the cluster; kills it after `timeout` s."""
        self._closing = True
        self.stop.set()
        if self.process is None:
            return
        deadline = time.monotonic() + timeout
        while self.process.is_alive() and time.monotonic() < deadline:
            if self.pipe is not None and not self._reading and self.pipe.poll():
                try:  # a pump blocked on a full pipe finishes its send, then sees stop
                    os.read(self.pipe.fileno(), 1 << 16)
                except OSError:
                    pass
            self.process.join(0.05)
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        reaper.kill_same(self.cluster)  # none are left after a clean shutdown of the pump's cluster
        if self.pipe is not None and not self._reading:
            self.pipe.close()
            self.pipe = None


def _cpu_seconds(pid: int) -> float | None:
    """User and system CPU seconds of process `pid` (Linux), None where they cannot be read."""
    fields = reaper.stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else None
