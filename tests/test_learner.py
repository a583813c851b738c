"""The learner's own step against torchrl's DreamerV3 loss modules and stepper, on the same weights and batch.

Both paths draw their random numbers in the same order (RSSM uniforms, then per imagination step the
action and the prior's uniforms), so with one seed they see the same samples. Our step reorders some
sums (projections taken out of the scan), so agreement is to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torchrl.data import Bounded, Composite, Unbounded
from torchrl.trainers.algorithms import DreamerV3OptimizationStepper, DreamerV3Optimizer

from dreamer.agent import EnvLayout, build_agent, torchrl_loss
from dreamer.learner import Learner
from dreamer.losses import TwoHot
from dreamer.optim import LaProp
from dreamer.scan import round_bf16
from tests.test_agent import IMAGE, VECTOR, _batch, _loss, _optimizer, _size

CONTINUOUS = EnvLayout.from_specs(Composite(observation=Unbounded(5)), Bounded(-1, 1, (3,)))
LAYOUTS = {"vector": VECTOR, "image": IMAGE, "continuous": CONTINUOUS}


SETTINGS = _loss(imag_length=4, continue_target="flag")  # every learner here: torchrl's continue target


def _setup(layout, seed=0):
    torch.manual_seed(seed)
    size = _size("size1m", deter=64, hidden=16, classes=4, stoch=4, units=16, depth=2, blocks=4)
    agent = build_agent(layout, size)
    batch = _batch(layout, size, 3, 6)
    batch["belief"] = torch.randn_like(batch["belief"])  # a carried-over start state, reset where is_init
    batch["state"] = torch.nn.functional.one_hot(torch.randint(0, 4, (3, 6, 4)), 4).flatten(-2).float()
    batch["is_init"][1, 0] = False
    batch["is_init"][2, 3] = True
    batch["next", "reward"] = torch.randn(3, 6, 1) * 3
    return agent, batch


OUR_METRICS = ("reward_seen", "reward_real", "reward_imagined")


def _close(ours: torch.Tensor, theirs: torch.Tensor, tol: float = 2e-5) -> bool:
    return bool((ours - theirs).norm() <= tol * max(1.0, float(theirs.norm())))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_losses_and_gradients_equal_torchrl(name):
    agent, batch = _setup(LAYOUTS[name])
    learner = Learner(agent, SETTINGS, _optimizer(), "cpu")
    oracle, _ = torchrl_loss(agent, SETTINGS)  # on the same parameters; its own slow critic and return norm
    torch.manual_seed(1)
    reference = oracle(batch.clone())
    ref_total = sum(v for k, v in reference.items() if k.startswith("loss_"))
    ref_grads = torch.autograd.grad(ref_total, learner.params, allow_unused=True)

    torch.manual_seed(1)
    total, metrics, states, beliefs, scan = learner._losses(learner._inputs(batch.clone()))
    grads = learner._gradients(total, scan)

    assert _close(total.detach(), ref_total.detach())
    for key, value in metrics.items():
        if key in OUR_METRICS:  # torchrl's loss reports no such figure
            continue
        assert _close(torch.as_tensor(value).detach(), reference[key].detach()), key
    assert torch.equal(states, reference["replay_context", "state"])
    assert _close(beliefs, reference["replay_context", "belief"])
    # The same state after the update's losses: the return normalizer moved alike, the slow critics alike.
    retnorm = oracle.actor_loss.retnorm
    assert torch.equal(learner.losses.return_norm.low, retnorm.low)
    assert torch.equal(learner.losses.return_norm.high, retnorm.high)
    slow = oracle.value_loss.target_value_model_params.flatten_keys(".")
    assert all(torch.equal(p, slow["module.0.module." + n]) for n, p in learner.losses.slow_params.items())
    names = [n for n, _ in agent.networks.trained.named_parameters()]  # learner.params, in this order
    assert {id(p) for p in learner.params} == {id(p) for p in oracle.parameters() if p.requires_grad}
    for param_name, ours, theirs in zip(names, grads, ref_grads):
        assert (ours is None) == (theirs is None), param_name
        if ours is not None:
            assert _close(ours, theirs), param_name
    # The check can fail: a different start state gives different losses (reward and value heads start
    # at zero output, so a different reward alone would not show).
    torch.manual_seed(1)
    other = batch.clone()
    other["belief"] += 1
    assert not _close(learner._losses(learner._inputs(other))[0].detach(), ref_total.detach())


def test_updates_equal_torchrl_stepper():
    """Two updates (optimizer, gradient clipping, lr warm-up, slow critic) match torchrl's stepper.

    Not more: the actor's first gradients are ~1e-11 and LaProp divides each by its own RMS, so rounding
    differences become sign flips of whole lr-sized steps from the third update on (measured: 30 % of
    actor weights). The optimizer alone is compared over more steps below, on identical gradients.
    """
    agent, batch = _setup(VECTOR)
    twin, _ = _setup(VECTOR)  # same seed, same weights
    settings = _optimizer(lr=1e-3, warmup=2)
    learner = Learner(agent, SETTINGS, settings, "cpu")
    loss, slow_critic = torchrl_loss(twin, SETTINGS)
    optimizer = DreamerV3Optimizer(loss.parameters(), lr=settings.lr, agc=settings.agc, eps=settings.eps,
                                   warmup_steps=settings.warmup)
    stepper = DreamerV3OptimizationStepper(loss, optimizer, slow_critic, compile_train_step=False, cudagraph=False)
    for step in range(2):
        torch.manual_seed(10 + step)
        learner.update(batch.clone())
        torch.manual_seed(10 + step)
        stepper.step(None, batch.clone())
    ours = dict(agent.networks.trained.named_parameters())
    bad = [name for name, theirs in twin.networks.trained.named_parameters()
           if not _close(ours[name].detach(), theirs.detach(), 1e-4)]
    assert not bad, bad
    slow = learner.losses.slow_params
    twin_slow = loss.value_loss.target_value_model_params.flatten_keys(".")
    for name in slow:
        assert _close(slow[name], twin_slow["module.0.module." + name], 1e-4), name
    assert slow["mlp.model.9.weight"].abs().max() > 0  # the slow critic's head started at zero
    metrics = learner.drain()
    assert metrics["train/grad_norm"] > 0 and learner.drain() == {}


def test_warmup_leaves_no_trace():
    """Compiling on CPU runs real steps; the warm-up restores weights, optimizer and random state."""
    agent, batch = _setup(VECTOR)
    learner = Learner(agent, SETTINGS, _optimizer(lr=1e-3, warmup=0), "cpu", compile=False, cudagraph=False)
    learner.needs_warmup = True  # force the warm-up path without compiling (compile is for CUDA)
    before = [p.detach().clone() for p in learner.params]
    rng = torch.get_rng_state()
    assert learner.warmup(batch) >= 0
    assert all(torch.equal(a, b) for a, b in zip(before, learner.params))
    assert torch.equal(rng, torch.get_rng_state()) and learner.drain() == {}


def test_busy_seconds_count_each_update_once():
    agent, batch = _setup(VECTOR)
    learner = Learner(agent, SETTINGS, _optimizer(warmup=0), "cpu")
    assert learner.busy_seconds() == 0.0
    learner.update(batch.clone())
    learner.update(batch.clone())
    first = learner.busy_seconds()
    assert first > 0 and learner.busy_seconds() == 0.0  # read once, then reset
    learner.update(batch.clone())
    assert 0 < learner.busy_seconds() < 10 * first


def test_optimizer_equals_torchrl_on_the_same_gradients():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in [(7, 5), (5,), (3, 2, 2)]]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    settings = _optimizer(lr=1e-2, warmup=3, agc=0.3)
    ours = LaProp(params, settings)
    theirs = DreamerV3Optimizer(twins, lr=settings.lr, agc=settings.agc, eps=settings.eps, warmup_steps=settings.warmup)
    for step in range(6):
        grads = [torch.randn_like(p) * (10.0 if step == 4 else 1.0) for p in params]  # step 4 is clipped
        ours.step(grads + [None] * 0)
        for twin, grad in zip(twins, grads):
            twin.grad = grad.clone()
        theirs.step()
        for p, twin in zip(params, twins):
            assert torch.allclose(p, twin, rtol=1e-6, atol=1e-7), step
    assert not torch.allclose(params[0], twins[0] + 1e-3)


def test_clipping_per_output_clips_row_groups_as_tensors_of_their_own():
    """optimizer.agc_per_output: a parameter's row groups are clipped as separate tensors would be (the
    reference's separate output layers), and differently from the whole tensor when one group's gradient
    is large (here the first group's, so that clipping the whole would shrink the second's too)."""
    torch.manual_seed(0)
    whole = [torch.nn.Parameter(torch.randn(6, 5) * 0.01), torch.nn.Parameter(torch.randn(6) * 0.01)]
    grouped = [torch.nn.Parameter(p.detach().clone()) for p in whole]
    split = [torch.nn.Parameter(part.clone()) for p in whole for part in p.detach().split([2, 4])]
    settings = _optimizer(lr=1e-2, warmup=0, agc=0.3)
    ours, plain = LaProp(grouped, settings, {0: [2, 4], 1: [2, 4]}), LaProp(whole, settings)
    separate = LaProp(split, settings)
    for step in range(4):
        grads = [torch.randn_like(p) for p in whole]
        for g in grads:
            g[:2] *= 100.0
        norm = ours.step([g.clone() for g in grads])
        assert torch.allclose(norm, plain.step([g.clone() for g in grads]))  # the same global norm reported
        separate.step([part.clone() for g in grads for part in g.split([2, 4])])
        for p, parts in zip(grouped, [split[:2], split[2:]]):
            assert torch.allclose(p, torch.cat(parts), rtol=1e-6, atol=1e-8), step
    assert not torch.allclose(grouped[0][2:], whole[0][2:], rtol=1e-3)
    clipped, factor = ours.clip_metrics()  # every tensor's gradient is far above 0.3 x its parameters' norm
    assert clipped == 1 and 0 < factor < plain.clip_metrics()[1] < 1  # the first rows alone, then with the rest
    assert LaProp(whole, _optimizer(agc=0.0)).clip_metrics() == (0, 1)
    with pytest.raises(ValueError, match="do not add up"):
        LaProp(whole, settings, {0: [2, 3]})


def test_the_learner_groups_the_actors_mean_and_spread_when_asked():
    agent, batch = _setup(CONTINUOUS)
    learner = Learner(agent, SETTINGS, _optimizer(warmup=0, agc_per_output=True), "cpu")
    last = agent.networks.actor_net.mlp.model[-1]
    index = {id(p): i for i, p in enumerate(learner.params)}
    dim = CONTINUOUS.action_dim
    assert learner.optimizer.row_groups == {index[id(last.weight)]: [dim, dim], index[id(last.bias)]: [dim, dim]}
    learner.update(batch.clone())
    assert all(torch.isfinite(p).all() for p in learner.params)
    metrics = learner.drain()
    assert 0 <= metrics["train/agc_clipped"] <= 1 and 0 < metrics["train/agc_actor"] <= 1
    assert learner.optimizer.watched == index[id(last.weight)]
    assert Learner(agent, SETTINGS, _optimizer(), "cpu").optimizer.row_groups == {}


def test_a_state_from_an_older_learner_or_a_newer_format_is_refused_in_one_line():
    agent, _ = _setup(VECTOR)
    learner = Learner(agent, SETTINGS, _optimizer(), "cpu")
    with pytest.raises(ValueError, match="older learner"):
        learner.load_state_dict({"loss": torchrl_loss(agent, SETTINGS)[0].state_dict(), "stepper": {}, "updates": 3})
    state = copy.deepcopy(learner.state_dict())  # a saved checkpoint holds copies
    with pytest.raises(ValueError, match="format 3, not one this dreamer reads"):
        learner.load_state_dict({**state, "format": 3})
    with pytest.raises(ValueError, match="no learner state this dreamer knows"):
        learner.load_state_dict({"updates": 3})
    learner.optimizer.step_count += 5
    learner.load_state_dict(state)
    assert float(learner.optimizer.step_count) == 0


FORMAT_1 = Path(__file__).parent / "data" / "learner-format1.pt"


def test_a_state_of_the_first_format_loads_as_the_same_learner():
    """tests/data/learner-format1.pt is the `state_dict()` of the learner before it owned its losses (commit
    9980748: torchrl's DreamerV3Loss state dict, the optimizer's moments in that module's parameter order),
    after three updates of `_setup(VECTOR)`'s learner with SETTINGS, `_optimizer(lr=1e-3, warmup=0)` and
    seeds 10, 11 and 12. Loaded into a learner of other weights, it is the state of today's learner after the
    same three updates: weights, slow critic, return normalizer, and each parameter's optimizer moments. The
    loading learner's networks are listed in reverse order, so that its parameters' order differs from
    torchrl's module's (which `Networks.trained` otherwise follows): the moments must follow their parameters."""
    agent, batch = _setup(VECTOR)
    learner = Learner(agent, SETTINGS, _optimizer(lr=1e-3, warmup=0), "cpu")
    for step in range(3):
        torch.manual_seed(10 + step)
        learner.update(batch.clone())
    other, _ = _setup(VECTOR, seed=1)
    other.networks.trained = torch.nn.ModuleDict(reversed(list(other.networks.trained.items())))
    loaded = Learner(other, SETTINGS, _optimizer(lr=1e-3, warmup=0), "cpu")
    names = {id(p): n for n, p in loaded.nets.trained.named_parameters()}
    assert [names[id(p)] for p in loaded.params] != [n for n, _ in agent.networks.trained.named_parameters()]
    loaded.load_state_dict(torch.load(FORMAT_1, weights_only=True))
    expected, got = learner.state_dict(), loaded.state_dict()
    assert got["format"] == 2 and got["updates"] == 3 and float(got["optimizer"]["step"]) == 3
    for part in ("networks", "slow_critic"):
        assert expected[part].keys() == got[part].keys()
        for name, value in expected[part].items():
            assert _close(got[part][name], value, 1e-4), (part, name)
    for end in ("low", "high"):  # tiny after three updates of heads that start at zero output: relative
        value = expected["return_norm"][end]
        assert value.abs().max() > 0 and torch.allclose(got["return_norm"][end], value, rtol=1e-3, atol=0), end
    expected_names = [n for n, _ in agent.networks.trained.named_parameters()]
    for moments in ("rms", "momentum"):  # each aligned with its learner's params
        theirs = {names[id(p)]: m for p, m in zip(loaded.params, got["optimizer"][moments])}
        for name, ours in zip(expected_names, expected["optimizer"][moments]):
            assert ours.shape == theirs[name].shape and _close(theirs[name], ours, 1e-3), (moments, name)
    # The check can fail: the learner before the three updates is not what the file holds.
    fresh = Learner(_setup(VECTOR)[0], SETTINGS, _optimizer(lr=1e-3, warmup=0), "cpu").state_dict()
    assert not all(_close(fresh["networks"][n], v, 1e-4) for n, v in got["networks"].items())


def _same_two_updates(ours: Learner, reference: Learner, batch, seed: int) -> None:
    """Two updates of each learner from the same random draws: equal metrics, then equal weights."""
    for step in range(2):
        for learner in (reference, ours):
            torch.manual_seed(seed + step)
            learner.update(batch.clone())
        got, expected = ours.drain(), reference.drain()
        for key, value in expected.items():
            assert abs(got[key] - value) <= 1e-4 * max(1.0, abs(value)), (step, key, got[key], value)
    for a, b in zip(ours.params, reference.params):
        assert _close(a.detach(), b.detach(), 1e-4)


@pytest.mark.parametrize("fuse_kernels", [False, True], ids=["compiled", "fused"])
def test_compiled_step_follows_the_eager_updates_on_cpu(fuse_kernels):
    """torch.compile of the step's pieces (inductor's CPU backend here; Triton on CUDA) changes no result;
    nor does run.fuse_kernels (inductor's aggressive fusion; its combo kernels are Triton's, on CUDA)."""
    (eager_agent, batch), (compiled_agent, _) = _setup(VECTOR), _setup(VECTOR)
    eager = Learner(eager_agent, SETTINGS, _optimizer(lr=1e-3, warmup=0), "cpu")
    compiled = Learner(compiled_agent, SETTINGS, _optimizer(lr=1e-3, warmup=0), "cpu", compile=True,
                       fuse_kernels=fuse_kernels)
    assert compiled.warmup(batch) > 0 and all(piece.compiled for piece in (compiled._cell, compiled._tail))
    _same_two_updates(compiled, eager, batch, seed=20)


def _in_bf16(x: torch.Tensor) -> bool:
    return bool((x == x.bfloat16().float()).all())


def test_rounding_on_the_bits_is_the_cast_to_bf16_with_an_identity_gradient():
    """round_bf16 (run.state_precision=bf16) equals a cast to bfloat16 and back, halfway values (ties to even),
    infinities and NaN included, compiled too, and passes the gradient unchanged."""
    torch.manual_seed(0)
    values = torch.randn(100_000) * torch.logspace(-6, 2, 100_000)
    ties = (torch.randn(1000).bfloat16().float().view(torch.int32) | 0x8000).view(torch.float32)
    for x in (values, ties, torch.tensor([0.0, -0.0, 1.0, -1.0, 0.99999994, 1e-40, 3.4e38, -float("inf")])):
        assert torch.equal(round_bf16(x), x.bfloat16().float())
    nans = torch.tensor([float("nan"), -float("nan")])
    nans[1:] = (torch.tensor([-1], dtype=torch.int32)).view(torch.float32)  # all bits set: a carry would wrap
    assert round_bf16(nans).isnan().all()
    assert torch.equal(torch.compile(round_bf16)(values), values.bfloat16().float())
    x = torch.randn(5, requires_grad=True)
    (round_bf16(x) * torch.arange(5.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(5.0))


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_state_rounded_to_bf16_is_rounded_at_every_step(compile):
    """run.state_precision=bf16 (the reference's): each scan and imagination step's recurrent state is a
    bfloat16 value, compiled too; float32 keeps it unrounded, and the compiled rounding step follows the
    eager one."""
    agent, batch = _setup(VECTOR)
    rounded = Learner(agent, SETTINGS, _optimizer(lr=1e-3, warmup=0), "cpu", compile=compile, state_bf16=True)
    if compile:
        assert rounded.warmup(batch) > 0 and rounded._cell.compiled is not None
    torch.manual_seed(3)
    _, beliefs = rounded.update(batch.clone())
    assert beliefs.shape[:2] == (3, 6) and _in_bf16(beliefs)
    state = torch.nn.functional.one_hot(torch.randint(0, 4, (5, 4)), 4).flatten(-2).float()
    belief, weights = torch.randn(5, 64), rounded.scan.weights(torch.float32)
    noise, uniform = rounded.scan.imagination_noise(5), torch.rand(5, 4)
    assert _in_bf16(rounded._imagine(state, belief, noise, uniform, weights)[1])
    plain = Learner(_setup(VECTOR)[0], SETTINGS, _optimizer(lr=1e-3, warmup=0), "cpu")
    torch.manual_seed(3)
    assert not _in_bf16(plain.update(batch.clone())[1])
    assert not _in_bf16(plain._imagine(state, belief, noise, uniform, plain.scan.weights(torch.float32))[1])
    if compile:
        eager = Learner(_setup(VECTOR)[0], SETTINGS, _optimizer(lr=1e-3, warmup=0), "cpu", state_bf16=True)
        compiled = Learner(_setup(VECTOR)[0], SETTINGS, _optimizer(lr=1e-3, warmup=0), "cpu", compile=True,
                           state_bf16=True)
        compiled.warmup(batch)
        _same_two_updates(compiled, eager, batch, seed=20)


@pytest.mark.parametrize("length", [1, 7, 64])
def test_closed_form_lambda_returns_equal_torchrls_recursion(length):
    from torchrl.objectives.value.functional import td_lambda_return_estimate

    from dreamer.losses import lambda_returns

    g = torch.Generator().manual_seed(length)
    reward, value = torch.randn(5, length, 1, generator=g), torch.randn(5, length, 1, generator=g)
    done = torch.rand(5, length, 1, generator=g) < 0.15
    terminated = done & (torch.rand(5, length, 1, generator=g) < 0.5)
    expected = td_lambda_return_estimate(gamma=0.997, lmbda=0.95, next_state_value=value, reward=reward,
                                         done=done, terminated=terminated).squeeze(-1)
    got = lambda_returns(reward, value, done, terminated, gamma=0.997, lmbda=0.95)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_channels_last_cnns_change_no_result():
    (plain_agent, batch), (nhwc_agent, _) = _setup(IMAGE), _setup(IMAGE)
    plain = Learner(plain_agent, SETTINGS, _optimizer(lr=1e-3, warmup=0), "cpu")
    nhwc = Learner(nhwc_agent, SETTINGS, _optimizer(lr=1e-3, warmup=0), "cpu", channels_last=True)
    convs = [m.weight for m in nhwc_agent.networks.encoder.cnn.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()
                         for w in convs)
    _same_two_updates(nhwc, plain, batch, seed=30)


def test_the_acting_policy_carries_the_learners_posterior(monkeypatch):
    """The acting policy (torchrl's state estimator, step by step) and the learner's scan give the same
    beliefs and states on one recorded sequence, continuous actions beyond [-1, 1] included: the policy
    acts on the latent the actor was trained on. Sampling is replaced by the mode in both paths (the
    same module-level function), so the two are deterministic and comparable."""
    import torchrl.modules.models.model_based as model_based

    import dreamer.scan as scan_module
    from tensordict import TensorDict

    def mode(logits, unimix=0.0, uniform=None):
        probs = model_based._unimix_probs(logits, unimix)
        one_hot = torch.zeros_like(probs).scatter_(-1, probs.argmax(-1, keepdim=True), 1.0)
        return probs + (one_hot - probs).detach()

    monkeypatch.setattr(model_based, "_straight_through_categorical", mode)
    monkeypatch.setattr(scan_module, "_straight_through_categorical", mode)
    torch.manual_seed(0)
    agent, _ = _setup(CONTINUOUS)
    with torch.no_grad():  # weights far from their initialization, so that every input matters
        for parameter in agent.networks.trained.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    learner = Learner(agent, SETTINGS, _optimizer(), "cpu")
    size, steps = agent.size, 12
    observations, actions = 3 * torch.randn(steps, 5), 3 * torch.rand(steps, 3) - 1.5
    state, belief, previous = torch.zeros(1, size.latent), torch.zeros(1, size.deter), torch.zeros(1, 3)
    records, acted = [], []
    for t in range(steps):  # record t: the carry before o[t], and o[t]; the env then takes actions[t]
        record = TensorDict({"state": state, "belief": belief, "action": previous,
                             "is_init": torch.tensor([[t == 0]]), "next": {"observation": observations[t:t + 1]}}, [1])
        records.append(record.clone())
        out = agent.policy(record).get("policy")
        state, belief, previous = out.get("state"), out.get("belief"), actions[t:t + 1]
        acted.append((state, belief))
    batch = torch.stack(records, 1)
    for key, dtype in (("reward", torch.float32), ("done", torch.bool), ("terminated", torch.bool)):
        batch["next", key] = torch.zeros(1, steps, 1, dtype=dtype)
    with torch.no_grad():
        _, _, states, beliefs, _ = learner._losses(learner._inputs(batch))
    acting_states, acting_beliefs = torch.cat([s for s, _ in acted]), torch.cat([b for _, b in acted])
    assert torch.equal(states[0], acting_states)
    torch.testing.assert_close(beliefs[0], acting_beliefs, rtol=1e-5, atol=1e-5)
    assert acting_beliefs.abs().mean() > 0.05 and acting_states[1:].ne(acting_states[:-1]).any()
    # The check can fail: the same sequence with one earlier action changed moves the learner's beliefs.
    batch["action"][0, 5] += 0.5
    with torch.no_grad():
        _, _, _, moved, _ = learner._losses(learner._inputs(batch))
    assert not torch.allclose(moved[0, 5:], acting_beliefs[5:], rtol=1e-5, atol=1e-5)


def test_the_symlog_two_hot_reads_and_trains_in_symlog_space_and_the_symexp_one_in_raw_values():
    from torchrl.modules.models.model_based import _default_bins
    from torchrl.objectives import symexp, symlog

    bins = _default_bins(255)
    grid = symlog(bins)
    assert torch.allclose(grid, torch.linspace(-20, 20, 255), atol=1e-4)  # the reference's grid
    symlog_heads, symexp_heads = TwoHot(bins, "symlog"), TwoHot(bins, "symexp")
    for heads in (symlog_heads, symexp_heads):
        assert heads.mean(torch.zeros(3, 255)).abs().max() == 0  # uniform logits read exactly zero
    # Half the probability on each of two neighbouring bins: the symlog head reads the symexp of their
    # midpoint in symlog space, the symexp one the midpoint of their raw values.
    k = 140
    logits = torch.full((255,), -1e4)
    logits[k] = logits[k + 1] = 0.0
    assert torch.isclose(symlog_heads.mean(logits), symexp((grid[k] + grid[k + 1]) / 2), rtol=1e-4)
    assert torch.isclose(symexp_heads.mean(logits), (bins[k] + bins[k + 1]) / 2, rtol=1e-4)
    # A target at that symlog midpoint is split half and half between the two bins by the symlog head's
    # loss; the symexp head splits it linearly in raw values, more on the lower bin.
    target = symexp((grid[k] + grid[k + 1]) / 2)
    logits[k], logits[k + 1] = torch.tensor(0.9).log(), torch.tensor(0.1).log()
    half = -0.5 * (torch.tensor(0.9).log() + torch.tensor(0.1).log())
    assert torch.isclose(symlog_heads.loss(logits, target), half, rtol=1e-4)
    lower = (bins[k + 1] - target) / (bins[k + 1] - bins[k])
    assert lower > 0.51
    raw = -(lower * torch.tensor(0.9).log() + (1 - lower) * torch.tensor(0.1).log())
    assert torch.isclose(symexp_heads.loss(logits, target), raw, rtol=1e-4)
    with pytest.raises(ValueError, match="two-hot mode must be one of symexp, symlog"):
        TwoHot(bins, "raw")


def test_the_learner_uses_the_two_hot_setting():
    def losses(two_hot):
        agent, batch = _setup(CONTINUOUS)
        learner = Learner(agent, _loss(imag_length=4, two_hot=two_hot), _optimizer(), "cpu")
        assert learner.losses.reward_twohot.mode == learner.losses.value_twohot.mode == two_hot
        torch.manual_seed(2)  # the reward head starts at zero output (every target costs log 255): move it
        with torch.no_grad():
            for param in agent.networks.reward_head.parameters():
                param.normal_()
        torch.manual_seed(1)
        return learner._losses(learner._inputs(batch.clone()))[1]

    metrics, raw_metrics = losses("symlog"), losses("symexp")
    _, batch = _setup(CONTINUOUS)
    assert torch.isclose(metrics["reward_real"], batch["next", "reward"].mean())  # every replayed step's reward
    assert not torch.isclose(metrics["reward_seen"], raw_metrics["reward_seen"])  # the heads read differently
    assert metrics["reward_imagined"].isfinite()
    # Same weights, same batch: the rewards (randn x 3) land on other bins in symlog space.
    assert not _close(metrics["loss_model_reward"].detach(), raw_metrics["loss_model_reward"].detach())


def test_a_continue_head_that_learns_the_discounted_flag_is_the_returns_whole_discount():
    """loss.continue_target=discounted (the reference's): the head's target is the flag times the discount, and
    imagination discounts by the head's prediction alone. A head predicting gamma p gives the same λ-returns
    as a flag head predicting p, and imagination weights gamma times the flag head's (the reference's
    weighting); the two targets' cross entropies are the ones of their definitions."""
    gamma, p = 1 - 1 / 333, 0.9

    def run(target, prediction):
        agent, batch = _setup(CONTINUOUS)
        learner = Learner(agent, _loss(imag_length=4, continue_target=target), _optimizer(), "cpu")
        torch.manual_seed(2)  # the reward and value heads start at zero output: move them
        with torch.no_grad():
            for head in (agent.networks.reward_head, agent.networks.critic_head):
                for param in head.parameters():
                    param.normal_(std=0.3)
            last = agent.networks.continue_head.mlp.model[-1]
            last.weight.zero_()
            last.bias.fill_(torch.logit(torch.tensor(prediction)).item())
        torch.manual_seed(1)
        return learner._losses(learner._inputs(batch.clone()))[1], batch

    flag, batch = run("flag", p)
    discounted, _ = run("discounted", gamma * p)
    assert torch.isclose(discounted["continuation_mean"], gamma * flag["continuation_mean"])
    for key in ("return_low", "return_high"):  # the λ-returns' percentiles: equal returns
        assert _close(discounted[key], flag[key], tol=1e-5), key
    assert torch.isclose(discounted["loss_actor"], gamma * flag["loss_actor"], rtol=1e-4)
    alive = (~batch["next", "terminated"]).float()
    for metrics, q, scale in ((flag, p, 1.0), (discounted, gamma * p, gamma)):
        y = scale * alive
        expected = -(y * torch.tensor(q).log() + (1 - y) * torch.tensor(1 - q).log()).mean()
        assert torch.isclose(metrics["loss_model_continue"], expected, rtol=1e-5)
    with pytest.raises(ValueError, match="loss.continue_target must be flag or discounted"):
        Learner(_setup(CONTINUOUS)[0], _loss(continue_target="soft"), _optimizer(), "cpu")


def test_evaluation_reads_the_weights_of_both_formats():
    from dreamer.evaluate import load_weights

    first = torch.load(FORMAT_1, weights_only=True)
    learner = Learner(_setup(VECTOR, seed=1)[0], SETTINGS, _optimizer(), "cpu")
    learner.load_state_dict(copy.deepcopy(first))
    for state in (first, learner.state_dict()):
        agent, _ = _setup(VECTOR, seed=2)
        load_weights(agent, SETTINGS, {"learner": state}, FORMAT_1, Path("config.yaml"))
        for name, value in learner.nets.trained.state_dict().items():
            assert torch.equal(agent.networks.trained.state_dict()[name], value), name


def _backprop_learner(entropy: float):
    agent, batch = _setup(CONTINUOUS)
    settings = _loss(imag_length=4, actor_grad="backprop", two_hot="symlog", entropy=entropy)
    learner = Learner(agent, settings, _optimizer(), "cpu")
    torch.manual_seed(2)  # the reward and value heads start at zero output, flat in the states: move them
    with torch.no_grad():
        for head in (agent.networks.reward_head, agent.networks.critic_head):
            for param in head.parameters():
                param.normal_(std=0.3)
    return learner, agent, learner._inputs(batch)


def test_the_backprop_actor_learns_through_the_imagined_returns_and_moves_only_the_actor():
    """loss.actor_grad=backprop (without the entropy bonus here): the actor's loss reaches every actor
    parameter, through the imagined steps, and no parameter of the world model or the critic; a small step
    down its gradient raises the same imagination's normalized return (the draws reseeded alike)."""
    learner, agent, inputs = _backprop_learner(entropy=0.0)
    nets = agent.networks
    kept = [tensor.clone() for tensor in learner.losses.state_tensors()]

    def actor_loss() -> torch.Tensor:
        for tensor, value in zip(learner.losses.state_tensors(), kept):  # the return normalizer as it was
            tensor.data.copy_(value)
        torch.manual_seed(5)
        return learner._losses(inputs)[1]["loss_actor"]

    loss = actor_loss()
    actor = list(nets.actor_net.parameters())
    others = [p for name, net in nets.trained.items() if name != "actor" for p in net.parameters()]
    grads = torch.autograd.grad(loss, actor + others, allow_unused=True)
    assert all(g is not None and g.abs().sum() > 0 for g in grads[:len(actor)])
    assert all(g is None or g.abs().sum() == 0 for g in grads[len(actor):])
    with torch.no_grad():
        for param, grad in zip(actor, grads):
            param -= 1e-3 * grad / grad.norm()
    assert actor_loss() < loss


def test_the_reinforce_actor_has_no_gradient_through_imagination():
    """The default: imagination runs without autograd; the actor's gradient comes from log pi alone."""
    agent, batch = _setup(CONTINUOUS)
    learner = Learner(agent, _loss(imag_length=4, entropy=0.0), _optimizer(), "cpu")
    assert not learner.scan.frozen_prior
    torch.manual_seed(5)
    loss = learner._losses(learner._inputs(batch))[1]["loss_actor"]
    reward = list(agent.networks.reward_head.parameters())
    assert all(g is None for g in torch.autograd.grad(loss, reward, allow_unused=True))


def test_the_backprop_actor_needs_continuous_actions():
    agent, _ = _setup(VECTOR)
    with pytest.raises(ValueError, match="loss.actor_grad=backprop differentiates continuous actions"):
        Learner(agent, _loss(imag_length=4, actor_grad="backprop"), _optimizer(), "cpu")


def test_the_compiled_backprop_step_follows_the_eager_updates_on_cpu():
    """loss.actor_grad=backprop through torch.compile (inductor's CPU backend): imagination compiled with
    autograd and the frozen prior's functional calls change no result. With the heads read in symlog space,
    its pairing (README): through the symexp two-hot of heads near initialization the actor's gradient is a
    sum of terms up to 4.9e8 x p that cancel, and compiled and eager roundings of it differed by 28 %."""
    settings = _loss(imag_length=4, actor_grad="backprop", two_hot="symlog")
    (eager_agent, batch), (compiled_agent, _) = _setup(CONTINUOUS), _setup(CONTINUOUS)
    eager = Learner(eager_agent, settings, _optimizer(lr=1e-3, warmup=0), "cpu")
    compiled = Learner(compiled_agent, settings, _optimizer(lr=1e-3, warmup=0), "cpu", compile=True)
    assert compiled.warmup(batch) > 0 and all(piece.compiled for piece in (compiled._imagine, compiled._tail))
    _same_two_updates(compiled, eager, batch, seed=40)


def test_a_compiled_step_that_fails_in_warm_up_ends_the_run_in_one_line(monkeypatch, capsys):
    """What is faked: the compiler's failure. On the GPU, inductor's stride check failed in the warm-up of
    1 x 96 x 96 images (BENCHMARKS.md), which cannot happen on the CPU; here the loss tail's compiled
    function raises the same kind of AssertionError when first called."""
    from dreamer.learner import _Compiled
    from dreamer.train import RunError, warm_up

    agent, batch = _setup(VECTOR)
    learner = Learner(agent, SETTINGS, _optimizer(), "cpu", compile=True, cudagraph=False)
    enable = _Compiled.enable

    def failing_enable(piece):
        enable(piece)
        if piece.name == "losses":
            def fail(*args):
                raise AssertionError("expected size 128==128, stride 25==1 at dim=1\nThis error most often ...")
            piece.compiled = fail

    monkeypatch.setattr(_Compiled, "enable", failing_enable)
    before = [p.detach().clone() for p in learner.params]
    with pytest.raises(RunError) as error:
        warm_up(learner, batch)
    assert str(error.value).startswith("the compiled learner step failed in its warm-up (AssertionError: "
                                       "expected size 128==128, stride 25==1 at dim=1); run.compile=false")
    assert "\n" not in str(error.value)
    assert "Traceback" in capsys.readouterr().err  # where it failed, for a report
    assert all(torch.equal(a, b) for a, b in zip(before, learner.params))  # the warm-up's updates undone

    monkeypatch.setattr(_Compiled, "enable", enable)
    eager = Learner(agent, SETTINGS, _optimizer(), "cpu", compile=False, cudagraph=False)
    eager._step = lambda inputs: (_ for _ in ()).throw(ValueError("not a compiler error"))
    eager.needs_warmup = True
    with pytest.raises(ValueError, match="not a compiler error"):  # without compiling, errors pass as they are
        warm_up(eager, batch)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels-last"])
def test_the_optimizers_lists_share_strides_so_cuda_fuses_them(monkeypatch, channels_last):
    """CUDA's fused foreach kernels need each operation's lists to share sizes and strides, or the whole
    operation runs one kernel per tensor. Convolution weight gradients come channels-last from the CPU's
    and cuDNN's kernels while the weights are NCHW; LaProp puts each gradient in its weight's layout
    (values unchanged: the update equals torchrl's, test_optimizer_equals_torchrl_on_the_same_gradients)."""
    torch.manual_seed(0)
    size = _size("size1m", deter=64, hidden=16, classes=4, stoch=4, units=16, blocks=4)
    learner = Learner(build_agent(IMAGE, size), SETTINGS, _optimizer(), torch.device("cpu"),
                      channels_last=channels_last)
    mismatched: list[tuple] = []
    addcmul = torch._foreach_addcmul_

    def checked(state, grads, *args, **kwargs):
        mismatched.extend((s.shape, s.stride(), g.stride()) for s, g in zip(state, grads) if s.stride() != g.stride())
        return addcmul(state, grads, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_addcmul_", checked)
    learner.update(_batch(IMAGE, size, 2, 8))
    conv = [p for p in learner.params if p.dim() == 4]
    assert conv and not mismatched, mismatched
