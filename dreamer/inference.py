"""The batched inference server: the acting policy on the inference device, serving env worker processes.

Workers send one record each (the carry the policy had before o[t], and o[t] under `next`, the layout of
`dreamer.collect`) through a process-slot transport: every worker owns a fixed slot in shared memory,
and only a wake-up signal crosses processes. A slot is one row of bytes (`Rows`: every leaf of the
request packed at a fixed offset), so a pass moves its whole batch with one gather, one copy to the
device, one copy back and one scatter; torchrl's transport moves every leaf of a tensordict separately,
and its passes measured about 5 ms of host work beside 2.6 ms on the GPU (BENCHMARKS.md). torchrl's
`InferenceServer` loop (waiting, draining ready slots, the model lock, statistics) runs on the inference
device, in a process of its own (its Python never waits for the trainer's) or in a thread of the
trainer (its kernels run beside the learner's on a shared GPU), and answers a whole sweep of ready slots
with one batched pass (`RowPass`); on CUDA that pass is a CUDA graph of the smallest captured batch that
holds the sweep, on a high-priority stream of its own.

The server acts with its own copy of the policy's weights: the learner updates its weights in place,
inside a CUDA graph, while the server reads its copy. `WeightSync` refreshes the copy every
`run.sync_every` updates without making the learner wait (see its docstring).
"""

from __future__ import annotations

import copy
import gc
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torchrl.envs import ExplorationType, set_exploration_type
from torchrl.modules.inference_server import InferenceServer, ProcessSlotTransport

from dreamer import reaper
from dreamer.agent import ActingPolicy, EnvLayout, ModelSize, record_zeros
from dreamer.collect import CollectionError


