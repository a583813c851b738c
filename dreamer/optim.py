"""The optimizer of the learner step: LaProp with adaptive gradient clipping and linear warm-up, on the device.

Its settings come from the run's config (`optimizer:` in configs/config.yaml; dreamer.config builds them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# Adaptive gradient clipping limits a tensor's gradient norm to agc x max(this, its parameters' norm): a tensor
# at zero (a head's output layer at its start) can still move.
PARAMETER_NORM_MIN = 1e-3


def _in_layout_of(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`grad` in float32 with `param`'s strides. CUDA's fused foreach kernels need every list of an operation
    to share sizes and strides; one gradient in another layout (a convolution's weight gradient comes
    channels-last from cuDNN while its weight is NCHW) sends the whole operation down the per-tensor path,
    one kernel per parameter tensor. The copy is of that gradient only."""
    if grad.stride() == param.stride():
        return grad.float()
    return torch.empty_like(param, dtype=torch.float32).copy_(grad)  # one copy, the cast included


@dataclass(frozen=True)
class OptimizerSettings:
    """The `optimizer:` section of the config (configs/config.yaml holds the defaults; dreamer.config builds
    these from a composed config)."""

    lr: float
    eps: float
    agc: float
    warmup: int  # updates of linear learning-rate warm-up
    beta1: float
    beta2: float
    # Adaptive clipping per output: the rows of an output layer that feed different outputs (the actor's mean
    # and spread, each vector observation's prediction) clipped as tensors of their own, as the reference's
    # separate output layers are; false clips each parameter tensor whole.
    agc_per_output: bool


class LaProp:
    """LaProp (RMS-normalize, then momentum) with adaptive gradient clipping and linear lr warm-up.

    The same update as torchrl's DreamerV3Optimizer, with its step counter and every schedule value on
    the device so that the step can sit inside a CUDA graph. Parameters without a gradient are skipped.
    """

    def __init__(self, params: list[torch.nn.Parameter], settings: OptimizerSettings,
                 row_groups: dict[int, list[int]] | None = None, watched: int = 0):
        """`row_groups`: parameter index -> the sizes of its row blocks along dim 0, which adaptive clipping
        treats as tensors of their own (the rest it clips whole). `watched`: the parameter whose clipping
        `clip_metrics` reports."""
        self.params = params
        self.settings = settings
        self.row_groups = dict(row_groups or {})
        self.watched = watched
        self.clip_scales: dict[tuple[int, int], torch.Tensor] = {}  # (parameter, row group): the last factor
        for i, sizes in self.row_groups.items():
            if sum(sizes) != params[i].shape[0]:
                raise ValueError(f"row groups {sizes} of parameter {i} do not add up to its {params[i].shape[0]} rows")
        device = params[0].device
        self.rms = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        self.momentum = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        # float64: the bias corrections 1 - beta**step lose 1e-5 of their value in float32 early on.
        self.step_count = torch.zeros((), dtype=torch.float64, device=device)

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """Applies one update; returns the global gradient norm before clipping (a device scalar)."""
        s = self.settings
        index = [i for i, g in enumerate(grads) if g is not None]
        params = [self.params[i] for i in index]
        grads = [_in_layout_of(grads[i], self.params[i]) for i in index]
        rms = [self.rms[i] for i in index]
        momentum = [self.momentum[i] for i in index]
        self.step_count += 1
        step = self.step_count
        warmup = ((step - 1) / s.warmup).clamp(max=1.0) if s.warmup else torch.ones_like(step)
        lr = (s.lr * warmup).float()
        correction2 = (1 - s.beta2**step).float()
        scale = (-lr / (1 - s.beta1**step)).float()
        units = self._units(index, grads)  # the tensors adaptive clipping sees: row groups split off
        grad_norms = torch._foreach_norm(units)
        grad_norm = torch.linalg.vector_norm(torch.stack(grad_norms))
        if s.agc:
            param_norms = torch._foreach_norm(self._units(index, [p.detach().float() for p in params]))
            torch._foreach_clamp_min_(param_norms, PARAMETER_NORM_MIN)
            limits = torch._foreach_mul(param_norms, s.agc)
            scales = torch._foreach_div(limits, torch._foreach_maximum(grad_norms, limits))
            # One kernel per tensor: the factors are 0-dim, and CUDA fuses only lists of equal sizes.
            grads = self._join(index, torch._foreach_mul(units, scales))
            owners = [(i, group) for i in index for group in range(len(self.row_groups.get(i, (None,))))]
            self.clip_scales = dict(zip(owners, scales))
        torch._foreach_mul_(rms, s.beta2)
        torch._foreach_addcmul_(rms, grads, grads, value=1 - s.beta2)
        denominator = torch._foreach_sqrt(torch._foreach_div(rms, correction2))
        torch._foreach_add_(denominator, s.eps)
        torch._foreach_mul_(momentum, s.beta1)
        torch._foreach_add_(momentum, torch._foreach_div(grads, denominator), alpha=1 - s.beta1)
        updates = torch._foreach_mul(momentum, scale)
        torch._foreach_add_(params, updates)
        return grad_norm

    def clip_metrics(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Of the last step: the fraction of tensors (row groups apart) whose gradient adaptive clipping shrank,
        and the factor it applied to the watched parameter's first rows (the actor's mean; 1: not clipped)."""
        one = torch.ones((), device=self.step_count.device)
        if not self.clip_scales:
            return one * 0, one
        clipped = (torch.stack(list(self.clip_scales.values())) < 1).float().mean()
        return clipped, self.clip_scales.get((self.watched, 0), one)

    def _units(self, index: list[int], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self.row_groups:
            return tensors
        units = []
        for i, tensor in zip(index, tensors):
            sizes = self.row_groups.get(i)
            units.extend(tensor.split(sizes) if sizes else (tensor,))
        return units

    def _join(self, index: list[int], units: list[torch.Tensor]) -> list[torch.Tensor]:
        """The inverse of `_units`: each parameter's row groups concatenated back."""
        if not self.row_groups:
            return units
        joined, k = [], 0
        for i in index:
            n = len(self.row_groups.get(i, (None,)))
            joined.append(torch.cat(units[k:k + n]) if n > 1 else units[k])
            k += n
        return joined

    def state_dict(self) -> dict:
        return {"rms": self.rms, "momentum": self.momentum, "step": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            torch._foreach_copy_(self.rms, [t.to(r) for t, r in zip(state["rms"], self.rms)])
            torch._foreach_copy_(self.momentum, [t.to(m) for t, m in zip(state["momentum"], self.momentum)])
            self.step_count.copy_(state["step"])
