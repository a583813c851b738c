"""DreamerV3's losses: the terms as plain functions on tensors (the world model's reconstruction and continue
losses, λ-returns, the actor's and the critic's losses, the replay value's targets, the
two-hot reward and value heads), and `Losses`, which applies them to the networks' outputs and holds the
state they carry between updates (slow critic, return normalization). dreamer.learner calls `Losses`."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torchrl.modules import PercentileValueNorm
from torchrl.modules.models.model_based import _default_bins, two_hot_cross_entropy, two_hot_decode
from torchrl.objectives import symexp, symlog
from torchrl.objectives.dreamer_v3 import categorical_kl_terms

from dreamer.agent import IMAGE_KEY, EnvLayout, LossSettings, ModelSize, Networks
from dreamer.scan import frozen_call


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


def continue_loss(logits: torch.Tensor, terminated: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """The continue head's binary cross entropy against "not terminated" ([..., 1] logits and flags), the
    flag times `scale` (the discount, for loss.continue_target=discounted)."""
    return F.binary_cross_entropy_with_logits(logits.squeeze(-1), scale * (~terminated).float().squeeze(-1))


# ---- imagination: returns, their scale, actor and critic ----

def imagination_weights(continuation: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """The weight of imagined steps 0..H-1 [N, H, 1] from the continuation of states 0..H [N, H + 1, 1]:
    the first step's own continuation, then the discounted running product."""
    root = continuation[:, :-1]
    return torch.cat([root[:, :1], gamma * root[:, 1:]], 1).cumprod(1)


def imagined_returns(reward, next_value, continuation, gamma: torch.Tensor, lmbda: torch.Tensor) -> torch.Tensor:
    """λ-returns [N, H, 1] of imagined steps 0..H-1 from their rewards, next values and continuations
    [N, H, 1], bootstrapped from the last next value: R_t = r_t + gamma c_t ((1 - lmbda) v_t + lmbda R_{t+1}).
    The recursion and its float operations in torchrl's order (DreamerV3ActorLoss.lambda_target)."""
    gamma, lmbda = gamma.to(reward), lmbda.to(reward)
    next_return = next_value[..., -1, :]
    returns = []
    for reward_t, value_t, continuation_t in zip(reversed(reward.unbind(-2)), reversed(next_value.unbind(-2)),
                                                 reversed(continuation.unbind(-2))):
        next_return = reward_t + gamma * continuation_t * ((1 - lmbda) * value_t + lmbda * next_return)
        returns.append(next_return)
    return torch.stack(returns[::-1], dim=-2)


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


# ---- the losses wired to the networks ----

def _time_major(x: torch.Tensor) -> torch.Tensor:
    """A [B, T, ...] target in the order of the scan's time-major outputs [T, B, ...]."""
    return x.transpose(0, 1)