def percentile(values: list[float], q: float) -> float:
    """The q-quantile of `values` (nearest rank); nan when there are none."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


def request_spec(layout: EnvLayout, size: ModelSize) -> TensorDict:
    """One worker's request: a replay record without batch dimensions (zeros, an episode's first)."""
    record = record_zeros(layout, size)
    record["is_init"].fill_(True)
    return record


def response_spec(layout: EnvLayout, size: ModelSize) -> TensorDict:
    """The server's answer to one request: the posterior and the action, and the weights' version."""
    return TensorDict(
        policy=TensorDict(
            state=torch.zeros(size.latent), belief=torch.zeros(size.deter), action=torch.zeros(layout.action_dim)
        ),
        policy_version=torch.zeros((), dtype=torch.long),
    )


class _Doorbell:
    """A slot's answer signal on a process-shared semaphore, with the Event methods the slot client uses.

    torchrl's process-slot transport wakes a worker with a multiprocessing Event, whose `set` waits for
    every sleeper to acknowledge: a worker killed while waiting for its answer never does, and the
    server thread hangs in `set` forever (seen here: SIGKILL of one worker stopped all inference). A
    semaphore's release never waits. `is_set`/`wait` remember a taken ring in this process only.
    """

    def __init__(self, context):
        self.semaphore = context.Semaphore(0)
        self.rung = False

    def set(self) -> None:
        self.semaphore.release()

    def is_set(self) -> bool:
        self.rung = self.rung or self.semaphore.acquire(False)
        return self.rung

    def wait(self, timeout: float | None = None) -> bool:
        if not self.rung:
            self.rung = self.semaphore.acquire(True, timeout)
            if not self.rung and reaper.trainer_gone():  # no answer will come
                raise SystemExit(0)
        return self.rung

    def clear(self) -> None:
        """Forgets a taken ring and any ring left over (an answer meant for a dead predecessor)."""
        self.rung = False
        while self.semaphore.acquire(False):
            pass


class Rows:
    """A tensordict layout packed into one row of bytes: each leaf at a fixed offset of the row.

    A bank of rows [n, width] (uint8) then moves n requests or answers with one copy, and `views` gives
    the leaves of any rows as tensors that share its memory. Leaves are placed by descending element
    size, so each offset is a multiple of its element size and the row width a multiple of 8.
    """

    def __init__(self, spec: TensorDictBase):
        leaves = sorted(spec.items(include_nested=True, leaves_only=True), key=lambda item: -item[1].element_size())
        self.fields: list[tuple] = []  # (key, dtype, shape, offset, bytes)
        offset = 0
        for key, value in leaves:
            size = value.numel() * value.element_size()
            self.fields.append((key, value.dtype, tuple(value.shape), offset, size))
            offset += size
        self.width = -(-offset // 8) * 8

    def allocate(self, rows: int, device=None) -> torch.Tensor:
        return torch.zeros(rows, self.width, dtype=torch.uint8, device=device)

    def views(self, rows: torch.Tensor) -> list[tuple]:
        """[(key, view)]: each leaf of `rows` [..., width], shaped [..., *leaf shape]."""
        views = []
        for key, dtype, shape, offset, size in self.fields:
            flat = rows[..., offset:offset + size].view(dtype)
            views.append((key, flat.unflatten(-1, shape) if shape else flat.squeeze(-1)))
        return views

    def tensordict(self, rows: torch.Tensor) -> TensorDict:
        batch = TensorDict(batch_size=rows.shape[:-1], device=rows.device)
        for key, view in self.views(rows):
            batch.set(key, view)
        return batch


class RowClient:
    """A worker's end of one slot: writes its request into the slot's row, rings the server, waits for
    the answer's ring and reads the answer from the slot's response row.

    Nothing here takes a lock (see KillSafeSlotTransport). The views of the slot's rows are made on first
    use, in the worker's process, not pickled with the client.
    """

    def __init__(self, transport: KillSafeSlotTransport, slot: int):
        self.slot = slot
        self.requests, self.responses = transport.requests, transport.responses
        self.request_rows, self.response_rows = transport.request_rows, transport.response_rows
        self.ready, self.submitted_at = transport._request_ready, transport._submitted_at
        self.status, self.errors = transport._response_status, transport._exception_queues[slot]
        self.doorbell, self.work = transport._response_events[slot], transport._work_semaphore
        self.answered_at = transport.answered_at
        # Seconds summed over this client's requests: from its submission to the server's ring (the
        # server's queue, pass and scatter), and from that ring to this process running again (its wake-up).
        self.served_seconds = self.wake_seconds = 0.0
        self._submitted = 0.0
        self._in = self._out = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_in": None, "_out": None}

    def without_errors(self) -> RowClient:
        """A copy without the slot's error queue, for a process that holds many clients (the Ray pump):
        each queue is a pipe, two descriptors in the pickle, and a forkserver start passes at most 252
        (multiprocessing's limit), which 126 slots reach. Its failed request raises a RuntimeError naming
        the slot; the server's process prints the error itself (`KillSafeSlotTransport.resolve_exception`)."""
        copy = RowClient.__new__(RowClient)
        copy.__dict__.update(self.__getstate__())
        copy.errors = None
        return copy

    def ask(self, request: TensorDictBase) -> list[tuple]:
        """The answer's [(key, view)] in the slot's response row [1, ...]: valid until the next request.
        `request` holds the request's leaves, with or without a batch dimension of 1."""
        if self._in is None:
            self._in = self.request_rows.views(self.requests[self.slot:self.slot + 1])
            self._out = self.response_rows.views(self.responses[self.slot:self.slot + 1])
        for key, view in self._in:
            view.copy_(request.get(key))
        self._submit()
        self._await()
        return self._out

    def post(self, row, ring: bool = True) -> None:
        """Submits a request already packed as a row (`Rows` of the request spec; a tensor or a numpy array)
        without waiting for its answer (`answer` waits): a caller that serves several slots posts all its
        requests first, and the server answers them in one pass. `ring=False` leaves waking the server to
        the caller's `ring` after its last post: one wake-up, and a pass that finds them all."""
        if isinstance(row, torch.Tensor):
            self.requests[self.slot].copy_(row)
        else:
            self.requests[self.slot].numpy()[:] = row
        self._submit(ring)

    def ring(self) -> None:
        """Wakes the server for the requests posted without a ring (any slot's client wakes it for all)."""
        self.work.release()

    def answer(self) -> torch.Tensor:
        """The answer to the posted request: the slot's response row, valid until the next request."""
        self._await()
        return self.responses[self.slot]

    def _submit(self, ring: bool = True) -> None:
        slot = self.slot
        self.doorbell.clear()
        self.status[slot] = 0
        self.submitted_at[slot] = self._submitted = time.monotonic()
        self.ready[slot] = 1  # after the payload: the server reads the row once it sees this byte
        if ring:
            self.work.release()

    def _await(self) -> None:
        slot, submitted = self.slot, self._submitted
        while not self.doorbell.wait(0.1):  # raises SystemExit when the trainer is gone
            pass
        woke, answered = time.monotonic(), self.answered_at[slot]
        if answered >= submitted:  # this request's ring (a dead predecessor's answer is never timed)
            self.served_seconds += answered - submitted
            self.wake_seconds += woke - answered
        self.doorbell.clear()
        if self.status[slot]:
            if self.errors is None:
                raise RuntimeError(f"the inference server failed on slot {slot}'s request; its error is in the "
                                   "trainer's output")
            raise self.errors.get()

    def __call__(self, request: TensorDictBase) -> TensorDict:
        """The answer as a tensordict of its own (`policy`, `policy_version`)."""
        answer = TensorDict()
        for key, view in self.ask(request):
            answer.set(key, view[0].clone())
        return answer

    def act(self, record: TensorDictBase) -> TensorDictBase:
        """The worker's policy call: the answer's `policy` keys set in `record` [1] (copies)."""
        answer = {key[1]: view.clone() for key, view in self.ask(record) if key[0] == "policy"}
        record.set("policy", TensorDict(answer, batch_size=record.batch_size, device=record.device))
        return record


class KillSafeSlotTransport(ProcessSlotTransport):
    """torchrl's process-slot transport with rows of bytes for slots and nothing a killed worker can
    leave locked.

    - Each slot's request and answer are rows of shared banks (`Rows`): `RowClient` on the worker's
      side, `RowPass` on the server's. torchrl's per-leaf slot banks stay allocated but unused, except
      by its loop's shutdown path.
    - Answers ring a `_Doorbell` (a semaphore) instead of an Event.
    - Workers publish a request without the shared request lock: they write the payload, then the
      slot's ready byte, then release the server's work semaphore. The semaphore release orders those
      writes, and x86 keeps stores in order for the server's timed sweeps, which only read. Only the
      server takes the lock. A worker killed inside the lock would otherwise stop every other worker.
    - Workers get no server-liveness Event (reading one takes its lock too); the trainer watches the
      server, and a worker whose trainer is gone exits instead of waiting (`_Doorbell.wait`; it is
      also killed then, see `dreamer.reaper`).
    """

    def __init__(self, request_spec, response_spec, *, num_slots: int):
        context = multiprocessing.get_context("spawn")
        super().__init__(request_spec, response_spec, num_slots=num_slots, ctx=context)
        self._response_events = [_Doorbell(context) for _ in range(num_slots)]
        self.request_rows, self.response_rows = Rows(request_spec), Rows(response_spec)
        self.answered_at = context.Array("d", num_slots, lock=False)  # when each slot's last answer was rung
        self.requests = self.request_rows.allocate(num_slots).share_memory_()
        self.responses = self.response_rows.allocate(num_slots).share_memory_()

    def client(self) -> RowClient:
        slot = self._next_client_slot
        if slot >= self._num_slots:
            raise RuntimeError(f"all {self._num_slots} slots have clients")
        self._next_client_slot += 1
        return RowClient(self, slot)

    def resolve_exception(self, callback: int, exc: BaseException) -> None:
        """torchrl's loop hands a failed pass's error to each of its slots: printed here too, in the server's
        process, for clients that take no error queue (`RowClient.without_errors`)."""
        print(f"dreamer: the inference server failed on slot {callback}'s request: {exc!r}", file=sys.stderr,
              flush=True)
        super().resolve_exception(callback, exc)

    def ring(self, slots: list[int]) -> None:
        """Wakes the workers of `slots`, their answers written."""
        now = time.monotonic()
        for slot in slots:
            self.answered_at[slot] = now
            self._response_status[slot] = 0
            self._response_events[slot].set()


class _ServingGraph:
    """A policy captured once as a CUDA graph of a static batch, replayed on the caller's stream (the
    inline source's acting copy, `dreamer.pipeline.ActingCopy`).

    Unlike tensordict's `CudaGraphModule`, which synchronizes the whole device before every replay (see
    `_StreamServer`), the inputs are copied into the graph's static batch and the graph replayed on the
    current stream, so a call is ordered after the previous call only; the caller reads the outputs, on
    that stream, before the next replay overwrites them.
    """

    def __init__(self, model: nn.Module, example: TensorDictBase, warmup: int = 2):
        device = example.device
        self.keys = list(example.keys(include_nested=True, leaves_only=True))
        self.inputs = example.clone()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # lazy initializations and autotuning happen outside the capture
            for _ in range(warmup):
                model(self.inputs.clone())
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # A capture stream of its own: cuBLAS picks its workspace per stream at capture and the graph
        # keeps it. Captured on torch's shared default capture stream, like the learner's step was, both
        # graphs used one workspace, and replayed side by side they hung the GPU (a pipeline run on one
        # H200 never finished its train phase). thread_local: the learner's thread may call into CUDA
        # while the server captures.
        capture = torch.cuda.Stream(device)
        with torch.cuda.graph(self.graph, stream=capture, capture_error_mode="thread_local"):
            # A shallow copy: the model may rebind keys of its input, the graph reads `self.inputs`' leaves.
            self.outputs = model(self.inputs.copy())

    def __call__(self, batch: TensorDictBase) -> TensorDictBase:
        self.inputs.update_(batch.select(*self.keys), non_blocking=True)
        self.graph.replay()
        return self.outputs


def graph_sizes(clients: int) -> list[int]:
    """The batch sizes the server captures a graph for: 8, 16, 32, ... up to `clients` (which is one)."""
    sizes, size = [], 8
    while size < clients:
        sizes.append(size)
        size *= 2
    return [*sizes, clients]


class RowPass:
    """One pass of the server over a sweep of ready slots, on the current stream (the serving stream).

    The requests' rows are gathered from the shared bank into a host batch (pinned on CUDA), copied to
    the device rows in one copy, the policy reads its inputs from views of those rows and its answer
    goes into device response rows, which come back in one copy; after one event wait the answers are
    scattered into the slots' response rows. With `cudagraph` the policy and the writes of its answer
    are CUDA graphs, one per size of `graph_sizes` (sharing one memory pool), and a pass replays the
    smallest that holds its requests: rows past them hold earlier requests and their answers are not
    read. The size200m pass measured 0.98 ms of GPU time at 8 rows against 1.67 at 64 (BENCHMARKS.md),
    and a sweep holds about 8 requests of 64 workers.
    """

    def __init__(self, transport: KillSafeSlotTransport, model: nn.Module, device: torch.device, cudagraph: bool,
                 warmup: int = 2):
        self.transport, self.model = transport, model
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        slots = transport._num_slots
        self.request_rows, self.response_rows = transport.request_rows, transport.response_rows
        self.host_request = self.request_rows.allocate(slots)
        self.host_response = self.response_rows.allocate(slots)
        if cuda:
            self.host_request, self.host_response = self.host_request.pin_memory(), self.host_response.pin_memory()
        self.device_request = self.request_rows.allocate(slots, self.device) if cuda else self.host_request
        self.device_response = self.response_rows.allocate(slots, self.device) if cuda else self.host_response
        self.version = dict(self.response_rows.views(self.host_response))["policy_version"]
        self.event = torch.cuda.Event() if cuda else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if cudagraph and cuda:
            self._capture(graph_sizes(slots), warmup)

    def _forward(self, rows: int) -> None:
        """The policy on device rows [:rows], its answer written into the device response rows."""
        answer = self.model(self.request_rows.tensordict(self.device_request[:rows]))
        for key, view in self.response_rows.views(self.device_response[:rows]):
            if key != "policy_version":
                view.copy_(answer.get(key))

    def _capture(self, sizes: list[int], warmup: int) -> None:
        device = self.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # lazy initializations and autotuning happen outside the capture
            for size in sizes:
                for _ in range(warmup):
                    self._forward(size)
        torch.cuda.current_stream(device).wait_stream(side)
        # A capture stream of its own: cuBLAS picks its workspace per stream at capture and the graph
        # keeps it. Captured on torch's shared default capture stream, like the learner's step was, both
        # graphs used one workspace, and replayed side by side they hung the GPU (a pipeline run on one
        # H200 never finished its train phase). thread_local: the learner's thread may call into CUDA
        # while the server captures.
        capture, pool = torch.cuda.Stream(device), torch.cuda.graph_pool_handle()
        for size in sorted(sizes, reverse=True):  # the largest first: the pool fits the others in its blocks
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=capture, capture_error_mode="thread_local"):
                self._forward(size)
            self.graphs[size] = graph
        self.graphs = dict(sorted(self.graphs.items()))  # a pass takes the first that holds its rows
        torch.cuda.current_stream(device).wait_stream(capture)

    def __call__(self, slots: list[int], version: int) -> None:
        """Answers the requests of `slots` into their response rows (the caller rings them)."""
        rows = len(slots)
        index = torch.tensor(slots, dtype=torch.long)
        torch.index_select(self.transport.requests, 0, index, out=self.host_request[:rows])
        if self.event is not None:
            self.device_request[:rows].copy_(self.host_request[:rows], non_blocking=True)
            if self.graphs:
                self.graphs[next(size for size in self.graphs if size >= rows)].replay()
            else:
                self._forward(rows)
            self.host_response[:rows].copy_(self.device_response[:rows], non_blocking=True)
            self.event.record()
            self.event.synchronize()
        else:
            self._forward(rows)
        self.version[:rows].fill_(version)
        self.transport.responses.index_copy_(0, index, self.host_response[:rows])


