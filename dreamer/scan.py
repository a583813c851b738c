"""The RSSM scan the learner differentiates, and the imagination step, on plain tensors.

The posterior path runs one compiled cell per step (`cell_fn`); inside it the weights are cast to the
compute dtype once per update (`weights`) and their gradients come from "taps": zeros added to each tapped
operation's output, whose gradient is the stacked output gradient of all steps, so that each weight's
gradient is one matmul over all B x T rows (`weight_grads`) instead of T small ones and T - 1
accumulations. The arithmetic is torchrl's RSSM (block GRU, RMS norms, unimix straight-through latents),
term for term; tests/test_learner.py checks it against torchrl's loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchrl.modules.models.model_based import _straight_through_categorical

from dreamer.agent import EnvLayout, ModelSize, Networks


class Scan:
    """The tapped RSSM of `nets`: its cell, its block GRU, the tapped weights' gradients, imagination."""

    def __init__(self, nets: Networks, layout: EnvLayout, size: ModelSize, device: torch.device,
                 frozen_prior: bool = False, state_bf16: bool = False):
        self.nets, self.layout, self.size, self.device = nets, layout, size, device
        self.specs = self.tap_specs()
        self.eps = nets.prior.rnn.belief_projection[1].eps
        # loss.actor_grad=backprop: imagination runs with autograd, its actions carrying the actor's gradient;
        # the prior then reads its untapped parameters detached too, so that the actor's loss moves only
        # the actor (the tapped weights are detached casts already).
        self.frozen_prior = frozen_prior
        # run.state_precision=bf16: the recurrent state rounded to bfloat16 after each step, as the reference
        # keeps it (its activations are bfloat16); see round_bf16.
        self.state_bf16 = state_bf16

    def tap_specs(self) -> list[tuple[str, torch.nn.Parameter, torch.nn.Parameter | None, int]]:
        """(kind, weight, bias, width of the output) of each tapped operation of the scan, in order."""
        rnn, post = self.nets.prior.rnn, self.nets.posterior.obs_rnn_to_post_projector
        specs = []
        for projection in (rnn.belief_projection, rnn.state_projection):
            specs.append(("linear", projection[0].weight, projection[0].bias, projection[0].out_features))
            specs.append(("norm", projection[1].weight, None, projection[0].out_features))
        for i in range(0, len(rnn.hidden_layers), 3):
            block, norm = rnn.hidden_layers[i], rnn.hidden_layers[i + 1]
            specs.append(("block", block.weight, block.bias, block.out_features))
            specs.append(("norm", norm.weight, None, block.out_features))
        specs.append(("block", rnn.gates.weight, rnn.gates.bias, rnn.gates.out_features))
        specs.append(("belief_columns", post[0].weight, None, post[0].out_features))
        for i in range(1, len(post) - 1, 3):
            specs.append(("norm", post[i].weight, None, post[i].weight.shape[0]))
            if i + 2 < len(post) - 1:
                specs.append(("linear", post[i + 2].weight, post[i + 2].bias, post[i + 2].out_features))
        specs.append(("linear", post[-1].weight, post[-1].bias, post[-1].out_features))
        return specs

    def weights(self, dtype: torch.dtype) -> list[tuple]:
        """The tapped operations' weights, detached, in the compute dtype (norm scales stay float32)."""
        weights = []
        for kind, weight, bias, _ in self.specs:
            if kind == "norm":
                weights.append((weight.detach().float(), None))
            elif kind == "belief_columns":
                weights.append((weight.detach()[:, : self.size.deter].to(dtype), None))
            else:
                weights.append((weight.detach().to(dtype), bias.detach().to(dtype)))
        return weights

    @staticmethod
    def _linear(x, weight, bias, tap, records):
        if records is not None:
            records.append(x.detach())
        y = F.linear(x, weight, bias)
        return y if tap is None else y + tap

    @staticmethod
    def _block(x, weight, bias, tap, records):
        """Block-diagonal linear on x [B, blocks, in / blocks] -> [B, out]."""
        if records is not None:
            records.append(x.detach())
        y = torch.bmm(x.transpose(0, 1), weight).transpose(0, 1)
        y = y.reshape(x.shape[0], -1) + bias.to(y.dtype)
        return y if tap is None else y + tap

    def _norm_silu(self, y, scale, tap, records):
        xhat = F.rms_norm(y.float(), (y.shape[-1],), None, self.eps)
        if records is not None:
            records.append(xhat.detach())
        out = (xhat * scale).to(y.dtype)
        return F.silu(out if tap is None else out + tap)

    def gru(self, state, belief, action_features, weights, taps, records):
        """h' = f(z, h, a): the block GRU of the prior, on tapped operations (torchrl's arithmetic)."""
        n = iter(range(len(weights)))
        parts = []
        for x in (belief, state):
            i, j = next(n), next(n)
            y = self._linear(x, *weights[i], taps[i], records)
            parts.append(self._norm_silu(y, weights[j][0], taps[j], records))
        features = torch.cat([*parts, action_features], -1)
        blocks = self.nets.prior.rnn.num_blocks
        grouped = belief.reshape(belief.shape[0], blocks, -1)
        hidden = torch.cat([grouped, features.unsqueeze(-2).expand(-1, blocks, -1)], -1)
        for _ in range(len(self.nets.prior.rnn.hidden_layers) // 3):
            i, j = next(n), next(n)
            y = self._block(hidden, *weights[i], taps[i], records)
            hidden = self._norm_silu(y, weights[j][0], taps[j], records).reshape(belief.shape[0], blocks, -1)
        i = next(n)
        gates = self._block(hidden, *weights[i], taps[i], records)
        reset, candidate, update = gates.reshape(belief.shape[0], blocks, 3, -1).unbind(-2)
        reset = reset.flatten(-2).sigmoid()
        candidate = (reset * candidate.flatten(-2)).tanh()
        update = (update.flatten(-2) - 1.0).sigmoid()
        belief = update * candidate + (1 - update) * belief
        return round_bf16(belief) if self.state_bf16 else belief, next(n)

    def cell_fn(self, state, belief, action_features, embed_part, reset, uniform, weights, taps):
        """One RSSM step on the posterior path: h[t] = f(z[t-1], h[t-1], a[t-1]), z[t] ~ q(h[t], e[t]).

        Returns (h[t], posterior logits, z[t], the tapped operations' inputs, copies of h[t] and z[t]).
        The next step takes h[t] and z[t], the loss tail their copies: each output then has one consumer,
        and the compiled backward adds the two gradients inside its own kernels, where a tensor used twice
        would make autograd add them in a kernel of its own at every step."""
        records = []
        state = torch.where(reset, 0, state)
        belief = torch.where(reset, 0, belief)
        belief, i = self.gru(state, belief, action_features, weights, taps, records)
        y = self._linear(belief, weights[i][0], None, taps[i], records) + embed_part
        post = self.nets.posterior.obs_rnn_to_post_projector
        for _ in range(1, len(post) - 1, 3):
            i += 1
            y = self._norm_silu(y, weights[i][0], taps[i], records)
            if i + 1 < len(weights) - 1:
                i += 1
                y = self._linear(y, *weights[i], taps[i], records)
        i += 1
        logits = self._linear(y, *weights[i], taps[i], records)
        logits = logits.view(*logits.shape[:-1], self.size.stoch, self.size.classes)
        state = _straight_through_categorical(logits, self.nets.posterior.unimix, uniform).flatten(-2)
        return belief, logits, state, records, belief.clone(), state.clone()

    def embed_fn(self, observations, action, reset):
        """The scan's inputs for all steps at once: the observation part of the posterior's first layer
        (encoder included) and the prior's action projection (actions zeroed where an episode starts)."""
        nets = self.nets
        embed = nets.encoder(*observations)
        action = torch.where(reset, 0, action)
        action_features = nets.prior.rnn.action_projection(action / action.detach().abs().clamp_min(1))
        first = nets.posterior.obs_rnn_to_post_projector[0]
        return F.linear(embed, first.weight[:, self.size.deter:], first.bias), action_features

    def weight_grads(self, tap_grads, records) -> dict:
        """Each tapped weight's gradient from the stacked output gradients and the stacked inputs."""
        grads = {}
        for (kind, weight, bias, _), dy, x in zip(self.specs, tap_grads, records):
            rows = dy.reshape(-1, dy.shape[-1])
            if kind == "norm":
                grads[weight] = (rows.float() * x.reshape(-1, x.shape[-1])).sum(0)
                continue
            if kind == "block":
                blocks = weight.shape[0]
                inputs = x.reshape(-1, blocks, x.shape[-1]).transpose(0, 1).to(rows.dtype)
                outputs = rows.reshape(-1, blocks, rows.shape[-1] // blocks).transpose(0, 1)
                grads[weight] = torch.bmm(inputs.transpose(1, 2), outputs).float()
            else:
                grads[weight] = (rows.t() @ x.reshape(-1, x.shape[-1]).to(rows.dtype)).float()
            if bias is not None:
                grads[bias] = rows.float().sum(0)
        return grads

    def imagine_fn(self, state, belief, noise, uniform, weights):
        """One imagination step: the actor's action at (z, h), then the prior's (z', h'), on given draws.

        The action is sampled as torchrl's distributions sample it, from the same draws: a one-hot action
        is torch.multinomial's single draw, argmax(p / q) with q ~ Exp(1) (`noise`), and a continuous one
        is mean + std * noise with noise ~ N(0, 1). With the draws made outside, sampling fuses into this
        step's kernels, where multinomial would launch a dozen of its own (input checks included)."""
        if self.layout.discrete:
            logits = self.nets.actor_net(state, belief)
            probs = torch.softmax(logits - logits.logsumexp(-1, keepdim=True), -1)
            action = F.one_hot((probs / noise).argmax(-1), probs.shape[-1]).to(probs.dtype)
        else:
            mean, std = self.nets.actor_net(state, belief)
            action = mean + std * noise.to(mean.dtype)
        state, belief = self.prior_step(state, belief, action, uniform, weights)
        return state, belief, action

    def imagination_noise(self, rows: int) -> torch.Tensor:
        """The actor's draw for one imagination step (see imagine_fn): Exp(1) or N(0, 1), [rows, actions]."""
        noise = torch.empty(rows, self.layout.action_dim, device=self.device)
        return noise.exponential_() if self.layout.discrete else noise.normal_()

    def prior_step(self, state, belief, action, uniform, weights):
        """Imagination: one prior step with a given uniform draw."""
        rnn, call = self.nets.prior.rnn, frozen_call if self.frozen_prior else _call
        action_features = call(rnn.action_projection, action / action.detach().abs().clamp_min(1))
        taps = [None] * len(weights)
        belief, _ = self.gru(state, belief, action_features, weights, taps, None)
        logits = call(self.nets.prior.rnn_to_prior_projector, belief)
        logits = logits.view(*logits.shape[:-1], self.size.stoch, self.size.classes)
        state = _straight_through_categorical(logits, self.nets.prior.unimix, uniform)
        return state.flatten(-2), belief


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """Float32 `x` rounded to the nearest bfloat16 value (ties to even), still float32, with the gradient
    passing as through the identity; infinities and NaN stay as they are. Rounded on the bits with integer
    arithmetic: inductor folds a cast to bfloat16 and back into nothing (torch 2.11 on CUDA), but never these."""
    if x.dtype != torch.float32:
        return x
    bits = x.detach().view(torch.int32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).view(torch.float32)
    # x + (rounded - x) is exactly `rounded` for a finite x (the difference is exact in float32); a NaN's bits
    # could carry into another value, and inf - inf is NaN: those keep x.
    return torch.where(x.isfinite(), x + (rounded - x).detach(), x)


def _call(module: torch.nn.Module, *inputs):
    return module(*inputs)


def frozen_call(module: torch.nn.Module, *inputs):
    """`module(*inputs)` with its parameters detached: gradients reach the inputs, never the parameters."""
    params = {name: param.detach() for name, param in module.named_parameters()}
    return torch.func.functional_call(module, params, inputs)
