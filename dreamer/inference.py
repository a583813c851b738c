"""The batched inference server: the acting policy on the inference device, serving env worker processes.

Workers send one record each (the carry the policy had before o[t], and o[t] under `next`, the layout of
`dreamer.collect`) through torchrl's process-slot transport: every worker owns a fixed shared-memory
slot, and only a wake-up signal crosses processes. torchrl's `InferenceServer` runs in a thread of the
trainer process on the inference device and answers a whole sweep of ready slots with one batched pass;
on CUDA that pass is a CUDA graph of a static batch of `run.envs` rows, run on a stream of its own.

The server acts with its own copy of the policy's weights: the learner updates its weights in place,
inside a CUDA graph, while the server reads its copy. `WeightSync` refreshes the copy every
`run.sync_every` updates without making the learner wait (see its docstring).
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import queue
import threading
import time

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torchrl.envs import ExplorationType, set_exploration_type
from torchrl.modules.inference_server import InferenceServer, ProcessSlotTransport
from torchrl.modules.inference_server._process_slot import _ProcessSlotClient

from dreamer.agent import IMAGE_KEY, ActingPolicy, EnvLayout, ModelSize

def request_spec(layout: EnvLayout, size: ModelSize) -> TensorDict:
    """One worker's request: a replay record without batch dimensions (zeros)."""
    observation = {key: torch.zeros(width) for key, width in zip(layout.vector_keys, layout.vector_sizes)}
    if layout.image_shape is not None:
        observation[IMAGE_KEY] = torch.zeros(layout.image_shape, dtype=torch.uint8)
    return TensorDict(
        state=torch.zeros(size.latent),
        belief=torch.zeros(size.deter),
        action=torch.zeros(layout.action_dim),
        is_init=torch.ones(1, dtype=torch.bool),
        next=TensorDict(
            **observation,
            reward=torch.zeros(1),
            done=torch.zeros(1, dtype=torch.bool),
            terminated=torch.zeros(1, dtype=torch.bool),
        ),
    )


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
            if not self.rung and os.getppid() == 1:  # the trainer is gone: no answer will come
                raise SystemExit(0)
        return self.rung

    def clear(self) -> None:
        """Forgets a taken ring and any ring left over (an answer meant for a dead predecessor)."""
        self.rung = False
        while self.semaphore.acquire(False):
            pass