class _StreamServer(InferenceServer):
    """torchrl's server loop with our pass (`RowPass`), its serving thread on a CUDA stream of its own.

    A thread's current stream is the device's default stream, which the learner uses: on a shared GPU
    every inference pass would queue behind the learner's update. torch's streams do not synchronize
    with the default one, so the two overlap. torchrl's own pass would capture with tensordict's
    `CudaGraphModule`, which synchronizes the whole device before every replay: on a GPU shared with
    the learner each pass then waited for the learner's queued update (the first two pipeline runs on
    one H200 measured a p99 of 129 to 132 ms, about one update).
    """

    @torch.no_grad()
    def prepare_cudagraph(self, request_spec: TensorDictBase, *, interaction_type=None) -> None:
        """Captures `RowPass`'s graphs in place of torchrl's capture, with the bookkeeping its weight
        updates check (the captured weights' storage)."""
        if self.static_batch_size is None:
            return
        if interaction_type is not None:
            raise ValueError("the served policy sets its own exploration type; pass no interaction_type")
        self._slot_batches = self._cudagraph_model = RowPass(self.transport, self.model, self.policy_device,
                                                             cudagraph=True)
        self._cudagraph_tensor_references = self._model_tensor_references()
        self._cudagraph_storage_signature = self._tensor_storage_signature(self._cudagraph_tensor_references)

    def start(self) -> InferenceServer:
        if self._slot_batches is None and self.static_batch_size is None:
            self._slot_batches = RowPass(self.transport, self.model, self.policy_device, cudagraph=False)
        return super().start()

    @torch.no_grad()
    def _serve_slot_batch(self, batches: RowPass, slots: list[int], submitted_at: list[float | None]) -> None:
        """One pass of torchrl's loop: the requests of `slots`, answered and rung; the pass's duration
        (from the gather of the requests to their answers in the slots) kept for `stats`."""
        start = time.monotonic()
        with self._model_lock:
            batches(slots, self.policy_version)
        end = time.monotonic()
        self.transport.ring(slots)  # first: the workers wait for it, the figures do not
        waits = [(start - at) * 1000.0 for at in submitted_at if at]
        self._record_batch_stats(batch_size=len(slots), queue_wait_ms=waits, forward_ms=(end - start) * 1000.0)

    def _run(self) -> None:
        device = self.policy_device
        if device is None or torch.device(device).type != "cuda":
            return super()._run()
        # High priority: on a GPU shared with the learner, the scheduler starts the pass's blocks first.
        self.stream = torch.cuda.Stream(device, priority=-1)
        with torch.cuda.stream(self.stream):
            return super()._run()


