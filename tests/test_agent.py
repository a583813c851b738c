"""Networks and one learner update."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import Bounded, Composite, OneHot, Unbounded

from dreamer.agent import EnvLayout, LossSettings, ModelSize, build_agent, build_networks, image_size_problem
from dreamer.config import reference_settings
from dreamer.learner import Learner
from dreamer.optim import OptimizerSettings

VECTOR = EnvLayout.from_specs(Composite(observation=Unbounded(4)), OneHot(2))
IMAGE = EnvLayout.from_specs(Composite(pixels=Bounded(0, 255, (3, 64, 64), dtype=torch.uint8)), OneHot(17))
# Golden parameter counts (world model + actor + critic). A change here changes every checkpoint.
PINNED = {
    "size1m": (637_381, 642_307),
    "size12m": (9_724_165, 9_775_315),
    "size25m": (21_762_181, 21_870_387),
    "size50m": (38_584_325, 38_770_579),
    "size100m": (86_580_997, 86_986_323),
    "size200m": (153_714_181, 154_422_547),
    "size400m": (345_390_085, 346_956_435),
    "tiny": (357_573, 370_691),
}


def _size(name: str, **changes) -> ModelSize:
    """A model size of configs/ (the reference's layer counts), with `changes`."""
    return replace(reference_settings(name)[0], **changes)


def _loss(**changes) -> LossSettings:
    """The reference's loss settings (configs/), with `changes`."""
    return replace(reference_settings()[1], **changes)


def _optimizer(**changes) -> OptimizerSettings:
    """The reference's optimizer settings (configs/), with `changes`."""
    return replace(reference_settings()[2], **changes)


@pytest.mark.parametrize("name", sorted(PINNED))
def test_parameter_counts_are_pinned(name):
    with torch.device("meta"):  # counts without allocating 400M parameters
        vector = build_networks(VECTOR, _size(name)).parameter_count()
        image = build_networks(IMAGE, _size(name)).parameter_count()
    assert (vector, image) == PINNED[name]


def test_layout_reads_the_specs():
    mixed = Composite(pixels=Bounded(0, 255, (3, 64, 64), dtype=torch.uint8), vector=Unbounded(7),
                      step_count=Unbounded(1, dtype=torch.int64))
    layout = EnvLayout.from_specs(mixed, Bounded(-1, 1, (3,)))
    assert layout.vector_keys == ("vector",) and layout.vector_dim == 7
    assert layout.image_shape == (3, 64, 64) and layout.action_dim == 3 and not layout.discrete
    with pytest.raises(ValueError, match="no usable observation"):
        EnvLayout.from_specs(Composite(step_count=Unbounded(1, dtype=torch.int64)), OneHot(2))


def _batch(layout: EnvLayout, size: ModelSize, batch: int, length: int) -> TensorDict:
    nxt = {"reward": torch.randn(batch, length, 1), "done": torch.zeros(batch, length, 1, dtype=torch.bool),
           "terminated": torch.zeros(batch, length, 1, dtype=torch.bool)}
    for key in layout.vector_keys:
        nxt[key] = torch.randn(batch, length, layout.vector_dim)
    if layout.image_shape:
        nxt["pixels"] = torch.randint(0, 256, (batch, length, *layout.image_shape), dtype=torch.uint8)
    nxt["done"][:, -1] = True
    nxt["terminated"][0, -1] = True
    is_init = torch.zeros(batch, length, 1, dtype=torch.bool)
    is_init[:, 0] = True
    action = torch.nn.functional.one_hot(torch.randint(0, layout.action_dim, (batch, length)), layout.action_dim)
    return TensorDict({"state": torch.zeros(batch, length, size.latent), "belief": torch.zeros(batch, length, size.deter),
                       "action": action.float(), "is_init": is_init, "next": nxt}, [batch, length])


FULL_RES = dict(mults=(1, 2, 3, 4, 4), cnn_full_res=True)  # the reference's CNNs at 2411f7d


def _maps(convs: list[torch.nn.Module], run) -> list[tuple[int, ...]]:
    """(channels, height, width) of each of `convs`' outputs while `run()` runs."""
    shapes = []
    hooks = [conv.register_forward_hook(lambda _m, _i, out: shapes.append(tuple(out.shape[-3:]))) for conv in convs]
    run()
    for hook in hooks:
        hook.remove()
    return shapes


def test_full_resolution_cnns_are_the_reference_curves_layout():
    """model.cnn_full_res with mults (1, 2, 3, 4, 4), size12m's depth 16: the encoder's first convolution keeps
    64 x 64 and four strided ones reach 4 x 4 (the reference's encoder at 2411f7d); the decoder mirrors it, its
    last transposed convolution unstrided at 64 x 64. Without the setting, four strided stages each way."""
    for full_res, mults, encoder_maps, decoder_maps in [
        (True, (1, 2, 3, 4, 4), [(16, 64, 64), (32, 32, 32), (48, 16, 16), (64, 8, 8), (64, 4, 4)],
         [(64, 8, 8), (48, 16, 16), (32, 32, 32), (16, 64, 64), (3, 64, 64)]),
        (False, (2, 3, 4, 4), [(32, 32, 32), (48, 16, 16), (64, 8, 8), (64, 4, 4)],
         [(64, 8, 8), (48, 16, 16), (32, 32, 32), (3, 64, 64)]),
    ]:
        size = _size("size12m", mults=mults, cnn_full_res=full_res)
        nets = build_networks(IMAGE, size)
        cnn, decoder = nets.encoder.cnn, nets.image_decoder.net
        convs = [m for m in cnn.layers if isinstance(m, torch.nn.Conv2d)]
        image = torch.randint(0, 256, (2, *IMAGE.image_shape), dtype=torch.uint8)
        embed = []
        assert _maps(convs, lambda: embed.append(nets.encoder(image))) == encoder_maps
        assert embed[0].shape == (2, nets.encoder.out_features) == (2, 64 * 4 * 4)
        transposed = [m for m in decoder.layers if isinstance(m, torch.nn.ConvTranspose2d)]
        out = []
        assert _maps(transposed, lambda: out.append(nets.image_decoder(torch.randn(2, size.latent),
                                                                       torch.randn(2, size.deter)))) == decoder_maps
        assert out[0].shape == (2, *IMAGE.image_shape)
    assert image_size_problem((3, 64, 64), _size("size12m", mults=(1, 2, 3, 4, 4), cnn_full_res=True)) is None
    problem = image_size_problem((3, 72, 72), _size("size12m", **FULL_RES))
    assert problem.startswith("the image's height and width (72, 72) must be divisible by 16: the CNNs have 4 strided")
    assert image_size_problem((3, 72, 72), _size("size12m", mults=(3, 4, 4))) is None  # 3 strided: 72 / 8
    wide = EnvLayout.from_specs(Composite(pixels=Bounded(0, 255, (3, 72, 72), dtype=torch.uint8)), OneHot(3))
    with pytest.raises(ValueError, match="must be divisible by 16"):
        build_networks(wide, _size("size12m", **FULL_RES))


@pytest.mark.parametrize("layout, cnn", [(VECTOR, {}), (IMAGE, {}), (IMAGE, FULL_RES)],
                         ids=["vector", "image", "image-full-res"])
def test_one_update_has_finite_losses_and_changes_parameters(layout, cnn):
    torch.manual_seed(0)
    size = _size("size1m", deter=64, hidden=16, classes=4, stoch=4, units=16, depth=2, blocks=4, **cnn)
    agent = build_agent(layout, size)
    learner = Learner(agent, _loss(imag_length=4), _optimizer(lr=1e-3, warmup=0), "cpu")
    before = [p.detach().clone() for p in learner.params]
    # Reward and value heads start with zero output weights (outscale 0): their hidden layers get a
    # gradient from the second update on.
    learner.update(_batch(layout, size, 3, 6))
    state, belief = learner.update(_batch(layout, size, 3, 6))
    metrics = learner.drain()
    losses = {k: v for k, v in metrics.items() if k.startswith("train/loss_")}
    assert {"train/loss_model_reco", "train/loss_model_reward", "train/loss_model_dynamic", "train/loss_actor",
            "train/loss_value", "train/loss_replay_value", "train/loss_model_continue"} <= set(losses)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    changed = [not torch.equal(a, b.detach()) for a, b in zip(before, learner.params)]
    assert all(changed)
    assert state.shape[:2] == belief.shape[:2] == torch.Size([3, 6]) and not state.requires_grad
    # Categorical latents: each of the `stoch` groups is one-hot.
    assert torch.allclose(state.reshape(3, 6, size.stoch, size.classes).sum(-1), torch.ones(3, 6, size.stoch))


def test_acting_policy_resets_the_carry_on_is_init():
    torch.manual_seed(0)
    size = _size("size1m", deter=32, hidden=16, classes=4, stoch=4, units=16, blocks=4)
    agent = build_agent(VECTOR, size)
    record = TensorDict({"state": torch.randn(2, size.latent), "belief": torch.randn(2, size.deter),
                         "action": torch.tensor([[1.0, 0.0], [0.0, 1.0]]), "is_init": torch.tensor([[True], [True]]),
                         "next": {"observation": torch.ones(2, 4)}}, [2])
    out = agent.policy(record.clone()).get("policy")
    # Both rows are resets with the same observation: their beliefs no longer depend on the old carry.
    assert torch.allclose(out.get("belief")[0], out.get("belief")[1])
    assert out.get("action").shape == (2, 2) and torch.all(out.get("action").sum(-1) == 1)


def test_bf16_acting_computes_in_bfloat16_and_rounds_the_carry():
    """run.acting_precision=bf16 (the reference acts in bfloat16): the products under bfloat16 autocast, the
    carry rounded to bfloat16, every answer float32; the float32 policy on the same weights differs."""
    from tensordict.nn import InteractionType, set_interaction_type

    from dreamer.agent import record_zeros

    torch.manual_seed(0)
    layout = EnvLayout.from_specs(Composite(observation=Unbounded(5)), Bounded(-1, 1, (2,)))
    size = _size("size1m", deter=64, hidden=16, classes=4, stoch=4, units=16, blocks=4)
    fp32, bf16 = build_agent(layout, size), build_agent(layout, size, acting_bf16=True)
    bf16.networks.trained.load_state_dict(fp32.networks.trained.state_dict())
    record = record_zeros(layout, size).expand(6).clone()
    record["next", "observation"] = torch.randn(6, 5)
    record["belief"] = torch.randn(6, size.deter)
    record["action"] = torch.rand(6, 2) * 2 - 1
    with set_interaction_type(InteractionType.DETERMINISTIC):
        wide = fp32.policy(record.clone()).get("policy")
        narrow = bf16.policy(record.clone()).get("policy")
    assert all(narrow.get(key).dtype == torch.float32 for key in ("state", "belief", "action"))
    belief = narrow.get("belief")
    assert torch.equal(belief, belief.to(torch.bfloat16).float())  # rounded
    assert not torch.equal(wide.get("belief"), wide.get("belief").to(torch.bfloat16).float())
    # The products themselves in bfloat16: not only the float32 answer rounded afterwards.
    assert not torch.equal(belief, wide.get("belief").to(torch.bfloat16).float())
    torch.testing.assert_close(belief, wide.get("belief"), atol=0.05, rtol=0.05)
    torch.testing.assert_close(narrow.get("action"), wide.get("action"), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("layout", [VECTOR, IMAGE], ids=["vector", "image"])
def test_the_trained_networks_hold_every_parameter_of_the_agent_once(layout):
    """`Networks.trained` is what the learner optimizes and checkpoints: the world model's, the actor's and
    the critic's parameters, each once, nothing else (the torchrl modules share them)."""
    size = _size("size1m", deter=32, hidden=16, classes=4, stoch=4, units=16, blocks=4)
    nets = build_agent(layout, size).networks
    modules = torch.nn.ModuleList([nets.world_model, nets.actor, nets.critic, nets.policy])
    trained = list(nets.trained.parameters())
    assert len({id(p) for p in trained}) == len(trained)
    assert {id(p) for p in trained} == {id(p) for p in modules.parameters()}
    assert nets.parameter_count() == sum(p.numel() for p in modules.parameters())
