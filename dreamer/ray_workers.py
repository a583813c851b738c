"""Env workers as Ray actors (`run.collect=ray`): envs on any node of a Ray cluster, acting through the
batched inference server on the learner's node.

Three parts:

- `EnvWorker`, the actor (one env, on whichever node Ray places it): `dreamer.collect.Collector` steps the
  env in a thread of the actor, exactly as a worker process does. Its policy is a mailbox: each step's
  request (the record's leaves packed in one row of bytes, `dreamer.inference.Rows`) leaves as the
  reply of a call of `exchange`, and the next call brings its answer. Every `run.chunk` records the
  finished chunk rides on a reply. Rows travel as bytes and chunks as numpy arrays (`Packed`), which Ray
  moves as they are; tensors would go through torch's pickling.
- The pumps (`_pump_main`), processes of the trainer's node, each a Ray driver for up to
  `run.ray_envs_per_pump` actors (the first starts a local cluster, the others join it): a pump keeps one
  `exchange` call in flight per actor; each reply's request goes into that env stream's slot of the
  inference server (the slot a worker process would own: `RowClient.post`), and each answer leaves with
  the stream's next call. How (`run.ray_pump`): `pipelined` (the default) posts replies as they come and
  sends each answer as soon as it is given, so that replies coming during a server pass go into the next
  one (as worker processes' requests do), at the cost of a loop that polls Ray and the answers' doorbells
  and of smaller passes; `sweep` posts the requests of all replies that have come with one wake-up of the
  server, waits for its answers to all of them and sends them, and only then takes the replies that came
  meanwhile. Beside a size200m learner on one H100 (64 envs) pipelined kept 0.941 of the collecting rate
  and sweep 0.903, same call (BENCHMARKS.md). A step costs one Ray call, whose reply carries the
  observation and whose argument carries the action. Chunks go on to the trainer over a pipe, as their
  bytes (a worker process's go through shared memory). A pump owns its actors: when it ends, Ray ends them.
  torchrl's Ray transport for its inference server was not used: a step through it takes about four Ray
  calls (requests and answers pass through queue actors) and its own server beside the run's.
- `RayPool`, in the trainer: the pumps, behind the worker pool's interface (`dreamer.workers.WorkerPool`)
  for `Ingest` and `dreamer.pipeline.WorkerSource`.

Faults, as for worker processes: an actor that dies (its process or its node lost: Ray raises on its
call) or that takes no step for `run.worker_stall_s` (killed by the pump) is replaced by a new actor,
which Ray places on any node with room; its records not yet sent are lost, its replay stream is ended
at the last record the trainer received, and the new actor starts a fresh episode. An actor that dies
`max_restarts` times without delivering a chunk in between stops collection with a CollectionError, as
do pumps that do. An env that raises inside the actor is rebuilt there by the collector. A pump that dies
ends every stream (the pool stops the other pumps and starts them all again, new actors on fresh
episodes). The pumps die with the trainer (`dreamer.reaper`).

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

# Ray's settings in a pump's environment that another process needs to join the local cluster it started.
RAY_JOIN_SETTINGS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")

# Bytes of Ray's object store on a local cluster, where the actors' chunks wait for the pump: room for a
# few chunks per env, at least 512 MB.
LOCAL_STORE_PER_ENV, LOCAL_STORE_MIN = 8 * 2**20, 512 * 2**20

# Seconds a pump with requests at the server waits for the first answer due before it looks for actors'
# replies again: a reply that comes meanwhile waits at most this long to be posted.
IDLE_WAIT = 0.0005

# Said once when Ray's memory monitor kills an env worker: its replacement is killed in turn while the node
# stays full (256 emulated envs on the 128 GB GPU machine: 148 replacements in 100 s, BENCHMARKS.md).
OUT_OF_MEMORY = ("dreamer: a node ran out of memory and Ray killed env workers, which are replaced and may be "
                 "killed again; set run.ray_env_memory_gb to what one env worker needs (Ray then starts only "
                 "the workers that fit and the others wait for room), or run fewer envs per node")

# How a pump relays steps (`run.ray_pump`; `_Pump`), the default first.
PUMP_MODES = ("pipelined", "sweep")


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
    """From the pump that started a local cluster: that cluster's processes ({pid: start time}), its
    address and the Ray settings of the pump's environment that joining it needs (its authentication
    mode: the token itself is in the user's home), for the run's other pumps."""

    processes: dict[int, str]
    address: str
    environment: dict[str, str]


@dataclass
class Placed:
    """From a pump: its actors' hosts ({host: actors}), all placed at `at` (the system's monotonic clock,
    which every process of the node shares); `ray_start`: the seconds its Ray start took."""

    hosts: dict[str, int]
    at: float
    ray_start: float


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
                 stall_seconds: float, stepped, times, taken, options: dict, suite: str, began: float | None,
                 mode: str):
        self.mode = mode  # `run.ray_pump`: sweep or pipelined (`_sweep_step`, `_pipelined_step`)
        self.actor_class, self.args, self.clients, self.writer, self.stop = actor_class, args, clients, writer, stop
        # Backpressure, as a worker process's full pipe gives it: at most one chunk per env stream sent and
        # not yet taken by the trainer (`taken`, shared); beyond that the pump stops answering and the
        # actors wait.
        self.taken, self.sent, self.paused = taken, 0, None
        self.max_restarts, self.stall_seconds, self.options, self.suite = max_restarts, stall_seconds, options, suite
        self.stepped, self.times = stepped, times
        # Per env stream of this pump (`clients`: {stream: its inference client}; the run's stream numbers).
        self.actors: dict = dict.fromkeys(clients)
        self.calls: dict = {}  # the exchange call in flight -> its stream
        self.posted: dict = {}  # streams whose request waits for the server's answer (as an ordered set)
        self.sent_at = dict.fromkeys(clients, 0.0)  # when each stream's call left
        self.served = dict.fromkeys(clients, 0.0)  # the server's part of each stream's last round trip
        self.deaths = dict.fromkeys(clients, 0)  # deaths in a row, per stream
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
            self.writer.send(Placed(counts, time.monotonic(), self.connected - self.began))
            self.announced = True
        elif not self.announced and time.monotonic() - self.started > 60:
            resources = ray.available_resources()
            # Placed actors hold their CPUs while their processes start (on a node, all at once: 128 took
            # 124 s on 16 cores), so no free CPU does not tell waiting from starting.
            self.writer.send(Note(f"{len(self.placing)} of a pump's {len(self.actors)} Ray env workers not running yet "
                                  f"{time.monotonic() - self.began:.0f} s after the pump's start: starting, or "
                                  f"waiting for a node with room ({self.options.get('num_cpus')} CPUs each; the "
                                  f"cluster has {resources.get('CPU', 0):g} CPUs free)"))
            self.started = time.monotonic()

    def run(self) -> None:
        for stream in self.actors:
            self._start(stream)
        self.checked = self.placed = time.monotonic()
        step = self._pipelined_step if self.mode == "pipelined" else self._sweep_step
        while not self.stop.is_set():
            now = time.monotonic()
            if (not self.announced or self.placing) and now - self.placed > 0.05:
                self.placed = now
                self._placement()
            if self.sent - self.taken.value >= len(self.clients):
                self.paused = self.paused or time.monotonic()
                time.sleep(0.01)
                continue
            if self.paused is not None:  # the actors waited for the trainer, not for their envs: no stall
                held, self.paused = time.monotonic() - self.paused, None
                self.sent_at = {stream: at + held for stream, at in self.sent_at.items()}
            step()
            now = time.monotonic()
            if now - self.checked > 1.0:
                self.checked = now
                for call, stream in list(self.calls.items()):
                    if now - self.sent_at[stream] > self.stall_seconds:
                        self._replace(stream, f"no env step in {self.stall_seconds:g} s")

    def _sweep_step(self) -> None:
        """`run.ray_pump=sweep`: waits for a reply (0.1 s at most), posts the requests of every reply that has
        come, waits for the server's answers to all of them and sends them."""
        import ray

        if not self.calls:  # every actor being replaced
            time.sleep(0.01)
            return
        ready, _ = ray.wait(list(self.calls), num_returns=1, timeout=0.1)
        if ready:
            self._post_replies()
        for stream in list(self.posted):
            self._send_answer(stream)

    def _pipelined_step(self) -> None:
        """`run.ray_pump=pipelined`: posts the requests of the replies that have come and sends the answers
        the server has given; with neither, waits for the first answer due (IDLE_WAIT) or for a reply."""
        import ray

        moved = self._post_replies()
        for stream in list(self.posted):
            if self.clients[stream].doorbell.is_set():
                self._send_answer(stream)
                moved = True
        if not moved:
            if self.posted:
                self.clients[next(iter(self.posted))].doorbell.wait(IDLE_WAIT)
            elif self.calls:
                ray.wait(list(self.calls), num_returns=1, timeout=0.1)
            else:  # every actor being replaced
                time.sleep(0.01)

    def _post_replies(self) -> bool:
        """Posts the request of every reply that has come (one ring for them all); whether any came."""
        import ray
        from ray.exceptions import RayError

        if not self.calls:
            return False
        ready, _ = ray.wait(list(self.calls), num_returns=len(self.calls), timeout=0)
        if not ready:
            return False
        try:  # one call of Ray's for them all; one per reply where some actor failed
            replies = ray.get(ready)
        except RayError:
            replies = None
        first = None
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
            self.posted[stream] = None
            first = stream if first is None else first
        if first is not None:
            self.clients[first].ring()  # once: the server's next pass finds them all
        return True

    def _send_answer(self, stream: int) -> None:
        """Waits for the answer to `stream`'s posted request and sends it with the stream's next `exchange`."""
        client = self.clients[stream]
        before = client.served_seconds
        answer = client.answer().numpy().tobytes()  # Ray packs bytes as they are, a tensor through pickle
        self.served[stream] = client.served_seconds - before
        del self.posted[stream]
        self.calls[self.actors[stream].exchange.remote(answer)] = stream
        self.sent_at[stream] = time.monotonic()

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

        closing = [actor.close.remote() for actor in self.actors.values() if actor is not None]
        ray.wait(closing, num_returns=len(closing), timeout=10)  # each closes its env
        for actor in self.actors.values():
            if actor is not None:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:
                    pass