class _Acting(nn.Module):
    """The served callable: the acting policy under a fixed exploration type, answering only `policy`.

    The exploration type is set here, in the server's thread: a worker's context does not cross the
    process boundary.
    """

    def __init__(self, policy: ActingPolicy, explore: bool):
        super().__init__()
        self.policy = policy
        self.exploration = ExplorationType.RANDOM if explore else ExplorationType.DETERMINISTIC

    def forward(self, batch: TensorDictBase) -> TensorDictBase:
        with set_exploration_type(self.exploration):
            return self.policy(batch).select("policy")


class WeightSync:
    """Copies the learner's policy weights into the served copy without the learner waiting.

    `__call__` copies the weights into a staging buffer on the inference device: on CUDA it enqueues
    the copies on the learner's current stream, after the update that produced the weights, and
    records an event. A thread waits on that event (never on later learner work) and then runs
    `apply`, which moves staging into the served weights between two inference passes (under the
    server's model lock in this process, or in the server's process). A sync requested while the
    previous one is still in flight is skipped (counted in `skipped`): staging is never overwritten
    while it is read.

    `check()` runs first on each call and raises CollectionError when the server has stopped; a
    CollectionError of `apply` (the server died during the sync) is raised as it is by the next call.
    """

    def __init__(self, source: list[torch.Tensor], staging: list[torch.Tensor], apply, check=None):
        self.source, self.staging, self.apply, self.check = source, staging, apply, check
        self.applied = self.skipped = 0
        self.error: BaseException | None = None
        self.idle = threading.Event()
        self.idle.set()
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._apply_loop, daemon=True, name="dreamer-weight-sync")
        self.thread.start()

    def __call__(self) -> bool:
        """Starts one sync; False when it was skipped because the previous one is still in flight."""
        if self.check is not None:
            self.check()
        if isinstance(self.error, CollectionError):
            raise self.error
        if self.error is not None:
            raise RuntimeError(f"weight sync failed: {self.error}") from self.error
        if not self.idle.is_set():
            self.skipped += 1
            return False
        self.idle.clear()
        with torch.no_grad():
            for staged, weight in zip(self.staging, self.source):
                staged.copy_(weight, non_blocking=True)
        event = None
        if self.source[0].is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.source[0].device))
        self.requests.put(event)
        return True

    def wait(self, timeout: float = 60.0) -> bool:
        """Until the sync in flight (if any) has been applied; False on timeout."""
        return self.idle.wait(timeout)

    def _apply_loop(self) -> None:
        while True:
            event = self.requests.get()
            if event is False:
                return
            try:
                if event is not None:
                    event.synchronize()
                self.apply()
                self.applied += 1
            except BaseException as error:  # reported to the trainer on its next sync
                self.error = error
            finally:
                self.idle.set()

    def close(self) -> None:
        self.requests.put(False)
        self.thread.join(timeout=5)


