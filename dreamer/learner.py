"""The learner: one DreamerV3 update as a single step, compiled and captured as one CUDA graph on a GPU.

One `update(batch)` = world-model loss (RSSM scan over the sequence, KL, reconstruction, reward and
continue heads), imagination from every posterior state, actor (REINFORCE + entropy) and critic losses,
replay value loss, backward, the LaProp-order optimizer step with adaptive gradient clipping, and the
soft update of the slow critic. The losses are those of torchrl's DreamerV3Loss, term for term and with
the same random draws in the same order (tests/test_learner.py checks losses and gradients against it);
the step is ours because torchrl's stepper leaves too much on the table on a GPU:

- tensors only in the hot path (no TensorDict), so compiled regions trace in seconds, not minutes;
- whatever does not depend on the recurrence leaves the scan: the action and observation projections run
  once on the whole [B, T] batch, the prior head and every decoder after the scan; imagination runs
  without autograd (its gradients are not used: the actor is trained by REINFORCE on stopped states);
- inside the scan the weights are cast to bf16 once per update and their gradients come from "taps"
  (zeros added to each output, whose gradient is the stacked output gradient of all steps): one matmul
  per weight over all B x T rows instead of T small ones and T - 1 accumulations;
- the scan's outputs cost no eager work between two steps of its backward: each step hands the loss tail
  copies of its outputs (one consumer per output) and the tail works time-major, so each step's gradient
  arrives as one contiguous block (see `dreamer.scan.Scan.cell_fn` and `_tail_fn`);
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
from torchrl.objectives import symlog
from torchrl.objectives.dreamer_v3 import categorical_kl_terms

from dreamer.agent import IMAGE_KEY, Agent, record_zeros
from dreamer.losses import (
    TwoHot,
    actor_loss,
    continue_loss,
    critic_loss,
    discrete_log_prob_entropy,
    imagination_weights,
    normal_log_prob_entropy,
    replay_value_targets,
    return_scale,
    squared_error_loss,
)
from dreamer.optim import LaProp, OptimizerSettings
from dreamer.scan import Scan

METRICS = (
    "loss_model_reco", "loss_model_reward", "loss_model_dynamic", "loss_model_representation",
    "loss_model_continue", "loss_actor", "loss_value", "loss_replay_value",
    "actor_entropy", "return_low", "return_high", "return_scale", "continuation_mean", "value_slow_loss",
    "replay_value", "reward_seen", "reward_real", "reward_imagined", "grad_norm",
)


def _time_major(x: torch.Tensor) -> torch.Tensor:
    """A [B, T, ...] target in the order of the scan's time-major outputs [T, B, ...]."""
    return x.transpose(0, 1)


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


class _Compiled:
    """A function that is compiled once its learner asks for it (`torch.compile`, fixed shapes).

    The host time of the first compiled call (compilation, mostly) is kept in `compile_seconds` and
    reported through `progress`, so a slow warm-up says which piece it spends its time in.
    """

    def __init__(self, fn, progress=None):
        self.fn = fn
        self.compiled = None
        self.compile_seconds: float | None = None
        self.progress = progress

    def enable(self) -> None:
        self.compiled = torch.compile(self.fn, dynamic=False)

    def __call__(self, *args):
        if self.compiled is None:
            return self.fn(*args)
        if self.compile_seconds is not None:
            return self.compiled(*args)
        start = time.perf_counter()
        out = self.compiled(*args)
        self.compile_seconds = time.perf_counter() - start
        if self.progress is not None:
            self.progress(f"compiled {self.fn.__name__.strip('_')} in {self.compile_seconds:.1f} s")
        return out