def _pump_main(address: str | None, options: dict, args: tuple, clients: dict, envs: int, writer: Connection,
               stop, max_restarts: int, stall_seconds: float, stepped, times, taken, suite: str, trainer: int,
               environment: dict | None, mode: str) -> None:
    """A pump process: joins (or starts, for a run of `envs` env actors) the cluster, runs the pump of its
    streams (`clients`) until `stop` is set, then ends their actors and leaves the cluster. `environment`:
    settings to join with (`Cluster`)."""
    os.environ.update(environment or {})
    reaper.bind(trainer)  # first: it dies with the trainer, however that dies
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # stopping is the trainer's call (see dreamer.workers)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    torch.set_num_threads(1)
    pump = None
    began = time.monotonic()
    try:
        import ray

        if environment:
            # Ray reads its settings from the environment once per process, and this one's fork server had
            # imported Ray: read them again (as Ray's own start does when it turns on token authentication).
            # Private to Ray: tests/test_ray.py's smoke run joins through it and fails if it changes.
            ray._raylet.Config.initialize("")
        _connect(address, envs, options["num_cpus"])
        if address is None:
            # Ray's own processes of a local cluster: most end with this process, not all of them (its
            # agents outlive a killed raylet). The trainer ends what is left (`RayPool`, `dreamer.reaper`).
            writer.send(Cluster({pid: reaper.started_at(pid) for pid in reaper.descendants(os.getpid())},
                                ray.get_runtime_context().gcs_address,
                                {key: value for key, value in os.environ.items() if key in RAY_JOIN_SETTINGS}))
        pump = _Pump(ray.remote(EnvWorker), args, clients, writer, stop, max_restarts, stall_seconds, stepped,
                     times, taken, options, suite, began, mode)
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