class _NoLock:
    """Stands in for the transport's shared request lock on the worker side (see KillSafeSlotTransport)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class KillSafeSlotTransport(ProcessSlotTransport):
    """torchrl's process-slot transport with nothing a killed worker can leave locked.

    - Answers ring a `_Doorbell` (a semaphore) instead of an Event.
    - Workers publish a request without the shared request lock: they write the payload, then the
      slot's ready byte, then release the server's work semaphore. The semaphore release orders those
      writes, and x86 keeps stores in order for the server's timed sweeps, which only read. Only the
      server takes the lock. A worker killed inside the lock would otherwise stop every other worker.
    - Workers get no server-liveness Event (reading one takes its lock too); the server is a thread of
      the trainer, and a worker whose trainer is gone exits instead of waiting (`_Doorbell.wait`).
    """

    def __init__(self, request_spec, response_spec, *, num_slots: int):
        context = multiprocessing.get_context("spawn")
        super().__init__(request_spec, response_spec, num_slots=num_slots, ctx=context)
        self._response_events = [_Doorbell(context) for _ in range(num_slots)]

    def client(self) -> _ProcessSlotClient:
        slot = self._next_client_slot
        if slot >= self._num_slots:
            raise RuntimeError(f"all {self._num_slots} slots have clients")
        self._next_client_slot += 1
        return _ProcessSlotClient(
            slot_id=slot, request_slots=self._request_slots, response_slots=self._response_slots,
            request_keys=self._request_keys, request_ready=self._request_ready, request_lock=_NoLock(),
            submitted_at=self._submitted_at, response_status=self._response_status,
            response_event=self._response_events[slot], exception_queue=self._exception_queues[slot],
            work_semaphore=self._work_semaphore, peer_alive=None, copy_result=self._copy_result,
        )


class _StreamServer(InferenceServer):
    """torchrl's server, its serving thread on a CUDA stream of its own.

    A thread's current stream is the device's default stream, which the learner uses: on a shared GPU
    every inference pass would queue behind the learner's update. torch's streams do not synchronize
    with the default one, so the two overlap.
    """

    def _run(self) -> None:
        device = self.policy_device
        if device is None or torch.device(device).type != "cuda":
            return super()._run()
        self.stream = torch.cuda.Stream(device)
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
    """Copies the learner's policy weights into the server's copy without the learner waiting.

    On CUDA, `__call__` enqueues device-to-device copies into a staging buffer on the learner's current
    stream, after the update that produced the weights, and records an event; a thread waits on that
    event (never on later learner work) and copies staging into the served weights under the server's
    model lock, between two batches. A sync requested while the previous one is still being applied
    is skipped (counted in `skipped`): the staging buffer is never overwritten while it is read. On
    CPU the copy is made at once under the lock.
    """

    def __init__(self, source: list[torch.Tensor], target: list[torch.Tensor], server: InferenceServer):
        self.source, self.target, self.server = source, target, server
        self.applied = self.skipped = 0
        self.error: BaseException | None = None
        self.cuda = any(t.is_cuda for t in source + target)
        if self.cuda:
            self.staging = [torch.empty_like(t) for t in target]
            self.idle = threading.Event()
            self.idle.set()
            self.requests: queue.SimpleQueue = queue.SimpleQueue()
            self.thread = threading.Thread(target=self._apply_loop, daemon=True, name="dreamer-weight-sync")
            self.thread.start()

    def __call__(self) -> bool:
        """Starts one sync; False when it was skipped because the previous one is still in flight."""
        if self.error is not None:
            raise RuntimeError(f"weight sync failed: {self.error}") from self.error
        if not self.cuda:
            with torch.no_grad():
                self.server.update_model(lambda _: torch._foreach_copy_(self.target, self.source))
            self.applied += 1
            return True
        if not self.idle.is_set():
            self.skipped += 1
            return False
        self.idle.clear()
        with torch.no_grad():
            for staged, weight in zip(self.staging, self.source):
                staged.copy_(weight, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.source[0].device))
        self.requests.put(event)
        return True

    def _apply(self, _model: nn.Module) -> None:
        # Under the model lock no pass is enqueued, but the last one may still run on the GPU: the copy
        # waits for the server's stream, and is complete before the lock opens for the next pass.
        stream = torch.cuda.current_stream(self.target[0].device)
        if getattr(self.server, "stream", None) is not None:
            stream.wait_stream(self.server.stream)
        with torch.no_grad():
            torch._foreach_copy_(self.target, self.staging)
        stream.synchronize()

    def _apply_loop(self) -> None:
        while True:
            event = self.requests.get()
            if event is None:
                return
            try:
                event.synchronize()
                self.server.update_model(self._apply)
                self.applied += 1
            except BaseException as error:  # reported to the trainer on its next sync
                self.error = error
            finally:
                self.idle.set()

    def close(self) -> None:
        if self.cuda:
            self.requests.put(None)
            self.thread.join(timeout=5)


class Inference:
    """The server, its transport's worker clients (one per env stream) and the weight sync."""

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
    ):
        self.device = torch.device(device)
        # The served copy: its own parameters on the inference device (module docstring).
        served = copy.deepcopy(policy).to(self.device).eval().requires_grad_(False)
        request, response = request_spec(layout, size), response_spec(layout, size)
        self.transport = KillSafeSlotTransport(request, response, num_slots=clients)
        self.clients = [self.transport.client() for _ in range(clients)]
        static = clients if (self.device.type == "cuda" and cudagraph) else None
        # The server waits up to `batch_wait` s after the first request for the others, so one pass
        # serves the envs that finished their steps at about the same time.
        self.server = _StreamServer(
            _Acting(served, explore),
            self.transport,
            max_batch_size=clients,
            min_batch_size=clients,
            static_batch_size=static,
            request_spec=request if static else None,
            timeout=batch_wait,
            policy_device=self.device,
            output_device="cpu",
        )
        source = [p for p in policy.parameters()] + [b for b in policy.buffers()]
        target = [p for p in served.parameters()] + [b for b in served.buffers()]
        self.sync = WeightSync(source, target, self.server)

    def start(self) -> Inference:
        self.server.start()
        return self

    @property
    def alive(self) -> bool:
        return self.server.is_alive

    def forward_ms(self) -> list[float]:
        """The durations of the recent batched passes (ms), for percentiles."""
        with self.server._stats_lock:
            return list(self.server._forward_ms)

    def stats(self) -> dict[str, float]:
        stats = self.server.stats()
        return {
            "inference/batch": stats["avg_batch_size"],
            "inference/batches_per_s": stats["batches_per_s"],
            "inference/p50_ms": stats["p50_forward_ms"],
            "inference/p95_ms": stats["p95_forward_ms"],
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
        self.server.shutdown()