class Learner:
    def __init__(
        self,
        agent: Agent,
        optimizer: OptimizerSettings,
        device: torch.device,
        compile: bool = False,
        cudagraph: bool = False,
        bf16: bool = False,
        progress: Callable[[str], None] | None = None,
        channels_last: bool = False,
    ):
        self.agent = agent
        self.device = torch.device(device)
        self.progress = progress  # one line per warm-up milestone (compiled pieces, capture)
        if cudagraph and self.device.type != "cuda":
            raise ValueError("a CUDA graph needs a CUDA learner device")
        self.compile, self.cudagraph, self.bf16 = compile, cudagraph, bf16 and self.device.type == "cuda"
        nets, loss = agent.networks, agent.loss
        self.nets, self.loss = nets, loss
        self.layout, self.size = agent.layout, agent.size
        if channels_last:
            # The image CNNs' weights in NHWC: convolutions then take and give channels-last maps (no
            # NCHW-NHWC transposes around cuDNN's kernels), and the channel RMS norm, which normalizes
            # over C of a channels-moved view, reads contiguous rows. Same values, other strides.
            for cnn in (getattr(nets.encoder, "cnn", None), getattr(nets.image_decoder, "net", None)):
                if cnn is not None:
                    cnn.to(memory_format=torch.channels_last)
        self.params = [p for p in loss.parameters() if p.requires_grad]
        self.optimizer = LaProp(self.params, optimizer)
        # The slow critic: the value loss's target parameters, by the critic head's own names.
        targets = loss.value_loss.target_value_model_params.flatten_keys(".")
        prefix = "module.0.module."
        self.critic_params = dict(nets.critic_head.named_parameters())
        self.slow_params = {name[len(prefix):]: targets[name] for name in targets.keys() if name.startswith(prefix)}
        if set(self.slow_params) != set(self.critic_params):
            raise RuntimeError("the slow critic's parameters do not match the critic head's")
        self.slow_list = [self.slow_params[n] for n in self.critic_params]
        self.critic_list = list(self.critic_params.values())
        self.tau = 1.0 - float(agent.slow_critic.eps)  # SoftUpdate: target <- lerp(target, source, 1 - eps)
        self.reward_twohot = TwoHot(loss.model_loss.reward_bins, agent.settings.two_hot)
        self.value_twohot = TwoHot(loss.value_loss.value_bins, agent.settings.two_hot)
        estimator = loss.actor_loss.value_estimator
        self.gamma = estimator.gamma.to(self.device)
        self.retnorm = loss.actor_loss.retnorm
        self.scan = Scan(nets, self.layout, self.size, self.device)
        self._embed = _Compiled(self.scan.embed_fn, self._report)
        self._cell = _Compiled(self.scan.cell_fn, self._report)
        self._imagine = _Compiled(self.scan.imagine_fn, self._report)
        self._tail = _Compiled(self._tail_fn, self._report)
        # The optimizer stays eager, inside the graph all the same: each foreach op is a few multi-tensor
        # kernels over every parameter, where inductor would emit kernels per parameter (and compile longer).
        self._optimize = self._optimize_fn
        self.needs_warmup = compile or cudagraph
        self.updates = 0
        self._spans: deque = deque()  # CUDA events around updates whose time is not yet in busy_seconds
        self._busy = 0.0  # update seconds counted, not yet returned by busy_seconds
        self._sums = torch.zeros(len(METRICS), device=self.device)
        self._count = torch.zeros((), device=self.device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static: dict[str, torch.Tensor] = {}
        self._outputs: tuple[torch.Tensor, torch.Tensor] | None = None

    # ---- inputs ----------------------------------------------------------------------------------

    def _inputs(self, batch: TensorDictBase) -> dict[str, torch.Tensor]:
        """The tensors of one [B, T] batch the step reads, by name."""
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
        for key in self.layout.vector_keys:
            inputs[key] = nxt.get(key)
        if self.layout.image_shape is not None:
            inputs[IMAGE_KEY] = nxt.get(IMAGE_KEY)
        return inputs

    # ---- the compiled pieces -----------------------------------------------------------------------

    # Tapped operations. Inside the scan every weight is a detached copy in the compute dtype (cast once
    # per update, not once per step), and a zero "tap" is added to each output; the gradient that reaches
    # a tap is the stacked output gradient dY of all steps, so each weight gradient is one matmul over all
    # B x T rows after the backward pass instead of T small ones plus T - 1 accumulations.

    def _critic(self, state, belief, slow: bool = False):
        if slow:
            return torch.func.functional_call(self.nets.critic_head, self.slow_params, (state, belief))
        return self.nets.critic_head(state, belief)

    def _tail_fn(self, inputs, states, beliefs, post_logits, img_states, img_beliefs, img_actions):
        """Every loss after the two recurrences, on whole tensors; returns (total, metrics).

        The posterior's states, beliefs and logits come time-major, [T, B, ...], and every loss that takes
        their gradient runs in that order (its targets transposed, its means unchanged): their gradients
        are then time-major too, so each scan step's share is a contiguous [B, ...] block, which the
        step's compiled backward takes as it is (a strided one it would first copy, at every step)."""
        losses, reward_logits, reward_target = self._model_losses(inputs, states, beliefs, post_logits)
        behaviour, lambda_target, metrics = self._behaviour_losses(img_states, img_beliefs, img_actions)
        losses.update(behaviour)
        replay_value = self._replay_value_loss(inputs, states, beliefs, lambda_target)
        losses["loss_replay_value"] = self.loss.replay_value_loss_weight * replay_value
        total = sum(losses.values())
        metrics = {
            **losses,
            **metrics,
            "replay_value": replay_value.detach(),
            # The model's rewards beside the real ones: on the replayed posterior (observations seen) and per
            # step of imagination (the actor's own actions, in `metrics`); imagined returns far above what the
            # real rewards can sustain show the actor exploiting the model (LEARNING.md).
            "reward_seen": self.reward_twohot.mean(reward_logits.detach().float()).mean(),
            "reward_real": reward_target.float().mean(),
        }
        return total, metrics

    def _model_losses(self, inputs, states, beliefs, post_logits):
        """The world model's losses (KL, reconstruction, reward, continue) on the time-major posterior;
        also the reward head's logits and targets, for the metrics."""
        nets, mloss = self.nets, self.loss.model_loss
        length, batch = beliefs.shape[:2]
        prior_logits = nets.prior.rnn_to_prior_projector(beliefs)
        prior_logits = prior_logits.view(*prior_logits.shape[:-1], self.size.stoch, self.size.classes)
        dynamic, representation = categorical_kl_terms(post_logits, prior_logits, free_nats=mloss.free_bits,
                                                       unimix=mloss.unimix)
        reco = 0.0
        if nets.vector_decoder is not None:
            target = torch.cat([_time_major(inputs[k]).float() for k in self.layout.vector_keys], -1)
            error = symlog(target) - symlog(nets.vector_decoder(states, beliefs))
            reco = reco + squared_error_loss(error, length, batch)
        if nets.image_decoder is not None:
            error = _time_major(inputs[IMAGE_KEY]).float() / 255.0 - nets.image_decoder(states, beliefs)
            reco = reco + squared_error_loss(error, length, batch)
        reward_logits, reward_target = nets.reward_head(states, beliefs), _time_major(inputs["reward"])
        reward_loss = self.reward_twohot.loss(reward_logits, reward_target).mean()
        continued = continue_loss(nets.continue_head(states, beliefs), _time_major(inputs["terminated"]))
        losses = {
            "loss_model_reco": mloss.lambda_reco * reco,
            "loss_model_reward": mloss.lambda_reward * reward_loss,
            "loss_model_dynamic": mloss.lambda_kl * mloss.lambda_dynamic * dynamic,
            "loss_model_representation": mloss.lambda_kl * mloss.lambda_representation * representation,
            "loss_model_continue": mloss.lambda_continue * continued,
        }
        return losses, reward_logits, reward_target

    def _behaviour_losses(self, img_states, img_beliefs, img_actions):
        """The actor's and the critic's losses on imagined states 0..H (actions 0..H-1); also the λ-returns
        [N, H, 1] (the replay value's bootstrap) and the metrics of imagination."""
        nets, settings = self.nets, self.loss
        with torch.no_grad():  # targets: no gradient
            next_s, next_b = img_states[:, 1:], img_beliefs[:, 1:]
            reward = self.reward_twohot.mean(nets.reward_head(next_s, next_b)).unsqueeze(-1)
            value_logits_all = self._critic(img_states, img_beliefs)
            next_value = self.value_twohot.mean(value_logits_all[:, 1:]).unsqueeze(-1)
            continuation_all = torch.sigmoid(nets.continue_head(img_states, img_beliefs))
            continuation = continuation_all[:, 1:]
            lambda_target = settings.actor_loss.lambda_target(reward, next_value, continuation)  # [N, H, 1]
            weight = imagination_weights(continuation_all, self.gamma)
            scale = return_scale(lambda_target, self.retnorm)  # EMA of the 5th / 95th percentiles
            baseline = self.value_twohot.mean(value_logits_all[:, :-1]).unsqueeze(-1)
            advantage = (lambda_target - baseline) / scale

        root_s, root_b = img_states[:, :-1], img_beliefs[:, :-1]
        if self.layout.discrete:
            log_prob, entropy = discrete_log_prob_entropy(nets.actor_net(root_s, root_b), img_actions)
        else:
            log_prob, entropy = normal_log_prob_entropy(*nets.actor_net(root_s, root_b), img_actions)
        actor, entropy = actor_loss(log_prob, entropy, advantage, weight, settings.actor_loss.entropy_bonus)

        value_logits = self._critic(root_s, root_b)
        with torch.no_grad():
            slow_value = self.value_twohot.mean(self._critic(root_s, root_b, slow=True))
        critic, slow_loss = critic_loss(self.value_twohot, value_logits, lambda_target.squeeze(-1), slow_value,
                                        weight.squeeze(-1), settings.value_loss.slow_critic_regularization)
        metrics = {
            "actor_entropy": entropy.detach(),
            "return_low": self.retnorm.low.squeeze(-1).clone(),
            "return_high": self.retnorm.high.squeeze(-1).clone(),
            "return_scale": scale.detach(),
            "continuation_mean": continuation.mean(),
            "value_slow_loss": slow_loss.detach(),
            "reward_imagined": reward.mean(),
        }
        return {"loss_actor": actor, "loss_value": critic}, lambda_target, metrics

    def _replay_value_loss(self, inputs, states, beliefs, lambda_target):
        """The critic on the replayed sequence (time-major; it trains the representation too), toward
        λ-returns bootstrapped from each posterior's imagined return, regularized toward the slow critic."""
        settings = self.loss
        length, batch = beliefs.shape[:2]
        with torch.no_grad():
            bootstrap = lambda_target[:, 0, 0].reshape(batch, length).unsqueeze(-1)  # [B, T, 1]: rows in (b, t) order
            done = inputs["done"]
            target = _time_major(replay_value_targets(
                inputs["reward"], bootstrap, done, inputs["terminated"],
                gamma=1 - 1 / settings.continuation_horizon, lmbda=settings.lmbda))  # [T-1, B]
            weight = _time_major(~done[:, :-1].squeeze(-1)).float()
            slow = self.value_twohot.mean(self._critic(states, beliefs, slow=True))[:-1]
        loss, _ = critic_loss(self.value_twohot, self._critic(states, beliefs)[:-1], target, slow, weight,
                              settings.value_loss.slow_critic_regularization)
        return loss

    def _optimize_fn(self, grads):
        grad_norm = self.optimizer.step(grads)
        torch._foreach_lerp_(self.slow_list, [p.detach() for p in self.critic_list], self.tau)
        return grad_norm

    # ---- the update ------------------------------------------------------------------------------

    def _autocast(self):
        if self.bf16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _step(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One whole update on named input tensors; returns the posterior (state, belief) [B, T, ...]."""
        total, metrics, states, beliefs, scan = self._losses(inputs)
        metrics["grad_norm"] = self._optimize(self._gradients(total, scan))
        values = torch.stack([torch.as_tensor(metrics[k], dtype=torch.float32, device=self.device).reshape(())
                              for k in METRICS]).detach()
        self._sums += values
        self._count += 1
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
        with self._autocast():
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
            # Time-major [T, B, ...]: the loss tail's gradients come back in this order (see _tail_fn).
            beliefs, states, post_logits = torch.stack(beliefs), torch.stack(states), torch.stack(logits)
            records = [torch.stack(column) for column in zip(*records)]

            # Imagination from every posterior state, without autograd; rows in (b, t) order.
            with torch.no_grad():
                s = states.detach().transpose(0, 1).reshape(-1, states.shape[-1])
                b = beliefs.detach().transpose(0, 1).reshape(-1, beliefs.shape[-1])
                img_s, img_b, img_a = [s], [b], []
                for _ in range(self.loss.actor_loss.imagination_horizon):
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
        saved = self._snapshot()
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
        self._restore(saved)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.needs_warmup = False
        return time.perf_counter() - start

    def update(self, batch: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
        """One update on batch [B, T]; returns the refreshed posterior, (state [B, T, latent], belief
        [B, T, deter]), on the learner's device (replay's write-back takes it).

        With a CUDA graph these are the graph's outputs: valid until the next update.
        """
        if self.needs_warmup:
            raise RuntimeError("call warmup(batch) before the first update when compiling or capturing")
        cuda = self.device.type == "cuda"
        if cuda:
            span = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            span[0].record()
        else:
            start = time.perf_counter()
        if self._graph is not None:
            for key, value in self._inputs(batch).items():
                self._static[key].copy_(value, non_blocking=True)
            self._graph.replay()
            state, belief = self._outputs
        else:
            state, belief = self._step({k: v.to(self.device) for k, v in self._inputs(batch).items()})
        if cuda:
            span[1].record()
            self._spans.append(span)
            if len(self._spans) > 64:  # a long time between reads: count the ended ones now
                self._count_ended_spans()
        else:
            self._busy += time.perf_counter() - start
        self.updates += 1
        return state, belief

    def busy_seconds(self) -> float:
        """Device seconds spent in updates since the last call, counting the updates that have ended on
        the device (the others count at a later call); never waits. On CPU: the update calls' time."""
        self._count_ended_spans()
        seconds, self._busy = self._busy, 0.0
        return seconds

    def _count_ended_spans(self) -> None:
        while self._spans and self._spans[0][1].query():
            start, end = self._spans.popleft()
            self._busy += start.elapsed_time(end) / 1e3

    def read_metrics(self) -> MetricsRead:
        """Starts reading the metrics summed since the last read: a copy to pinned memory behind an event
        on the learner's stream, so the caller need not wait for the updates still queued."""
        pinned = torch.empty(len(METRICS) + 1, pin_memory=self.device.type == "cuda")
        pinned[: len(METRICS)].copy_(self._sums, non_blocking=True)
        pinned[len(METRICS)].copy_(self._count, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._sums.zero_()
        self._count.zero_()
        return MetricsRead(pinned, event)

    def drain(self) -> dict[str, float]:
        """Mean of each metric since the last read, waiting for it."""
        return self.read_metrics().result()

    def _snapshot(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        tensors = [*self.params, *self.optimizer.rms, *self.optimizer.momentum, self.optimizer.step_count,
                   *self.slow_list, self.retnorm.low, self.retnorm.high, self._sums, self._count]
        rng = torch.get_rng_state(), (torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None)
        return [(t, t.detach().clone()) for t in tensors], rng

    def _restore(self, saved) -> None:
        tensors, (cpu_rng, cuda_rng) = saved
        with torch.no_grad():
            for tensor, value in tensors:
                tensor.copy_(value)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, self.device)

    def state_dict(self) -> dict:
        return {"loss": self.loss.state_dict(), "optimizer": self.optimizer.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        if "optimizer" not in state:
            raise ValueError("this checkpoint was written by an older learner (no 'optimizer' state); "
                             "start a new run folder or pass run.resume=never")
        with torch.no_grad():
            self.loss.load_state_dict(state["loss"])  # in place: captured graphs keep their tensors
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = int(state["updates"])