@dataclass
class _Shard:
    """One pump of a `RayPool` and the env streams it serves."""

    streams: list[int]
    process: object = None
    pipe: Connection | None = None
    taken: object = None  # the chunks the pool has read from this pump (a shared counter, see _Pump)
    spawned: float = 0.0


class RayPool:
    """`WorkerPool`'s interface over env workers that are Ray actors, fed by pump processes.

    One pump serves up to `envs_per_pump` env streams (its CPU per env step bounds the steps it passes:
    `collect/pump_busy`); the first starts the local cluster where there is no `address`, and the others
    join it. `on_restart(stream)` runs in the caller of `receive` when an actor was replaced, once the chunks
    it sent are in the caller's hands (a replacement read after one of them waits for the next `receive`).
    A pump that dies ends every stream: all pumps stop, `forget_slot(stream)` (the inference server's) and
    `on_restart(stream)` run for each (a dead pump's requests may be left in the slots), and new pumps start
    new actors; pumps that die `max_restarts` times without a chunk in between stop collection. `announce`
    prints the pool's notes (the actors' placement).
    """

    def __init__(self, env_cfg: dict, seed: int, layout: EnvLayout, size: ModelSize, clients: list,
                 chunk: int = 64, suite: str = "env", max_restarts: int = 10,
                 on_restart: Callable[[int], None] | None = None, stall_seconds: float = 600.0,
                 start_method: str = "forkserver", address: str | None = None, env_cpus: float = 1.0,
                 env_memory_gb: float = 0.0, forget_slot: Callable[[int], None] | None = None,
                 announce: Callable[[str], None] | None = print, envs_per_pump: int = 32, pump: str = PUMP_MODES[0]):
        reaper.guard()
        if envs_per_pump < 1:
            raise ValueError(f"envs_per_pump must be at least 1, got {envs_per_pump}")
        if pump not in PUMP_MODES:
            raise ValueError(f"pump must be one of {', '.join(PUMP_MODES)}, got {pump!r}")
        self.pump = pump
        # Without their error queues: a pump's start passes every descriptor of its arguments at once.
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
        self.envs_per_pump = envs_per_pump
        self.shards = [_Shard(list(range(first, min(n, first + envs_per_pump))))
                       for first in range(0, n, envs_per_pump)]
        self.stepped = self.context.RawArray("q", n)
        self.times = self.context.RawArray("d", TIMES * n)
        self.cluster: dict[int, str] = {}  # the processes of the first pump's local Ray cluster
        self.placed: list[Placed] = []  # the pumps' placements since their start
        self.restarts = 0  # actor replacements, pump restarts and env rebuilds inside actors
        self.stalls = 0  # actors replaced for taking no step in stall_seconds
        self.memory_kills = 0  # actors replaced after Ray's memory monitor killed them
        self.deaths = 0  # pump deaths in a row
        self.read_seconds = 0.0
        self._reading = False
        self.reading_since = 0.0
        self._closing = False
        self._pump_cpu: dict[int, tuple] = {}  # pid -> (clock, CPU seconds) of each pump at the last `stats`
        self.held: Restarted | None = None  # a replacement whose stream's chunks the caller stores first

    @property
    def process(self):
        """The first pump's process (the parent of a local cluster's processes)."""
        return self.shards[0].process if self.shards else None

    def start(self) -> RayPool:
        self._spawn()
        return self

    def _spawn(self) -> None:
        """Starts the first pump; the others start with it where the cluster exists, else once it has
        started the local one (its `Cluster` message)."""
        self.placed = []
        self._spawn_shard(self.shards[0], self.address)
        if self.address is not None:
            for shard in self.shards[1:]:
                self._spawn_shard(shard, self.address)

    def _spawn_shard(self, shard: _Shard, address: str | None, environment: dict | None = None) -> None:
        reader, writer = self.context.Pipe(duplex=False)
        shard.taken = self.context.RawValue("q", 0)
        shard.process = self.context.Process(
            target=_pump_main, name="dreamer-ray-pump", daemon=True,
            args=(address, self.options, self.args, {s: self.clients[s] for s in shard.streams}, len(self.clients),
                  writer, self.stop, self.max_restarts, self.stall_seconds, self.stepped, self.times, shard.taken,
                  self.suite, os.getpid(), environment, self.pump))
        shard.spawned = time.monotonic()
        shard.process.start()
        reaper.register(shard.process.pid)
        writer.close()
        shard.pipe = reader

    def _stop_pumps(self, timeout: float) -> None:
        """Sets `stop` and waits for every pump to end its actors and exit; kills those left after `timeout`."""
        self.stop.set()
        deadline = time.monotonic() + timeout
        running = [shard for shard in self.shards if shard.process is not None]
        while any(shard.process.is_alive() for shard in running) and time.monotonic() < deadline:
            for shard in running:
                if shard.pipe is not None and not self._reading and shard.pipe.poll():
                    try:  # a pump blocked on a full pipe finishes its send, then sees stop
                        os.read(shard.pipe.fileno(), 1 << 16)
                    except OSError:
                        pass
                shard.process.join(0.02)
        for shard in running:
            if shard.process.is_alive():
                shard.process.kill()
            shard.process.join(timeout=5)
        for shard in self.shards:
            if shard.pipe is not None and not self._reading:
                shard.pipe.close()
                shard.pipe = None

    def _dead(self, shard: _Shard) -> None:
        """A pump's pipe closed: every pump stops, every stream ends, and new pumps start new actors."""
        code = shard.process.exitcode if shard.process is not None else None
        self._stop_pumps(timeout=30)  # the others end their actors; a pump's exit ends its own
        reaper.kill_same(self.cluster)  # what the first pump's local cluster left behind
        self.cluster = {}
        if self._closing:
            return
        self.deaths += 1
        if self.deaths >= self.max_restarts:
            raise CollectionError(f"a pump of the Ray env workers died {self.deaths} times in a row (last exit "
                                  f"code {code}); stopping")
        for stream in range(len(self.clients)):
            if self.forget_slot is not None:
                self.forget_slot(stream)
            if self.on_restart is not None:
                self.on_restart(stream)
        self.restarts += len(self.clients)
        self.stop = self.context.Event()
        self._spawn()

    def receive(self, timeout: float) -> list[Chunk]:
        """The chunks that arrive within `timeout` s (those ready, at most one per env stream; at least one
        if any comes)."""
        if self.held is not None:  # a replacement read last time after chunks of its stream: theirs came first
            self._restarted(self.held)
            self.held = None
        pipes = [shard.pipe for shard in self.shards if shard.pipe is not None]
        if not pipes or not wait(pipes, timeout):
            return []
        chunks: list[Chunk] = []
        for shard in list(self.shards):
            while shard.pipe is not None and len(chunks) < len(self.clients) and shard.pipe.poll():
                self._reading, self.reading_since = True, time.monotonic()
                start = time.perf_counter()
                try:
                    message = shard.pipe.recv()
                except (EOFError, OSError):
                    message = None
                finally:
                    self._reading = False
                self.read_seconds += time.perf_counter() - start
                if isinstance(message, Restarted) and any(c.stream == message.stream for c in chunks):
                    self.held = message  # the caller stores those chunks before the stream ends
                    return chunks
                if message is None:
                    if not chunks:  # else the caller stores these first; the next call reads the end again
                        self._dead(shard)
                    return chunks
                if isinstance(message, Chunk):
                    message.records = message.records.tensordict()
                    self.deaths = 0
                    self.restarts += message.env_restarts
                    shard.taken.value += 1
                    chunks.append(message)
                elif isinstance(message, Restarted):
                    self._restarted(message)
                elif isinstance(message, Note):
                    if self.announce:
                        self.announce(f"dreamer: {message.text}")
                elif isinstance(message, Placed):
                    self._placed(message)
                elif isinstance(message, Cluster):
                    self.cluster.update({pid: started for pid, started in message.processes.items() if started})
                    for pid in message.processes:
                        reaper.register(pid)  # ended with the trainer, however it ends
                    for other in self.shards[1:]:  # the other pumps join the local cluster
                        if other.process is None or not other.process.is_alive():
                            self._spawn_shard(other, message.address, message.environment)
                else:
                    raise CollectionError(str(message))
        return chunks

    def _placed(self, message: Placed) -> None:
        """Says where the actors went once every pump has placed its own."""
        self.placed.append(message)
        if len(self.placed) < len(self.shards) or not self.announce:
            return
        counts: dict[str, int] = {}
        for placed in self.placed:
            for host, count in placed.hosts.items():
                counts[host] = counts.get(host, 0) + count
        where = ", ".join(f"{host} ({count})" for host, count in sorted(counts.items()))
        pumps = f"; {len(self.shards)} pumps of up to {self.envs_per_pump} env workers" if len(self.shards) > 1 else ""
        after = max(placed.at for placed in self.placed) - self.shards[0].spawned
        ray_start = max(placed.ray_start for placed in self.placed)
        self.announce(f"dreamer: {len(self.clients)} Ray env workers on {len(counts)} node(s): {where}; all placed "
                      f"{after:.1f} s after the pump's start (Ray's own start {ray_start:.1f} s){pumps}")

    def _restarted(self, message: Restarted) -> None:
        self.restarts += 1
        self.stalls += message.reason.startswith("no env step")
        if self.announce:
            self.announce(f"dreamer: Ray env worker {message.stream} replaced ({message.reason})")
        if message.reason.startswith("OutOfMemoryError"):
            self.memory_kills += 1
            if self.memory_kills == 1 and self.announce:
                self.announce(OUT_OF_MEMORY)
        if self.on_restart is not None:
            self.on_restart(message.stream)

    def timing(self) -> tuple[int, list[float]]:
        """As `WorkerPool.timing` (module docstring: what served and wake mean here)."""
        times = list(self.times)
        return sum(self.stepped), [sum(times[k::TIMES]) for k in range(TIMES)]

    def blocked(self, seconds: float) -> bool:
        return self._reading and time.monotonic() - self.reading_since > seconds

    def stats(self) -> dict[str, float]:
        """collect/pump_busy: the busiest pump's CPU time (user and system) over the wall time since the last
        call. Near 1.0 that pump is what limits its Ray workers' steps (`run.ray_envs_per_pump`)."""
        now, busy, last = time.monotonic(), [], self._pump_cpu
        self._pump_cpu = {}
        for shard in self.shards:
            if shard.process is None or shard.process.pid is None:
                continue
            pid = shard.process.pid
            cpu = _cpu_seconds(pid)
            self._pump_cpu[pid] = (now, cpu)
            before = last.get(pid)
            if cpu is not None and before is not None and before[1] is not None and now > before[0]:
                busy.append((cpu - before[1]) / (now - before[0]))
        return {"collect/pump_busy": max(busy)} if busy else {}

    def close(self, timeout: float = 20.0) -> None:
        """Stops the pumps, which end their actors and leave the cluster; kills them after `timeout` s."""
        self._closing = True
        self._stop_pumps(timeout)
        reaper.kill_same(self.cluster)  # none are left after a clean shutdown of the first pump's cluster


def _cpu_seconds(pid: int) -> float | None:
    """User and system CPU seconds of process `pid` (Linux), None where they cannot be read."""
    fields = reaper.stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else None
