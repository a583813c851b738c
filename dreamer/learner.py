"""The learner: one DreamerV3 update as a single step, compiled and captured as one CUDA graph on a GPU.

One `update(batch)` = world-model loss (RSSM scan over the sequence, KL, reconstruction, reward and
continue heads), imagination from every posterior state, actor (REINFORCE + entropy) and critic losses,
replay value loss, backward, the LaProp-order optimizer step with adaptive gradient clipping, and the
soft update of the slow critic. The losses (`dreamer.losses.Losses`, which also holds the slow critic and
the return normalizer) are those of torchrl's DreamerV3Loss, term for term and with the same random draws in
the same order (tests/test_learner.py checks losses and gradients against it, built on the same parameters
by `dreamer.agent.torchrl_loss`); the step is ours because torchrl's stepper leaves too much on the table
on a GPU:

- tensors only in the hot path (no TensorDict), so compiled regions trace in seconds, not minutes;
- whatever does not depend on the recurrence leaves the scan: the action and observation projections run
  once on the whole [B, T] batch, the prior head and every decoder after the scan; imagination runs
  without autograd (its gradients are not used: the actor is trained by REINFORCE on stopped states),
  except under loss.actor_grad=backprop, where the actor's gradient goes through it (dreamer.losses);
- inside the scan the weights are cast to bf16 once per update and their gradients come from "taps"
  (zeros added to each output, whose gradient is the stacked output gradient of all steps): one matmul
  per weight over all B x T rows instead of T small ones and T - 1 accumulations;
- the scan's outputs cost no eager work between two steps of its backward: each step hands the loss tail
  copies of its outputs (one consumer per output) and the tail works time-major, so each step's gradient
  arrives as one contiguous block (see `dreamer.scan.Scan.cell_fn` and `dreamer.losses.Losses`);
- the encoder stage, the RSSM cell, the imagination step and the loss tail are compiled separately
  (`torch.compile`, fixed shapes); the random draws stay outside them so compiled and eager agree; the
  optimizer's multi-tensor (foreach) ops run as they are;
- the whole update, optimizer and slow critic included, is captured as one CUDA graph over static
  buffers: no host synchronization inside; metrics are summed on the device and read through a pinned
  buffer behind an event once per log period (`read_metrics`), without waiting for queued updates.

On CPU the same code runs eagerly.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable

import torch
from tensordict import TensorDict, TensorDictBase

from dreamer.agent import (IMAGE_KEY, Agent, EnvLayout, LossSettings, output_groups, record_zeros,
                           torchrl_loss)
from dreamer.losses import Losses
from dreamer.optim import LaProp, OptimizerSettings
from dreamer.scan import Scan

METRICS = (
    "loss_model_reco", "loss_model_reward", "loss_model_dynamic", "loss_model_representation",
    "loss_model_continue", "loss_actor", "loss_value", "loss_replay_value",
    "actor_entropy", "return_low", "return_high", "return_scale", "continuation_mean", "value_slow_loss",
    "replay_value", "reward_seen", "reward_real", "reward_imagined", "grad_norm", "agc_clipped", "agc_actor",
)


def batch_inputs(batch: TensorDictBase, layout: EnvLayout) -> dict[str, torch.Tensor]:
    """The tensors of one [B, T] replay batch that the update reads, by name."""
    nxt = batch.get("next")
    shape = batch.batch_size
    inputs = {
        "state": batch.get("state")[:, 0].contiguous(),
        "belief": batch.get("belief")[:, 0].contiguous(),
        "action": batch.get("action").float(),
        "is_init": batch.get("is_init").reshape(*shape, 1),
        "reward": nxt.get("reward").reshape(*shape, 1).float(),
        "done": nxt.get("done").reshape(*shape, 1),
        "terminated": nxt.get("terminated").reshape(*shape, 1),
    }
    for key in layout.vector_keys:
        inputs[key] = nxt.get(key)
    if layout.image_shape is not None:
        inputs[IMAGE_KEY] = nxt.get(IMAGE_KEY)
    return inputs


class MetricsRead:
    """Device metrics on their way to pinned host memory: `ready()` never blocks, `result()` waits."""

    def __init__(self, pinned: torch.Tensor, event: torch.cuda.Event | None):
        self.pinned, self.event = pinned, event

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def result(self) -> dict[str, float]:
        if self.event is not None:
            self.event.synchronize()  # only the updates queued before the read, not the whole device
        count = float(self.pinned[-1])
        if not count:
            return {}
        return {f"train/{k}": float(v) / count for k, v in zip(METRICS, self.pinned[:-1].tolist())}


class _MetricSums:
    """The update's metrics summed on the device (no host synchronization in the step), read by period."""

    def __init__(self, device: torch.device):
        self.device = device
        self.sums = torch.zeros(len(METRICS), device=device)
        self.count = torch.zeros((), device=device)

    def add(self, metrics: dict) -> None:
        values = torch.stack([torch.as_tensor(metrics[k], dtype=torch.float32, device=self.device).reshape(())
                              for k in METRICS]).detach()
        self.sums += values
        self.count += 1

    def read(self) -> MetricsRead:
        """Starts reading the sums since the last read: a copy to pinned memory behind an event on the
        current stream, so the caller need not wait for the updates still queued."""
        cuda = self.device.type == "cuda"
        pinned = torch.empty(len(METRICS) + 1, pin_memory=cuda)
        pinned[: len(METRICS)].copy_(self.sums, non_blocking=True)
        pinned[len(METRICS)].copy_(self.count, non_blocking=True)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self.sums.zero_()
        self.count.zero_()
        return MetricsRead(pinned, event)