def _copy_into(server: InferenceServer, target: list[torch.Tensor], staging: list[torch.Tensor]) -> None:
    """staging -> served weights under the server's model lock, complete before the lock opens.

    The copy runs on the serving stream, never on the calling thread's current stream: in the trainer's
    process that is the learner's, and waiting for it would hold the model lock, and with it every
    inference pass, until the learner's queued update had ended (the first pipeline run on one H200,
    which copied there, measured a p99 of 132 ms, about one update).
    Staging is complete when this runs (the caller waited for its event).
    """

    def copy(_model: nn.Module) -> None:
        if not target[0].is_cuda:
            with torch.no_grad():
                torch._foreach_copy_(target, staging)
            return
        # After the last pass on the serving stream; a private stream before the server's first pass.
        stream = getattr(server, "stream", None) or torch.cuda.Stream(target[0].device)
        with torch.cuda.stream(stream), torch.no_grad():
            torch._foreach_copy_(target, staging)
        stream.synchronize()

    server.update_model(copy)


def _make_server(policy: ActingPolicy, transport, clients: int, device: torch.device, cudagraph: bool,
                 explore: bool, batch_wait: float, request: TensorDict) -> InferenceServer:
    static = clients if (device.type == "cuda" and cudagraph) else None
    # The server waits up to `batch_wait` s after the first request for the others, so one pass
    # serves the envs that finished their steps at about the same time. With no wait, a pass serves
    # the requests that are ready when it starts (the server sleeps on its work semaphore in between:
    # the 50 ms is only how often it looks at its stop flag).
    return _StreamServer(
        _Acting(policy, explore),
        transport,
        max_batch_size=clients,
        min_batch_size=clients if batch_wait > 0 else 1,
        static_batch_size=static,
        request_spec=request if static else None,
        timeout=batch_wait if batch_wait > 0 else 0.05,
        policy_device=device,
        output_device="cpu",
    )


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _serve(policy: ActingPolicy, transport, clients: int, device: torch.device, cudagraph: bool, explore: bool,
           batch_wait: float, request: TensorDict, staging: list[torch.Tensor], ready, done, conn, stop,
           trainer: int, threads: int = 1) -> None:
    """The server's own process: torchrl's server on `device`, weight syncs from staging, stats on request."""
    reaper.bind(trainer)  # first: it dies with the trainer, however that dies
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when to stop (it saves first)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # One intra-op thread by default (run.inference_threads): a pass's host work is a gather and a scatter
    # of a few rows (index_select, index_copy_), which torch splits across an OpenMP team of one thread per
    # core; beside 64 env workers a team member that the scheduler has not run holds the whole copy up.
    # On the 2-core development machine with two busy processes beside it, that gather and scatter of six
    # Minecraft rows took a p99 of 59.4 ms on two threads against 0.27 ms on one (BENCHMARKS.md).
    if threads > 0:
        torch.set_num_threads(threads)
    # TF32 products in this process, which runs the acting policy only: the size200m pass measured 1.03 ms
    # of GPU time at 64 rows against 1.67 in float32 (BENCHMARKS.md). The trainer's process keeps its own
    # precision, so a server in its thread (run.inference=thread) stays float32.
    torch.backends.cuda.matmul.allow_tf32 = True
    policy = policy.to(device).eval().requires_grad_(False)
    server = _make_server(policy, transport, clients, device, cudagraph, explore, batch_wait, request)
    server.start()
    target = _tensors(policy)

    def apply_loop() -> None:
        while not stop.is_set():
            if ready.acquire(True, 0.5):
                try:
                    _copy_into(server, target, staging)
                except BaseException as error:  # the trainer sees the process end and stops with a message
                    print(f"dreamer inference server: weight sync failed: {error!r}", file=sys.stderr, flush=True)
                    os._exit(1)
                done.release()

    applier = threading.Thread(target=apply_loop, daemon=True, name="dreamer-weight-apply")
    applier.start()
    conn.send("ready")
    while not stop.is_set() and server.is_alive and not reaper.trainer_gone():
        if conn.poll(0.5):
            conn.recv()
            with server._stats_lock:
                forward = list(server._forward_ms)
            conn.send(({**server.stats(), "threads": torch.get_num_threads()}, forward))
    server.shutdown()
    stop.set()
    applier.join(timeout=2)
    # Let go of the trainer's CUDA IPC staging tensors before exiting: a consumer that exits holding them
    # never tells the trainer (their producer), which then warns at its own exit that they were not released.
    staging.clear()
    gc.collect()