class Losses:
    """DreamerV3's losses on the networks' outputs, with the state they carry from update to update: the
    slow critic (an exponential moving average of the critic head, `tau` per update) and the return
    normalizer. The learner calls it on the scan's and imagination's tensors inside its compiled tail.

    Term for term torchrl's DreamerV3Loss built with the same settings (`dreamer.agent.torchrl_loss`;
    tests/test_learner.py checks the losses and gradients against it)."""

    def __init__(self, nets: Networks, layout: EnvLayout, size: ModelSize, settings: LossSettings,
                 device: torch.device):
        self.nets, self.layout, self.size, self.settings = nets, layout, size, settings
        if settings.actor_grad not in ("reinforce", "backprop"):
            raise ValueError(f"loss.actor_grad must be reinforce or backprop, not {settings.actor_grad!r}")
        if settings.continue_target not in ("flag", "discounted"):
            raise ValueError(f"loss.continue_target must be flag or discounted, not {settings.continue_target!r}")
        if settings.actor_grad == "backprop" and layout.discrete:
            raise ValueError("loss.actor_grad=backprop differentiates continuous actions; this env's are discrete "
                             "(use loss.actor_grad=reinforce)")
        bins = _default_bins(size.bins, device=device)
        self.reward_twohot = TwoHot(bins, settings.two_hot)
        self.value_twohot = TwoHot(bins, settings.two_hot)
        # float32 tensors, as torchrl's TD(lambda) estimator holds them (the same roundings of the returns)
        self.gamma = torch.tensor(1.0 - 1.0 / settings.horizon, device=device)
        self.lmbda = torch.tensor(settings.lmbda, device=device)
        # The discount imagination applies on top of the continue head's prediction: all of it with a head
        # that learns the flag; none with one that learns the discounted flag (its prediction is the discount).
        self.discounted_head = settings.continue_target == "discounted"
        self.imag_gamma = torch.ones_like(self.gamma) if self.discounted_head else self.gamma
        self.slow_critic = copy.deepcopy(nets.critic_head).requires_grad_(False)
        self.slow_params = dict(self.slow_critic.named_parameters())
        # EMAs of the imagined returns' 5th and 95th percentiles; the advantages' scale is max(1, high - low)
        self.return_norm = PercentileValueNorm(rate=settings.return_norm_rate, device=device)

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors an update changes here (the learner's warm-up saves and restores them)."""
        return [*self.slow_params.values(), self.return_norm.low, self.return_norm.high]

    def update_slow_critic(self) -> None:
        """slow <- slow + tau (critic - slow), after the optimizer's step."""
        critic = [p.detach() for p in self.nets.critic_head.parameters()]
        torch._foreach_lerp_(list(self.slow_params.values()), critic, self.settings.slow_critic_tau)

    def state_dict(self) -> dict:
        return {"slow_critic": self.slow_critic.state_dict(), "return_norm": self.return_norm.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """In place: a captured CUDA graph keeps reading the same tensors."""
        with torch.no_grad():
            self.slow_critic.load_state_dict(state["slow_critic"])
            self.return_norm.load_state_dict(state["return_norm"])

    def _critic(self, state, belief, slow: bool = False):
        if slow:
            return torch.func.functional_call(self.nets.critic_head, self.slow_params, (state, belief))
        return self.nets.critic_head(state, belief)

    def __call__(self, targets, states, beliefs, post_logits, img_states, img_beliefs, img_actions):
        """Every loss after the two recurrences, on whole tensors; returns (total, metrics).

        `targets`: the batch's observations, rewards and flags [B, T, ...] by name. The posterior's states,
        beliefs and logits come time-major, [T, B, ...], and every loss that takes their gradient runs in
        that order (its targets transposed, its means unchanged): their gradients are then time-major too,
        so each scan step's share is a contiguous [B, ...] block, which the step's compiled backward takes
        as it is (a strided one it would first copy, at every step). Imagination: states 0..H [N, H + 1, ...]
        from every posterior state, rows in (b, t) order, and actions 0..H-1."""
        losses, reward_logits, reward_target = self._model(targets, states, beliefs, post_logits)
        behaviour, lambda_target, metrics = self._behaviour(img_states, img_beliefs, img_actions)
        losses.update(behaviour)
        replay_value = self._replay_value(targets, states, beliefs, lambda_target)
        losses["loss_replay_value"] = self.settings.replay_value * replay_value
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

    def _model(self, targets, states, beliefs, post_logits):
        """The world model's losses (KL, reconstruction, reward, continue) on the time-major posterior;
        also the reward head's logits and targets, for the metrics."""
        nets, settings = self.nets, self.settings
        length, batch = beliefs.shape[:2]
        prior_logits = nets.prior.rnn_to_prior_projector(beliefs)
        prior_logits = prior_logits.view(*prior_logits.shape[:-1], self.size.stoch, self.size.classes)
        dynamic, representation = categorical_kl_terms(post_logits, prior_logits, free_nats=settings.free_nats,
                                                       unimix=self.size.unimix)
        reco = 0.0
        if nets.vector_decoder is not None:
            target = torch.cat([_time_major(targets[k]).float() for k in self.layout.vector_keys], -1)
            error = symlog(target) - symlog(nets.vector_decoder(states, beliefs))
            reco = reco + squared_error_loss(error, length, batch)
        if nets.image_decoder is not None:
            error = _time_major(targets[IMAGE_KEY]).float() / 255.0 - nets.image_decoder(states, beliefs)
            reco = reco + squared_error_loss(error, length, batch)
        reward_logits, reward_target = nets.reward_head(states, beliefs), _time_major(targets["reward"])
        reward_loss = self.reward_twohot.loss(reward_logits, reward_target).mean()
        continued = continue_loss(nets.continue_head(states, beliefs), _time_major(targets["terminated"]),
                                  self.gamma if self.discounted_head else 1.0)
        losses = {  # reconstruction, reward and continue weigh 1
            "loss_model_reco": reco,
            "loss_model_reward": reward_loss,
            "loss_model_dynamic": settings.kl_dynamic * dynamic,
            "loss_model_representation": settings.kl_representation * representation,
            "loss_model_continue": continued,
        }
        return losses, reward_logits, reward_target

    def _behaviour(self, img_states, img_beliefs, img_actions):
        """The actor's and the critic's losses on imagined states 0..H (actions 0..H-1); also the λ-returns
        [N, H, 1] (the replay value's bootstrap) and the metrics of imagination."""
        if self.settings.actor_grad == "backprop":
            return self._behaviour_backprop(img_states, img_beliefs, img_actions)
        nets, settings = self.nets, self.settings
        with torch.no_grad():  # targets: no gradient
            next_s, next_b = img_states[:, 1:], img_beliefs[:, 1:]
            reward = self.reward_twohot.mean(nets.reward_head(next_s, next_b)).unsqueeze(-1)
            value_logits_all = self._critic(img_states, img_beliefs)
            next_value = self.value_twohot.mean(value_logits_all[:, 1:]).unsqueeze(-1)
            continuation_all = torch.sigmoid(nets.continue_head(img_states, img_beliefs))
            continuation = continuation_all[:, 1:]
            lambda_target = imagined_returns(reward, next_value, continuation, self.imag_gamma, self.lmbda)  # [N, H, 1]
            weight = imagination_weights(continuation_all, self.imag_gamma)
            self.return_norm.update(lambda_target)
            scale = self.return_norm.scale().squeeze(-1)
            baseline = self.value_twohot.mean(value_logits_all[:, :-1]).unsqueeze(-1)
            advantage = (lambda_target - baseline) / scale

        root_s, root_b = img_states[:, :-1], img_beliefs[:, :-1]
        if self.layout.discrete:
            log_prob, entropy = discrete_log_prob_entropy(nets.actor_net(root_s, root_b), img_actions)
        else:
            log_prob, entropy = normal_log_prob_entropy(*nets.actor_net(root_s, root_b), img_actions)
        actor, entropy = actor_loss(log_prob, entropy, advantage, weight, settings.entropy)
        critic, metrics = self._critic_terms(self._critic(root_s, root_b), root_s, root_b, lambda_target, weight)
        return {"loss_actor": actor, "loss_value": critic}, lambda_target, {
            **metrics, "actor_entropy": entropy.detach(), "return_scale": scale.detach(),
            "continuation_mean": continuation.mean(), "reward_imagined": reward.mean()}

    def _critic_terms(self, value_logits, root_s, root_b, lambda_target, weight):
        """The critic's loss on imagined states 0..H-1 (its logits there given) toward the λ-returns,
        regularized toward the slow critic; and the metrics both actor gradients share."""
        with torch.no_grad():
            slow_value = self.value_twohot.mean(self._critic(root_s, root_b, slow=True))
        critic, slow_loss = critic_loss(self.value_twohot, value_logits, lambda_target.squeeze(-1), slow_value,
                                        weight.squeeze(-1), self.settings.slow_critic)
        return critic, {
            "return_low": self.return_norm.low.squeeze(-1).clone(),
            "return_high": self.return_norm.high.squeeze(-1).clone(),
            "value_slow_loss": slow_loss.detach(),
        }

    def _behaviour_backprop(self, img_states, img_beliefs, img_actions):
        """`_behaviour` for loss.actor_grad=backprop: imagination ran with autograd (the actor's actions through
        the frozen prior), and the actor maximizes the normalized λ-return itself, read through the frozen
        reward head and critic, plus the entropy bonus; the critic learns on the states detached. The
        reference's agent before its 2024 rewrite learned continuous actions this way (LEARNING.md)."""
        nets, settings = self.nets, self.settings
        next_s, next_b = img_states[:, 1:], img_beliefs[:, 1:]
        reward = self.reward_twohot.mean(frozen_call(nets.reward_head, next_s, next_b)).unsqueeze(-1)
        next_value = self.value_twohot.mean(frozen_call(nets.critic_head, next_s, next_b)).unsqueeze(-1)
        states, beliefs = img_states.detach(), img_beliefs.detach()
        root_s, root_b = states[:, :-1], beliefs[:, :-1]
        with torch.no_grad():
            continuation_all = torch.sigmoid(nets.continue_head(states, beliefs))
            continuation = continuation_all[:, 1:]
            weight = imagination_weights(continuation_all, self.imag_gamma)
        returns = imagined_returns(reward, next_value, continuation, self.imag_gamma, self.lmbda)  # [N, H, 1]
        lambda_target = returns.detach()
        value_logits = self._critic(root_s, root_b)  # the critic's loss and, detached, the baseline
        with torch.no_grad():
            self.return_norm.update(lambda_target)
            scale = self.return_norm.scale().squeeze(-1)
            baseline = self.value_twohot.mean(value_logits.detach()).unsqueeze(-1)
        _, entropy = normal_log_prob_entropy(*nets.actor_net(root_s, root_b), img_actions.detach())
        entropy = (weight * entropy).mean()
        actor = -(weight * (returns - baseline) / scale).mean() - settings.entropy * entropy
        critic, metrics = self._critic_terms(value_logits, root_s, root_b, lambda_target, weight)
        return {"loss_actor": actor, "loss_value": critic}, lambda_target, {
            **metrics, "actor_entropy": entropy.detach(), "return_scale": scale.detach(),
            "continuation_mean": continuation.mean(), "reward_imagined": reward.detach().mean()}

    def _replay_value(self, targets, states, beliefs, lambda_target):
        """The critic on the replayed sequence (time-major; it trains the representation too), toward
        λ-returns bootstrapped from each posterior's imagined return, regularized toward the slow critic."""
        settings = self.settings
        length, batch = beliefs.shape[:2]
        with torch.no_grad():
            bootstrap = lambda_target[:, 0, 0].reshape(batch, length).unsqueeze(-1)  # [B, T, 1]: rows in (b, t) order
            done = targets["done"]
            target = _time_major(replay_value_targets(
                targets["reward"], bootstrap, done, targets["terminated"],
                gamma=1 - 1 / settings.horizon, lmbda=settings.lmbda))  # [T-1, B]
            weight = _time_major(~done[:, :-1].squeeze(-1)).float()
            slow = self.value_twohot.mean(self._critic(states, beliefs, slow=True))[:-1]
        loss, _ = critic_loss(self.value_twohot, self._critic(states, beliefs)[:-1], target, slow, weight,
                              settings.slow_critic)
        return loss