class _BusyTime:
    """Seconds spent in updates: CUDA events around each update on a GPU (counted once they have ended,
    never waited for), the calls' host time on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: deque = deque()  # events around updates whose time is not yet counted
        self.busy = 0.0  # counted seconds not yet returned by take()
        self.started: float | tuple = 0.0

    def start(self) -> None:
        if self.cuda:
            self.started = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.started[0].record()
        else:
            self.started = time.perf_counter()

    def stop(self) -> None:
        if not self.cuda:
            self.busy += time.perf_counter() - self.started
            return
        self.started[1].record()
        self.spans.append(self.started)
        if len(self.spans) > 64:  # a long time between reads: count the ended ones now
            self._count_ended()

    def take(self) -> float:
        self._count_ended()
        seconds, self.busy = self.busy, 0.0
        return seconds

    def _count_ended(self) -> None:
        while self.spans and self.spans[0][1].query():
            start, end = self.spans.popleft()
            self.busy += start.elapsed_time(end) / 1e3


@contextlib.contextmanager
def _undone(tensors: list[torch.Tensor], device: torch.device):
    """Puts `tensors` and torch's random generators back as they were when the block ends."""
    saved = [(t, t.detach().clone()) for t in tensors]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, value in saved:
                tensor.copy_(value)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


class _Compiled:
    """A function that is compiled once its learner asks for it (`torch.compile`, fixed shapes).

    The host time of the first compiled call (compilation, mostly) is kept in `compile_seconds` and
    reported through `progress`, so a slow warm-up says which piece it spends its time in.
    """

    def __init__(self, fn, progress=None, name: str | None = None, options: dict | None = None):
        self.fn, self.options = fn, options
        self.name = name or fn.__name__.strip("_")
        self.compiled = None
        self.compile_seconds: float | None = None
        self.progress = progress

    def enable(self) -> None:
        self.compiled = torch.compile(self.fn, dynamic=False, options=self.options)

    def __call__(self, *args):
        if self.compiled is None:
            return self.fn(*args)
        if self.compile_seconds is not None:
            return self.compiled(*args)
        start = time.perf_counter()
        out = self.compiled(*args)
        self.compile_seconds = time.perf_counter() - start
        if self.progress is not None:
            self.progress(f"compiled {self.name} in {self.compile_seconds:.1f} s")
        return out


# fuse_kernels: inductor also puts independent kernels of a compiled piece side by side in one launch (combo
# kernels; e.g. a scan step's norms) and fuses nodes that share no memory access. size1m on an H100: 3,142
# kernels and 7.69 ms per update against 3,869 and 8.75 (BENCHMARKS.md).
FUSED_KERNELS = {"combo_kernels": True, "aggressive_fusion": True}


def _to_channels_last(nets) -> None:
    """The image CNNs' weights in NHWC: convolutions then take and give channels-last maps (no NCHW-NHWC
    transposes around cuDNN's kernels), and the channel RMS norm, which normalizes over C of a channels-moved
    view, reads contiguous rows. Same values, other strides. At size200m it made no difference (280.3 against
    279.9 ms on an H100, BENCHMARKS.md): inductor already lays the compiled pieces' convolutions out NHWC."""
    for cnn in (getattr(nets.encoder, "cnn", None), getattr(nets.image_decoder, "net", None)):
        if cnn is not None:
            cnn.to(memory_format=torch.channels_last)


