"""The loss terms as plain functions on tensors: the world model's reconstruction and continue losses,
λ-returns and their scale, the actor's and the critic's losses, the replay value's targets, and the two-hot
reward and value heads. dreamer.learner wires them to the networks' outputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchrl.modules.models.model_based import two_hot_cross_entropy, two_hot_decode
from torchrl.objectives import symexp, symlog


def lambda_returns(reward, next_value, done, terminated, gamma: float, lmbda: float) -> torch.Tensor:
    """TD(lambda) returns [B, T] from [B, T, 1] inputs, as torchrl's `td_lambda_return_estimate`, without
    a loop over time.

    torchrl's recursion, with v = next_value zeroed where terminated and d = done:
        g_t = b_t + a_t g_{t+1},  a_t = gamma lmbda (1 - d_t),  b_t = r_t + gamma v_t (1 - lmbda + lmbda d_t),
        g_T = v_{T-1}.
    Unrolled: g_t = sum_{j >= t} (a_t ... a_{j-1}) b_j, with b_T = g_T. The products come from one cumprod
    over a [B, T, T + 1] tensor. Inside the compiled loss this is a few kernels; the loop it replaces was
    T steps of unrolled graph (at T = 256, tens of seconds of compilation, more with torchrl's in-place
    writes into the result).
    """
    length = reward.shape[1]
    v = (next_value * (~terminated)).squeeze(-1)
    d = done.squeeze(-1).float()
    a = gamma * lmbda * (1 - d)
    b = torch.cat([reward.squeeze(-1) + gamma * v * ((1 - lmbda) + lmbda * d), v[:, -1:]], 1)  # [B, T + 1]
    t = torch.arange(length, device=reward.device)[:, None]
    j = torch.arange(length + 1, device=reward.device)[None, :]
    # factors[., t, j] = a_{j-1} for j > t, else 1; the running product over j is a_t ... a_{j-1}.
    factors = torch.where(j > t, F.pad(a, (1, 0))[:, None, :], torch.ones((), device=reward.device))
    products = torch.cumprod(factors, -1) * (j >= t)
    return (products * b[:, None, :]).sum(-1)


class TwoHot:
    """The reward and value heads' logits over 255 bins, read as a scalar and trained toward one.

    "symexp" (the reference's symexp_twohot; torchrl's `two_hot_cross_entropy` / `two_hot_decode`): the
    bins are symexp(-20 .. 20) in raw values; a target is split between its two neighbouring bins linearly
    in raw values, and a prediction is the probabilities' expectation over the raw bins. "symlog" (the
    reference's symlog_and_twohot alternative): the same grid taken in symlog space (-20 .. 20 evenly); a
    target is symlogged and split there, and a prediction is the expectation over the symlog grid, symexped.
    The raw expectation is unbiased, and it moves with every bin's probability times its value (up to 4.9e8
    at the grid's ends); the symlog one is pulled toward zero by a spread of outcomes (Jensen). Both pair
    mirrored bins so that uniform logits read exactly zero.
    """

    MODES = ("symexp", "symlog")

    def __init__(self, bins: torch.Tensor, mode: str):
        if mode not in self.MODES:
            raise ValueError(f"two-hot mode must be one of {', '.join(self.MODES)}, not {mode!r}")
        self.mode, self.bins = mode, bins
        self.grid = symlog(bins) if mode == "symlog" else bins

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Cross entropy of `logits` [..., bins] against the two-hot of `target` [...] or [..., 1]."""
        if self.mode == "symlog":
            target = symlog(target)
        return two_hot_cross_entropy(logits, target, self.grid)

    def mean(self, logits: torch.Tensor) -> torch.Tensor:
        """The prediction [...] of `logits` [..., bins]."""
        value = two_hot_decode(logits, self.grid)
        return symexp(value) if self.mode == "symlog" else value


# ---- world model ----

def squared_error_loss(error: torch.Tensor, length: int, batch: int) -> torch.Tensor:
    """Reconstruction: the squared error summed over an observation's features, averaged over [T, B]."""
    return error.pow(2).reshape(length, batch, -1).sum(-1).mean()


def continue_loss(logits: torch.Tensor, terminated: torch.Tensor) -> torch.Tensor:
    """The continue head's binary cross entropy against "not terminated" ([..., 1] logits and flags)."""
    return F.binary_cross_entropy_with_logits(logits.squeeze(-1), (~terminated).float().squeeze(-1))


# ---- imagination: returns, their scale, actor and critic ----

def imagination_weights(continuation: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """The weight of imagined steps 0..H-1 [N, H, 1] from the continuation of states 0..H [N, H + 1, 1]:
    the first step's own continuation, then the discounted running product."""
    root = continuation[:, :-1]
    return torch.cat([root[:, :1], gamma * root[:, 1:]], 1).cumprod(1)


def return_scale(lambda_target: torch.Tensor, retnorm) -> torch.Tensor:
    """Moves the return normalizer's 5th / 95th percentiles (torchrl's `PercentileValueNorm`: `low`, `high`
    buffers, `rate`, quantiles `_q`) toward those of `lambda_target`; returns max(1, high - low)."""
    low, high = torch.quantile(lambda_target.reshape(-1, 1), retnorm._q.to(lambda_target), dim=0)
    retnorm.low.lerp_(low, retnorm.rate)
    retnorm.high.lerp_(high, retnorm.rate)
    return retnorm.scale().squeeze(-1)


def discrete_log_prob_entropy(logits: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(a) and the entropy [..., 1] of a categorical policy's logits, for one-hot actions."""
    logits = logits - logits.logsumexp(-1, keepdim=True)
    log_prob = logits.gather(-1, actions.argmax(-1, keepdim=True))
    probs = torch.softmax(logits, -1)
    entropy = -(logits.clamp(min=torch.finfo(logits.dtype).min) * probs).sum(-1, keepdim=True)
    return log_prob, entropy


def normal_log_prob_entropy(mean: torch.Tensor, std: torch.Tensor, actions: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(a) and the entropy [..., 1] of an independent normal policy, summed over action dimensions."""
    normal = torch.distributions.Normal(mean, std, validate_args=False)
    return normal.log_prob(actions).sum(-1, keepdim=True), normal.entropy().sum(-1, keepdim=True)


def actor_loss(log_prob, entropy, advantage, weight, entropy_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE on stopped states with an entropy bonus: (the loss, the weighted mean entropy)."""
    entropy = (weight * entropy).mean()
    return -(weight * log_prob * advantage).mean() - entropy_scale * entropy, entropy


def critic_loss(twohot: TwoHot, logits, target, slow_value, weight, slow_scale: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's two-hot loss toward `target`, regularized toward the slow critic's `slow_value`, weighted:
    (the loss, the weighted regularization term alone)."""
    slow_loss = twohot.loss(logits, slow_value)
    return (weight * (twohot.loss(logits, target) + slow_scale * slow_loss)).mean(), (weight * slow_loss).mean()


def replay_value_targets(reward, bootstrap, done, terminated, gamma: float, lmbda: float) -> torch.Tensor:
    """λ-returns along the replayed sequence [B, T - 1] from its rewards and flags [B, T, 1], bootstrapped
    from `bootstrap` [B, T, 1] (the imagined returns of each posterior); record t's reward came with o[t]."""
    return lambda_returns(reward[:, 1:], bootstrap[:, 1:], done[:, 1:], terminated[:, 1:], gamma=gamma, lmbda=lmbda)
