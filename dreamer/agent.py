"""The DreamerV3 agent: world model, actor, critic and the acting policy, from torchrl modules (the losses
are dreamer.learner's; `torchrl_loss` builds torchrl's on the same parameters, the learner's test oracle).

Replay layout (one record per env step, the reference implementation's order):

    record t:  state = z[t-1], belief = h[t-1], action = a[t-1], is_init = first step of an episode
               next:  <observations at t>, reward r[t], done / terminated at t

so the RSSM rollout of torchrl (prior on the root keys, posterior on the `next` observation) computes
h[t] = f(z[t-1], h[t-1], a[t-1]) and z[t] ~ q(h[t], embed(o[t])), and zeroes the carry where is_init is
set, exactly as the acting policy does. The refreshed posterior of record t is the context of record t+1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import (
    InteractionType,
    ProbabilisticTensorDictModule,
    ProbabilisticTensorDictSequential,
    TensorDictModule,
    TensorDictModuleBase,
    TensorDictSequential,
)
from torch import nn
from torchrl.data import Composite, TensorSpec, Unbounded
from torchrl.envs.model_based.dreamer import DreamerEnv
from torchrl.modules import (
    DreamerV3DiscreteActor,
    DreamerV3ImageDecoder,
    DreamerV3ImageEncoder,
    DreamerV3MLP,
    RSSMStateEstimatorV3,
    SymExpTwoHot,
    WorldModelWrapper,
)
from torchrl.modules.distributions.continuous import IndependentNormal
from torchrl.modules.models.model_based import RSSMPosteriorV3, RSSMPriorV3, RSSMRolloutV3
from torchrl.objectives import (
    DreamerV3ActorLoss,
    DreamerV3Loss,
    DreamerV3ModelLoss,
    DreamerV3ValueLoss,
    SoftUpdate,
    symexp,
    symlog,
)
from torchrl.objectives.utils import ValueEstimators

IMAGE_KEY = "pixels"


@dataclass(frozen=True)
class ModelSize:
    """Network dimensions (the reference's names) and layer counts: the `model:` section of the config
    (configs/config.yaml and configs/model/<size>.yaml hold the values; dreamer.config builds these)."""

    deter: int
    hidden: int
    stoch: int
    classes: int
    depth: int
    units: int
    blocks: int
    enc_layers: int
    dec_layers: int
    head_layers: int
    actor_layers: int
    critic_layers: int
    imag_layers: int
    obs_layers: int
    dyn_layers: int
    recurrent: str
    unimix: float
    bins: int
    mults: tuple[int, ...]
    kernel: int
    # model.cnn_full_res: the encoder's first convolution and the decoder's last unstrided, at the image's full
    # resolution (the reference's CNNs when it made its published curves, with mults 1, 2, 3, 4, 4)
    cnn_full_res: bool = False

    @property
    def latent(self) -> int:
        return self.stoch * self.classes

    @property
    def feature(self) -> int:
        return self.latent + self.deter


@dataclass(frozen=True)
class LossSettings:
    """The `loss:` section of the config (configs/config.yaml holds the defaults; dreamer.config builds these)."""

    horizon: float
    imag_length: int
    lmbda: float
    entropy: float
    kl_dynamic: float
    kl_representation: float
    free_nats: float
    replay_value: float
    slow_critic: float
    slow_critic_tau: float
    return_norm_rate: float
    # How the reward and value heads' 255 logits read as a scalar (dreamer.losses.TwoHot): "symexp", the
    # reference's symexp_twohot (bins symexp-spaced in raw values, the two-hot target and the expectation
    # linear in raw values; torchrl's functions), or "symlog", its symlog_and_twohot alternative (the
    # target and the expectation in symlog space, then symexp).
    two_hot: str = "symexp"  # the default also for a run folder whose config.yaml predates the setting
    # How the actor learns (dreamer.losses.Losses): "reinforce", the reference's current agent for every
    # action (log pi times the normalized advantage), or "backprop", its earlier agent's way for continuous
    # actions (the normalized λ-return itself, differentiated through the frozen model's imagined steps).
    actor_grad: str = "reinforce"
    # What the continue head learns (dreamer.losses.Losses): "discounted", the reference's target, the flag
    # "not terminated" times the discount 1 - 1 / horizon, the returns taking the head's prediction as their
    # whole discount; or "flag", torchrl's loss's, the returns then discounting by 1 - 1 / horizon.
    continue_target: str = "flag"  # for a run folder whose config.yaml predates the setting (configs/: discounted)


@dataclass(frozen=True)
class EnvLayout:
    """What the networks need to know about an environment."""

    vector_keys: tuple[str, ...]  # flat float observations, concatenated in this order
    vector_dim: int
    image_shape: tuple[int, int, int] | None  # (C, H, W) uint8 under IMAGE_KEY
    action_dim: int
    discrete: bool
    vector_sizes: tuple[int, ...] = ()  # width of each vector key

    @classmethod
    def from_specs(cls, observation_spec: Composite, action_spec: TensorSpec) -> EnvLayout:
        vector_keys, vector_sizes, vector_dim, image_shape = [], [], 0, None
        for key in sorted(observation_spec.keys()):
            spec = observation_spec[key]
            if key == IMAGE_KEY:
                image_shape = tuple(spec.shape[-3:])
            elif spec.dtype.is_floating_point and spec.ndim == 1:
                vector_keys.append(key)
                vector_sizes.append(int(spec.shape[-1]))
                vector_dim += spec.shape[-1]
        if not vector_keys and image_shape is None:
            raise ValueError(
                f"the environment has no usable observation: expected '{IMAGE_KEY}' [C, H, W] or flat float "
                f"vectors, got {list(observation_spec.keys())}"
            )
        discrete = "OneHot" in type(action_spec).__name__
        return cls(tuple(vector_keys), vector_dim, image_shape, int(action_spec.shape[-1]), discrete,
                   tuple(vector_sizes))

    def describe(self) -> str:
        """In words: e.g. "image 3 x 64 x 64 and a vector of 24; 6 continuous actions"."""
        seen = []
        if self.image_shape is not None:
            seen.append("image " + " x ".join(str(n) for n in self.image_shape))
        if self.vector_keys:
            seen.append(f"a vector of {self.vector_dim}")
        kind = "discrete" if self.discrete else "continuous"
        return f"{' and '.join(seen)}; {self.action_dim} {kind} action{'s' if self.action_dim > 1 else ''}"


class Encoder(nn.Module):
    """Symlog MLP for the vector observations and the DreamerV3 CNN for the image; embeddings concatenated."""

    def __init__(self, layout: EnvLayout, size: ModelSize):
        super().__init__()
        self.mlp = (
            DreamerV3MLP(layout.vector_dim, None, depth=size.enc_layers, num_cells=size.units)
            if layout.vector_keys
            else None
        )
        self.cnn = None
        self.out_features = size.units if self.mlp is not None else 0
        if layout.image_shape is not None:
            _check_image_size(layout.image_shape, size)
            self.cnn = DreamerV3ImageEncoder(
                layout.image_shape[0], depth=size.depth, mults=tuple(size.mults), kernel_size=size.kernel
            )
            channels, height, width = layout.image_shape
            if size.cnn_full_res:  # the first convolution unstrided; its padding (kernel // 2) keeps the size
                self.cnn.layers[0].stride = (1, 1)
                height, width = 2 * height, 2 * width  # as if one strided stage more had halved the image
            self.out_features += self.cnn.output_features((channels, height, width))

    def forward(self, *observations: torch.Tensor) -> torch.Tensor:
        # Argument order: the vector keys, then the image (when present).
        parts = []
        if self.mlp is not None:
            vectors = observations[: len(observations) - (self.cnn is not None)]
            parts.append(self.mlp(symlog(torch.cat([v.float() for v in vectors], -1))))
        if self.cnn is not None:
            parts.append(self.cnn(observations[-1]))
        return torch.cat(parts, -1) if len(parts) > 1 else parts[0]


class VectorDecoder(nn.Module):
    """Predicts the vector observations in symlog space; returned in raw space for the symlog loss."""

    def __init__(self, layout: EnvLayout, size: ModelSize):
        super().__init__()
        self.mlp = DreamerV3MLP(size.feature, layout.vector_dim, depth=size.dec_layers, num_cells=size.units)

    def forward(self, state: torch.Tensor, belief: torch.Tensor) -> torch.Tensor:
        return symexp(self.mlp(state, belief).float())


class ImageDecoder(nn.Module):
    def __init__(self, layout: EnvLayout, size: ModelSize):
        super().__init__()
        channels, height, width = layout.image_shape
        _check_image_size(layout.image_shape, size)
        scale = 2 if size.cnn_full_res else 1  # full resolution: the stages sized for an image twice as large,
        self.net = DreamerV3ImageDecoder(       # the last one unstrided
            size.feature,
            image_shape=(channels, scale * height, scale * width),
            depth=size.depth,
            mults=tuple(size.mults),
            kernel_size=size.kernel,
            num_blocks=size.blocks,
        )
        if size.cnn_full_res:
            self.net.layers[-1].stride, self.net.layers[-1].output_padding = (1, 1), (0, 0)
        if layout.image_shape[0] == 1:
            self.net.layers[-1].register_forward_pre_hook(_contiguous_input)

    def forward(self, state: torch.Tensor, belief: torch.Tensor) -> torch.Tensor:
        return self.net(state, belief).float()


def image_size_problem(image_shape: tuple[int, int, int], size: ModelSize) -> str | None:
    """What is wrong with an image of `image_shape` (C, H, W) for the CNNs of `size`, in one line; None if fine."""
    strided = len(size.mults) - size.cnn_full_res
    factor = 2 ** strided
    if image_shape[1] % factor or image_shape[2] % factor:
        return (f"the image's height and width {tuple(image_shape[1:])} must be divisible by {factor}: the CNNs "
                f"have {strided} strided stages (model.mults={list(size.mults)}, model.cnn_full_res="
                f"{str(size.cnn_full_res).lower()}); use fewer multipliers or another env.size")
    return None


def _check_image_size(image_shape: tuple[int, int, int], size: ModelSize) -> None:
    if problem := image_size_problem(image_shape, size):
        raise ValueError(problem)


def _contiguous_input(layer: nn.Module, args: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
    """The last transposed convolution of a one-channel (grey) decoder takes an NCHW input. The channel
    norm before it gives NHWC maps, and on CUDA, compiled, the convolution's backward then fails inductor's
    stride check: its meta kernel predicts the input's gradient in the input's layout (NHWC), while cuDNN
    computes that gradient from the one-channel output's gradient, which is NCHW (`atari`, 1 x 96 x 96;
    BENCHMARKS.md). One copy of the maps per forward."""
    return (args[0].contiguous(),)


class Head(nn.Module):
    """MLP on (state, belief) with float32 output; `outscale=0` starts reward and value at zero."""

    def __init__(self, size: ModelSize, out: int, layers: int, outscale: float = 1.0):
        super().__init__()
        self.mlp = DreamerV3MLP(size.feature, out, depth=layers, num_cells=size.units, outscale=outscale)

    def forward(self, state: torch.Tensor, belief: torch.Tensor) -> torch.Tensor:
        return self.mlp(state, belief).float()


class ContinuousActor(nn.Module):
    """Normal policy, mean squashed by tanh and std bounded to [0.1, 1] (the reference's bounded normal)."""

    def __init__(self, size: ModelSize, action_dim: int, min_std: float = 0.1, max_std: float = 1.0):
        super().__init__()
        self.mlp = DreamerV3MLP(size.feature, 2 * action_dim, depth=size.actor_layers, num_cells=size.units)
        with torch.no_grad():
            self.mlp.model[-1].weight.mul_(0.01)
        self.min_std, self.max_std = min_std, max_std

    def forward(self, state: torch.Tensor, belief: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, std = self.mlp(state, belief).float().chunk(2, -1)
        std = (self.max_std - self.min_std) * torch.sigmoid(std + 2.0) + self.min_std
        return mean.tanh(), std


def output_groups(nets: Networks, layout: EnvLayout, params: list[torch.nn.Parameter], per_output: bool
                  ) -> tuple[dict[int, list[int]], int]:
    """For LaProp: {index in `params`: its rows' sizes per output} of the output layers whose rows feed
    different outputs (`per_output` only, else {}): the continuous actor's mean and spread, the vector
    decoder's observations (more than one); the reference gives each output a layer of its own
    (`optimizer.agc_per_output`). And the index of the actor's output weight (its clipping is a metric)."""
    groups = {}
    if per_output and isinstance(nets.actor_net, ContinuousActor):
        last = nets.actor_net.mlp.model[-1]
        groups[id(last.weight)] = groups[id(last.bias)] = [layout.action_dim] * 2
    if per_output and nets.vector_decoder is not None and len(layout.vector_sizes) > 1:
        last = nets.vector_decoder.mlp.model[-1]
        groups[id(last.weight)] = groups[id(last.bias)] = list(layout.vector_sizes)
    actor_weight = [p for p in nets.actor_net.parameters() if p.dim() == 2][-1]  # its output layer's
    return ({i: groups[id(p)] for i, p in enumerate(params) if id(p) in groups},
            next(i for i, p in enumerate(params) if p is actor_weight))


def record_zeros(layout: EnvLayout, size: ModelSize, shape: tuple[int, ...] = ()) -> TensorDict:
    """A replay record of zeros (the layout of this module's docstring) with batch dimensions `shape`:
    the one spelling of the record that collection, the inference server's requests and the learner's
    warm-up batch share."""
    observation = {key: torch.zeros(*shape, width) for key, width in zip(layout.vector_keys, layout.vector_sizes)}
    if layout.image_shape is not None:
        observation[IMAGE_KEY] = torch.zeros(*shape, *layout.image_shape, dtype=torch.uint8)
    flag = torch.zeros(*shape, 1, dtype=torch.bool)
    return TensorDict(
        state=torch.zeros(*shape, size.latent),
        belief=torch.zeros(*shape, size.deter),
        action=torch.zeros(*shape, layout.action_dim),
        is_init=flag.clone(),
        next=TensorDict(**observation, reward=torch.zeros(*shape, 1), done=flag.clone(), terminated=flag.clone(),
                        batch_size=shape),
        batch_size=shape,
    )


def _observation_keys(layout: EnvLayout, prefix: tuple[str, ...] = ()) -> list:
    keys = list(layout.vector_keys) + ([IMAGE_KEY] if layout.image_shape is not None else [])
    return [(*prefix, key) if prefix else key for key in keys]


class ActingPolicy(TensorDictModuleBase):
    """The policy that acts in the real environments.

    Reads a record's root carry (state, belief, previous action, is_init) and its `next` observations,
    writes the posterior ("policy", "state" / "belief") and the action ("policy", "action"). It shares
    every parameter with the trained world model and actor.
    """

    def __init__(self, encoder: TensorDictModule, estimator: RSSMStateEstimatorV3, actor: TensorDictModuleBase,
                 bf16: bool = False):
        super().__init__()
        self.encoder = encoder
        self.estimator = estimator
        self.actor = actor
        # run.acting_precision=bf16: every product under bfloat16 autocast and the carry (state, belief) rounded
        # to bfloat16 after each step, as the reference acts; the answer goes out as float32
        self.bf16 = bf16
        self.in_keys = [*encoder.in_keys, "state", "belief", "action", "is_init"]
        self.out_keys = [("policy", "state"), ("policy", "belief"), ("policy", "action")]

    @torch.no_grad()
    def forward(self, record: TensorDictBase) -> TensorDictBase:
        work = record.select(*self.in_keys, strict=True).copy()
        work.rename_key_("action", "previous_action")
        if not self.bf16:  # the default: nothing added to the acting step
            self._act(work)
            record.set("policy", work.select("state", "belief", "action"))
            return record
        # cache_enabled=False: no cast of a weight outlives the call (the server replays the call as a CUDA graph)
        device = next(self.actor.parameters()).device.type  # where the policy computes
        with torch.autocast(device, dtype=torch.bfloat16, cache_enabled=False):
            self._act(work)
        answer = work.select("state", "belief", "action")
        # eager, so the cast pair rounds (a compiler could fold it away)
        answer.update({key: answer.get(key).to(torch.bfloat16).float() for key in ("state", "belief")})
        if answer.get("action").is_floating_point():
            answer.set("action", answer.get("action").float())
        record.set("policy", answer)
        return record

    def _act(self, work: TensorDictBase) -> None:
        self.encoder(work)
        work.set("encoded_latents", work.get(("next", "encoded_latents")))
        self.estimator(work)
        self.actor(work)


@dataclass
class Agent:
    layout: EnvLayout
    size: ModelSize
    networks: Networks

    @property
    def policy(self) -> ActingPolicy:
        return self.networks.policy


def _module(net: nn.Module, in_keys: list, out_keys: list) -> TensorDictModule:
    return TensorDictModule(net, in_keys=in_keys, out_keys=out_keys)


@dataclass
class Networks:
    """Every parameter of the agent, wired as torchrl modules (no losses yet)."""

    world_model: TensorDictSequential
    imagination: DreamerEnv
    continuation: TensorDictSequential
    actor: TensorDictModuleBase
    critic: TensorDictSequential
    policy: ActingPolicy
    reconstruction: tuple[list, list, list]  # targets, predictions, symlog flags for the model loss
    prior: RSSMPriorV3  # shared with the world model: imagination and open-loop predictions
    image_decoder: ImageDecoder | None
    # The same modules as plain tensor-in, tensor-out networks, for the learner's fused step.
    encoder: Encoder
    posterior: RSSMPosteriorV3
    vector_decoder: VectorDecoder | None
    reward_head: Head
    continue_head: Head
    critic_head: Head
    actor_net: nn.Module  # discrete: log-probabilities (unimix); continuous: (mean, std)
    # Every trained network once, by name: what the learner optimizes (in this order) and checkpoints.
    trained: nn.ModuleDict

    def parameter_count(self) -> int:
        """World model, actor and critic (shared modules counted once)."""
        return sum(p.numel() for p in self.trained.parameters())


def build_networks(layout: EnvLayout, size: ModelSize, acting_bf16: bool = False) -> Networks:
    """Builds the networks on the current default device (meta works, for counting), in float32."""
    features = [("next", "state"), ("next", "belief")]

    # World model: encoder -> RSSM rollout -> decoders, reward and continue heads.
    encoder = Encoder(layout, size)
    prior = RSSMPriorV3(
        hidden_dim=size.hidden,
        rnn_hidden_dim=size.deter,
        num_categoricals=size.stoch,
        num_classes=size.classes,
        action_dim=layout.action_dim,
        action_shape=(layout.action_dim,),
        recurrent_model=size.recurrent,
        num_blocks=size.blocks,
        num_layers=size.dyn_layers,
        prior_num_layers=size.imag_layers,
        unimix=size.unimix,
    )
    posterior = RSSMPosteriorV3(
        hidden_dim=size.hidden,
        num_categoricals=size.stoch,
        num_classes=size.classes,
        rnn_hidden_dim=size.deter,
        obs_embed_dim=encoder.out_features,
        use_rms_norm=True,
        num_layers=size.obs_layers,
        unimix=size.unimix,
    )
    rollout = RSSMRolloutV3(
        _module(prior, ["state", "belief", "action"],
                [("next", "prior_logits"), ("next", "state"), ("next", "belief")]),
        _module(posterior, [("next", "belief"), ("next", "encoded_latents")],
                [("next", "posterior_logits"), ("next", "state")]),
        reset_key="is_init",
    )
    reward_net = Head(size, size.bins, size.head_layers, outscale=0.0)
    continue_net = Head(size, 1, size.head_layers)
    reward_decoder = SymExpTwoHot(size.bins)
    parts = [
        _module(encoder, _observation_keys(layout, ("next",)), [("next", "encoded_latents")]),
        rollout,
    ]
    targets, predictions, use_symlog = [], [], []
    vector_decoder = VectorDecoder(layout, size) if layout.vector_keys else None
    if vector_decoder is not None:
        parts.append(_module(vector_decoder, features, [("next", "reco_vector")]))
        # The loss compares each vector key with its slice of the prediction.
        targets.append("vector_target")
        predictions.append("reco_vector")
        use_symlog.append(True)
    image_decoder = ImageDecoder(layout, size) if layout.image_shape is not None else None
    if image_decoder is not None:
        parts.append(_module(image_decoder, features, [("next", "reco_pixels")]))
        targets.append(IMAGE_KEY)
        predictions.append("reco_pixels")
        use_symlog.append(False)
    parts += [
        _module(reward_net, features, [("next", "reward_logits")]),
        _module(reward_decoder, [("next", "reward_logits")], [("next", "reward")]),
        _module(continue_net, features, [("next", "continue_pred")]),
    ]
    if layout.vector_keys:
        parts.insert(0, _module(_Concat(), [("next", k) for k in layout.vector_keys], [("next", "vector_target")]))
    world_model = TensorDictSequential(*parts)

    # Imagination: the same prior, reward and continue networks on flat (state, belief).
    imagination = WorldModelWrapper(
        _module(prior, ["state", "belief", "action"], ["_", "state", "belief"]),
        TensorDictSequential(
            _module(reward_net, ["state", "belief"], ["reward_logits"]),
            _module(reward_decoder, ["reward_logits"], ["reward"]),
        ),
    )
    continuation = TensorDictSequential(
        _module(continue_net, ["state", "belief"], ["continue_logits"]),
        _module(nn.Sigmoid(), ["continue_logits"], ["continuation"]),
    )
    dream = DreamerEnv(
        imagination,
        prior_shape=torch.Size([size.latent]),
        belief_shape=torch.Size([size.deter]),
        device=torch.get_default_device(),
    )
    dream.observation_spec = Composite(state=Unbounded(size.latent), belief=Unbounded(size.deter))
    dream.state_spec = dream.observation_spec.clone()
    dream.action_spec = Unbounded(layout.action_dim)
    dream.reward_spec = Unbounded(1)

    if layout.discrete:
        actor = DreamerV3DiscreteActor(
            size.feature, layout.action_dim, depth=size.actor_layers, num_cells=size.units, unimix=size.unimix
        )
        actor_net = actor.module[0].module
    else:
        actor_net = ContinuousActor(size, layout.action_dim)
        actor = ProbabilisticTensorDictSequential(
            _module(actor_net, ["state", "belief"], ["loc", "scale"]),
            ProbabilisticTensorDictModule(
                in_keys=["loc", "scale"],
                out_keys=["action"],
                distribution_class=IndependentNormal,
                default_interaction_type=InteractionType.RANDOM,
                return_log_prob=True,
                log_prob_key="action_log_prob",
            ),
        )
    critic_head = Head(size, size.bins, size.critic_layers, outscale=0.0)
    critic = TensorDictSequential(
        _module(critic_head, ["state", "belief"], ["state_value_logits"]),
        _module(SymExpTwoHot(size.bins), ["state_value_logits"], ["state_value"]),
    )
    acting_encoder = _module(encoder, _observation_keys(layout, ("next",)), [("next", "encoded_latents")])
    policy = ActingPolicy(acting_encoder, RSSMStateEstimatorV3(prior, posterior), actor, bf16=acting_bf16)
    trained = {"encoder": encoder, "prior": prior, "posterior": posterior, "vector_decoder": vector_decoder,
               "image_decoder": image_decoder, "reward_head": reward_net, "continue_head": continue_net,
               "actor": actor_net, "critic_head": critic_head}
    trained = nn.ModuleDict({name: net for name, net in trained.items() if net is not None})
    return Networks(world_model, dream, continuation, actor, critic, policy, (targets, predictions, use_symlog),
                    prior, image_decoder, encoder, posterior, vector_decoder, reward_net, continue_net, critic_head,
                    actor_net, trained)


def build_agent(layout: EnvLayout, size: ModelSize, acting_bf16: bool = False) -> Agent:
    """Builds the agent's networks on the current default device, in float32; `acting_bf16`: the acting
    policy computes under bfloat16 autocast (run.acting_precision=bf16)."""
    return Agent(layout, size, build_networks(layout, size, acting_bf16))


def torchrl_loss(agent: Agent, loss: LossSettings) -> tuple[DreamerV3Loss, SoftUpdate]:
    """torchrl's DreamerV3 losses and slow-critic update on the agent's own parameters (shared, not copied;
    the slow critic and the return normalization are the loss's own buffers).

    A training run never builds it: dreamer.learner computes the losses itself. It is the learner's test
    oracle (tests/test_learner.py, the torchrl variants of scripts/bench_learner.py), and it reads
    checkpoints of the learner's first format, which saved this module's state dict. Its continue head
    learns the flag: the learner's losses equal it at `loss.continue_target=flag`."""
    nets = agent.networks
    targets, predictions, use_symlog = nets.reconstruction
    model_loss = DreamerV3ModelLoss(
        nets.world_model,
        lambda_continue=1.0,
        kl_mode="separate",
        lambda_dynamic=loss.kl_dynamic,
        lambda_representation=loss.kl_representation,
        unimix=agent.size.unimix,
        free_bits=loss.free_nats,
        reco_symlog=use_symlog,
        num_reward_bins=agent.size.bins,
        detach_output=False,
    )
    model_loss.set_keys(pixels=targets, reco_pixels=predictions)
    actor_loss = DreamerV3ActorLoss(
        nets.actor,
        nets.critic,
        nets.imagination,
        continuation_model=nets.continuation,
        imagination_horizon=loss.imag_length,
        entropy_bonus=loss.entropy,
        # The reference trains both discrete and continuous actors with REINFORCE.
        use_reinforce=True,
        return_normalization_rate=loss.return_norm_rate,
    )
    actor_loss.make_value_estimator(ValueEstimators.TDLambda, gamma=1.0 - 1.0 / loss.horizon, lmbda=loss.lmbda)
    value_loss = DreamerV3ValueLoss(
        nets.critic,
        value_loss="two_hot",
        num_value_bins=agent.size.bins,
        actor_loss=actor_loss,
        slow_critic_regularization=loss.slow_critic,
    )
    full_loss = DreamerV3Loss(
        model_loss,
        actor_loss,
        value_loss,
        replay_value_loss_weight=loss.replay_value,
        continuation_horizon=loss.horizon,
        lmbda=loss.lmbda,
    )
    return full_loss, SoftUpdate(value_loss, tau=loss.slow_critic_tau)


class _Concat(nn.Module):
    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return torch.cat([t.float() for t in tensors], -1) if len(tensors) > 1 else tensors[0].float()