class Learner:
    """One DreamerV3 update per `update(batch)` (module docstring): the agent's networks, their optimizer
    (`optimizer` settings) and `Losses` (`loss` settings, the slow critic and the return normalizer)."""

    FORMAT = 2  # of state_dict(); 1 (the first) saved torchrl's DreamerV3Loss state dict under "loss"

    def __init__(
        self,
        agent: Agent,
        loss: LossSettings,
        optimizer: OptimizerSettings,
        device: torch.device,
        compile: bool = False,
        cudagraph: bool = False,
        bf16: bool = False,
        progress: Callable[[str], None] | None = None,
        channels_last: bool = False, fuse_kernels: bool = False, state_bf16: bool = False,
    ):
        self.agent = agent
        self.device = torch.device(device)
        self.progress = progress  # one line per warm-up milestone (compiled pieces, capture)
        if cudagraph and self.device.type != "cuda":
            raise ValueError("a CUDA graph needs a CUDA learner device")
        self.compile, self.cudagraph, self.bf16 = compile, cudagraph, bf16 and self.device.type == "cuda"
        nets = self.nets = agent.networks
        self.layout, self.size, self.settings = agent.layout, agent.size, loss
        if channels_last:
            _to_channels_last(nets)
        self.params = list(nets.trained.parameters())
        self.optimizer = LaProp(self.params, optimizer,
                                *output_groups(nets, self.layout, self.params, optimizer.agc_per_output))
        self.losses = Losses(nets, self.layout, self.size, loss, self.device)
        self.scan = Scan(nets, self.layout, self.size, self.device, loss.actor_grad == "backprop", state_bf16)
        fused = FUSED_KERNELS if fuse_kernels else None
        self._embed = _Compiled(self.scan.embed_fn, self._report, options=fused)
        self._cell = _Compiled(self.scan.cell_fn, self._report, options=fused)
        self._imagine = _Compiled(self.scan.imagine_fn, self._report, options=fused)
        self._tail = _Compiled(self.losses, self._report, name="losses", options=fused)
        self.needs_warmup = compile or cudagraph
        self.updates = 0
        self._busy = _BusyTime(self.device)
        self._metrics = _MetricSums(self.device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static: dict[str, torch.Tensor] = {}
        self._outputs: tuple[torch.Tensor, torch.Tensor] | None = None

    def _inputs(self, batch: TensorDictBase) -> dict[str, torch.Tensor]:
        return batch_inputs(batch, self.layout)

    # ---- the update ------------------------------------------------------------------------------

    def _optimize(self, grads):
        # Eager inside the graph: each foreach op a few multi-tensor kernels, but for adaptive clipping's
        # per-tensor factors (LaProp.step); compiled, it is bench_learner's ours_copt (not measured yet).
        grad_norm = self.optimizer.step(grads)
        self.losses.update_slow_critic()
        return (grad_norm, *self.optimizer.clip_metrics())

    def _step(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One whole update on named input tensors; returns the posterior (state, belief) [B, T, ...]."""
        total, metrics, states, beliefs, scan = self._losses(inputs)
        grads = self._gradients(total, scan)
        metrics["grad_norm"], metrics["agc_clipped"], metrics["agc_actor"] = self._optimize(grads)
        self._metrics.add(metrics)
        return (states.detach().to(torch.float32, memory_format=torch.contiguous_format),
                beliefs.detach().to(torch.float32, memory_format=torch.contiguous_format))

    def _gradients(self, total: torch.Tensor, scan: tuple[list, list]) -> list[torch.Tensor | None]:
        """d total / d params, aligned with self.params: autograd for everything, plus the scan's taps."""
        taps, records = scan
        grads = torch.autograd.grad(total, [*self.params, *taps], allow_unused=True)
        by_param = dict(zip(self.params, grads[: len(self.params)]))
        for param, grad in self.scan.weight_grads(grads[len(self.params):], records).items():
            current = by_param[param]
            if grad.shape != param.shape:  # the posterior's first layer: only its belief columns are tapped
                current = torch.zeros_like(param) if current is None else current.clone()
                current[:, : grad.shape[1]] += grad
                grad = current
            elif current is not None:
                grad = grad + current
            by_param[param] = grad
        return [by_param[p] for p in self.params]

    def _losses(self, inputs: dict[str, torch.Tensor]):
        """The forward pass: (total loss, metrics, posterior states, posterior beliefs, (taps, records))."""
        batch, length = inputs["action"].shape[:2]
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            dtype = torch.bfloat16 if self.bf16 else torch.float32
            weights = self.scan.weights(dtype)
            # Everything that does not depend on the recurrence runs once on the whole batch.
            observations = [inputs[k] for k in self.layout.vector_keys]
            if self.layout.image_shape is not None:
                observations.append(inputs[IMAGE_KEY])
            reset = inputs["is_init"]
            embed_part, action_features = self._embed(observations, inputs["action"], reset)
            uniforms = torch.rand(length, 2, batch, self.size.stoch, device=self.device)
            widths = [width for _, _, _, width in self.scan.specs]  # all taps in one zero buffer: one fill
            taps = torch.zeros(length, batch, sum(widths), dtype=dtype, device=self.device,
                               requires_grad=True).split(widths, -1)
            tap_steps = [tap.unbind(0) for tap in taps]
            state, belief = inputs["state"], inputs["belief"]
            if self.compile:  # a carry that always requires grad: one compiled variant of the cell, not two
                state, belief = state.detach().requires_grad_(), belief.detach().requires_grad_()
            # unbind, not [:, t]: the backward of one unbind stacks the step gradients once, where T slices
            # would each materialize and add a full-size zero gradient.
            action_steps, embed_steps, reset_steps = action_features.unbind(1), embed_part.unbind(1), reset.unbind(1)
            beliefs, logits, states, records = [], [], [], []
            for t in range(length):
                belief, logit, state, inputs_t, belief_out, state_out = self._cell(
                    state, belief, action_steps[t], embed_steps[t], reset_steps[t], uniforms[t, 1], weights,
                    [steps[t] for steps in tap_steps])
                beliefs.append(belief_out), logits.append(logit), states.append(state_out), records.append(inputs_t)
            # Time-major [T, B, ...]: the loss tail's gradients come back in this order (see Losses.__call__).
            beliefs, states, post_logits = torch.stack(beliefs), torch.stack(states), torch.stack(logits)
            records = [torch.stack(column) for column in zip(*records)]

            # Imagination from every posterior state, rows in (b, t) order; autograd only for actor_grad=backprop.
            with torch.set_grad_enabled(self.settings.actor_grad == "backprop"):
                s = states.detach().transpose(0, 1).reshape(-1, states.shape[-1])
                b = beliefs.detach().transpose(0, 1).reshape(-1, beliefs.shape[-1])
                img_s, img_b, img_a = [s], [b], []
                for _ in range(self.settings.imag_length):
                    noise = self.scan.imagination_noise(s.shape[0])  # the draws in torchrl's order: action, prior
                    uniform = torch.rand(s.shape[0], self.size.stoch, device=self.device)
                    s, b, a = self._imagine(s, b, noise, uniform, weights)
                    img_s.append(s), img_b.append(b), img_a.append(a)
                img_s, img_b, img_a = torch.stack(img_s, 1), torch.stack(img_b, 1), torch.stack(img_a, 1)

            targets = {k: v for k, v in inputs.items() if k not in ("state", "belief", "action", "is_init")}
            total, metrics = self._tail(targets, states, beliefs, post_logits, img_s, img_b, img_a)
        return total, metrics, states.transpose(0, 1), beliefs.transpose(0, 1), (taps, records)

    # ---- public API ------------------------------------------------------------------------------

    def synthetic_batch(self, batch_size: int, length: int) -> TensorDict:
        """A batch with the shapes and dtypes of a replay sample, for warming up before collection."""
        batch = record_zeros(self.layout, self.size, (batch_size, length))
        batch["is_init"][:, 0] = True
        batch["action"][..., 0] = 1
        return batch.to(self.device)

    def _report(self, line: str) -> None:
        if self.progress is not None:
            self.progress(line)

    def warmup(self, batch: TensorDictBase) -> float:
        """Compiles and captures the step on `batch` (its shapes only matter); returns the seconds taken.

        The warm-up updates are undone: parameters, optimizer state, slow critic, return normalization
        and the random generators are restored afterwards.
        """
        if not self.needs_warmup:
            return 0.0
        start = time.perf_counter()
        with self.undone():
            if self.compile:
                for piece in (self._embed, self._cell, self._imagine, self._tail):
                    piece.enable()
            inputs = {k: v.to(self.device, non_blocking=True).clone() for k, v in self._inputs(batch).items()}
            if self.cudagraph:
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(3):
                        self._step(inputs)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                torch.cuda.synchronize(self.device)
                self._report(f"3 warm-up updates done at {time.perf_counter() - start:.1f} s")
                self._graph = torch.cuda.CUDAGraph()
                # A capture stream of its own: cuBLAS's workspace is chosen per stream at capture and baked
                # into the graph; two graphs captured on torch's shared default capture stream share it and,
                # replayed side by side (this step and the inference server's pass), can hang the GPU.
                with torch.cuda.graph(self._graph, stream=torch.cuda.Stream(self.device)):
                    self._outputs = self._step(inputs)
                self._static = inputs
                self._report(f"captured the CUDA graph at {time.perf_counter() - start:.1f} s")
            else:
                self._step(inputs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.needs_warmup = False
        return time.perf_counter() - start

    def undone(self):
        """A context whose updates leave no trace: weights, optimizer, slow critic, return normalizer,
        metric sums and torch's random generators are put back when it ends."""
        return _undone([*self.params, *self.optimizer.rms, *self.optimizer.momentum, self.optimizer.step_count,
                        *self.losses.state_tensors(), self._metrics.sums, self._metrics.count], self.device)

    def update(self, batch: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
        """One update on batch [B, T]; returns the refreshed posterior, (state [B, T, latent], belief
        [B, T, deter]), on the learner's device (replay's write-back takes it).

        With a CUDA graph these are the graph's outputs: valid until the next update.
        """
        if self.needs_warmup:
            raise RuntimeError("call warmup(batch) before the first update when compiling or capturing")
        self._busy.start()
        if self._graph is not None:
            for key, value in self._inputs(batch).items():
                self._static[key].copy_(value, non_blocking=True)
            self._graph.replay()
            state, belief = self._outputs
        else:
            state, belief = self._step({k: v.to(self.device) for k, v in self._inputs(batch).items()})
        self._busy.stop()
        self.updates += 1
        return state, belief

    def busy_seconds(self) -> float:
        """Device seconds spent in updates since the last call, counting the updates that have ended on
        the device (the others count at a later call); never waits. On CPU: the update calls' time."""
        return self._busy.take()

    def read_metrics(self) -> MetricsRead:
        """Starts reading the metrics summed since the last read (`MetricsRead`), without waiting for the
        updates still queued on the learner's stream."""
        return self._metrics.read()

    def drain(self) -> dict[str, float]:
        """Mean of each metric since the last read, waiting for it."""
        return self.read_metrics().result()

    def state_dict(self) -> dict:
        return {"format": self.FORMAT, "networks": self.nets.trained.state_dict(), **self.losses.state_dict(),
                "optimizer": self.optimizer.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        """In place (a captured graph keeps its tensors). Reads format 1 through torchrl's loss; ValueError
        (one line) for a state it cannot read."""
        version = state.get("format", 1 if "loss" in state else None)
        if version == 1:
            if "optimizer" not in state:
                raise ValueError("this checkpoint was written by an older learner (no 'optimizer' state); "
                                 "start a new run folder or pass run.resume=never")
            state = _from_format_1(self, state)
        elif version is None:
            raise ValueError("this checkpoint holds no learner state this dreamer knows (neither 'format' nor "
                             "'loss'); start a new run folder or pass run.resume=never")
        elif version != self.FORMAT:
            raise ValueError(f"this checkpoint's learner state is format {version}, not one this dreamer reads "
                             f"(1 or {self.FORMAT}); resume it with the dreamer that wrote it, or start a new "
                             "run folder")
        with torch.no_grad():
            self.nets.trained.load_state_dict(state["networks"])
        self.losses.load_state_dict(state)
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = int(state["updates"])


def _from_format_1(learner: Learner, state: dict) -> dict:
    """A format-1 learner state (torchrl's DreamerV3Loss state dict, the optimizer's moments in that module's
    parameter order) as format 2: torchrl's loss module, built on the learner's networks, loads it."""
    with torch.device(learner.device):
        oracle, _ = torchrl_loss(learner.agent, learner.settings)
    with torch.no_grad():
        oracle.load_state_dict(state["loss"])  # into the shared network parameters, and its own buffers
    order = {id(p): i for i, p in enumerate(p for p in oracle.parameters() if p.requires_grad)}
    if set(order) != {id(p) for p in learner.params}:
        raise ValueError("this format-1 checkpoint's parameters are not this model's; resume it with the "
                         "settings it was trained with")
    index = [order[id(p)] for p in learner.params]
    optimizer = state["optimizer"]
    slow = oracle.value_loss.target_value_model_params.flatten_keys(".")
    prefix = "module.0.module."  # the critic head inside torchrl's critic sequence
    return {
        "networks": learner.nets.trained.state_dict(),  # already loaded
        "slow_critic": {name[len(prefix):]: slow[name] for name in slow.keys() if name.startswith(prefix)},
        "return_norm": {"low": oracle.actor_loss.retnorm.low, "high": oracle.actor_loss.retnorm.high},
        "optimizer": {"rms": [optimizer["rms"][i] for i in index],
                      "momentum": [optimizer["momentum"][i] for i in index], "step": optimizer["step"]},
        "updates": state["updates"],
    }