class Inference:
    """The server, its transport's worker clients (one per env stream) and the weight sync.

    `process=True` runs the server in a process of its own (spawned; the served copy of the weights
    and the staging buffer are shared with it, through CUDA IPC on a GPU), so its Python work never
    waits for the trainer's (the GIL), with `threads` intra-op threads (0: torch's default; see `_serve`);
    `False` runs it in a thread of this process.
    """

    def __init__(
        self,
        policy: ActingPolicy,
        layout: EnvLayout,
        size: ModelSize,
        clients: int,
        device: torch.device,
        cudagraph: bool = True,
        explore: bool = True,
        batch_wait: float = 0.002,
        process: bool = False,
        startup_timeout: float = 600.0,
        threads: int = 1,
    ):
        reaper.guard()  # before the transport makes the run's first semaphores
        self.device = torch.device(device)
        self._last_stats: tuple[int, float] | None = None  # (passes served, when): see stats
        request, response = request_spec(layout, size), response_spec(layout, size)
        self.transport = KillSafeSlotTransport(request, response, num_slots=clients)
        self.clients = [self.transport.client() for _ in range(clients)]
        self.process = None
        source = _tensors(policy)
        # The served copy: its own parameters (module docstring).
        served = copy.deepcopy(policy).requires_grad_(False)
        if not process:
            served = served.to(self.device).eval()
            self.server = _make_server(served, self.transport, clients, self.device, cudagraph, explore,
                                       batch_wait, request)
            target = _tensors(served)
            self.sync = WeightSync(source, [torch.empty_like(t) for t in target],
                                   lambda: _copy_into(self.server, target, self.sync.staging), self.check)
            return
        staging = [torch.empty_like(t, device=self.device) for t in _tensors(served)]
        if self.device.type == "cpu":
            staging = [t.share_memory_() for t in staging]
        context = multiprocessing.get_context("spawn")
        ready, done, self._stop = context.Semaphore(0), context.Semaphore(0), context.Event()
        self._conn, child = context.Pipe()
        self.process = context.Process(
            target=_serve, name="dreamer-inference", daemon=True,
            args=(served.cpu(), self.transport, clients, self.device, cudagraph, explore, batch_wait, request,
                  staging, ready, done, child, self._stop, os.getpid(), threads))
        self.startup_timeout = startup_timeout

        def apply() -> None:  # the server's process copies staging in between two passes
            ready.release()
            while not done.acquire(True, 1.0):
                self.check()

        self.sync = WeightSync(source, staging, apply, self.check)

    def start(self) -> Inference:
        if self.process is None:
            self.server.start()
            return self
        self.process.start()
        reaper.register(self.process.pid)
        deadline = time.monotonic() + self.startup_timeout
        while not self._conn.poll(1.0):
            if not self.process.is_alive() or time.monotonic() > deadline:
                break
        try:
            if self._conn.poll(0) and self._conn.recv() == "ready":
                return self
        except EOFError:  # it died before saying ready
            pass
        self.process.join(timeout=1)
        raise RuntimeError(f"the inference server process did not start (exit code {self.process.exitcode}; "
                           f"its error is printed above)" if not self.process.is_alive() else
                           f"the inference server process did not start within {self.startup_timeout:.0f} s")

    @property
    def alive(self) -> bool:
        return self.server.is_alive if self.process is None else self.process.is_alive()

    def check(self) -> None:
        """Raises CollectionError, one line, when the server has stopped."""
        if not self.alive:
            code = "" if self.process is None else f" (exit code {self.process.exitcode})"
            raise CollectionError(f"the inference server stopped{code}")

    def snapshot(self, timeout: float = 60.0) -> tuple[dict, list[float]]:
        """torchrl's server statistics and the durations of the recent passes (ms, from the gather of
        the requests to their answers in the slots).

        Raises CollectionError when the server has stopped, or gives no answer within `timeout` s.
        """
        self.check()
        if self.process is None:
            with self.server._stats_lock:
                forward = list(self.server._forward_ms)
            return self.server.stats(), forward
        deadline = time.monotonic() + timeout
        try:
            self._conn.send("stats")
            while not self._conn.poll(0.5):
                self.check()
                if time.monotonic() > deadline:
                    raise CollectionError(f"the inference server gave no answer in {timeout:.0f} s")
            return self._conn.recv()
        except (OSError, EOFError):  # its end of the pipe closed: it is ending
            self.process.join(timeout=5)
            self.check()
            raise CollectionError("the inference server closed its connection") from None

    def stats(self) -> dict[str, float]:
        """The server's figures for a metrics record. busy: the fraction of the time since the previous
        call spent in passes (passes served since then x the mean of the recent passes' durations)."""
        stats, forward = self.snapshot()
        now = time.monotonic()
        since, self._last_stats = self._last_stats, (stats["batches"], now)
        rate = (stats["batches"] - since[0]) / max(now - since[1], 1e-9) if since else stats["batches_per_s"]
        return {
            "inference/batch": stats["avg_batch_size"],
            "inference/batches_per_s": rate,
            "inference/p50_ms": percentile(forward, 0.5) if forward else 0.0,
            "inference/p99_ms": percentile(forward, 0.99) if forward else 0.0,
            "inference/queue_ms": stats["p50_queue_ms"],
            "inference/busy": rate * (sum(forward) / len(forward) / 1e3 if forward else 0.0),
            "inference/weight_syncs": self.sync.applied,
        }

    def forget_slot(self, slot: int) -> None:
        """Before a replacement worker takes slot `slot`: let a request of the dead one finish first.

        The dead worker may have left a request in its slot; the server answers it within a pass. The
        replacement starts once the slot is no longer marked ready and that pass has had time to ring,
        with the ring cleared, so it never takes an answer meant for its predecessor.
        """
        for _ in range(500):
            if not self.transport._request_ready[slot]:
                break
            time.sleep(0.01)
        time.sleep(0.1)
        self.transport._response_events[slot].clear()

    def close(self) -> None:
        self.sync.close()
        if self.process is None:
            self.server.shutdown()
            return
        self._stop.set()
        if self.process.pid is not None:
            self.process.join(timeout=5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
