"""CUDA paths: the learner step on the GPU (eager and CUDA graph), the write-back from device tensors, and the
CUDA-graph inference server with its weight sync."""

from __future__ import annotations

import threading

import pytest
import torch
from torchrl.data import Bounded, Composite, OneHot

from dreamer.agent import EnvLayout, build_agent
from dreamer.learner import Learner
from dreamer.replay import Replay
from tests.test_agent import IMAGE, VECTOR, _batch, _loss, _optimizer, _size
from tests.test_learner import CONTINUOUS
from tests.test_replay import _records

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("cudagraph", [False, True], ids=["eager", "cudagraph"])
def test_learner_update_on_cuda(cudagraph):
    torch.manual_seed(0)
    device = torch.device("cuda:0")
    size = _size("size1m", deter=64, hidden=16, classes=4, stoch=4, units=16, blocks=4)
    with torch.device(device):
        agent = build_agent(VECTOR, size)
    learner = Learner(agent, _loss(imag_length=4), _optimizer(warmup=0), device, compile=False, cudagraph=cudagraph,
                      bf16=True)
    batch = _batch(VECTOR, size, 4, 8).to(device)
    learner.warmup(batch)
    before = [p.detach().clone() for p in learner.params]
    for _ in range(3):
        state, _ = learner.update(_batch(VECTOR, size, 4, 8).to(device))
    metrics = learner.drain()
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert sum(not torch.equal(a, b) for a, b in zip(before, learner.params)) > 0
    assert state.device.type == "cuda"


def _twins(compile: bool, layout=VECTOR, fuse_kernels: bool = False, **loss):
    """Two learners on identical weights: one eager, one captured (float32, so they can agree closely)."""
    device = torch.device("cuda:0")
    size = _size("size1m", deter=64, hidden=16, classes=4, stoch=4, units=16, blocks=4)
    learners = []
    for captured in (False, True):
        torch.manual_seed(0)
        with torch.device(device):
            agent = build_agent(layout, size)
        learners.append(Learner(agent, _loss(imag_length=4, **loss), _optimizer(warmup=0), device,
                                compile=compile and captured, cudagraph=captured, bf16=False,
                                fuse_kernels=fuse_kernels and captured))
    batches = [_batch(layout, size, 4, 8).to(device) for _ in range(6)]
    return learners, batches


@pytest.mark.parametrize("compile", [False, True, "fused"], ids=["graph", "compiled-graph", "fused-graph"])
@pytest.mark.parametrize("actor_grad", ["reinforce", "backprop"])
def test_captured_step_replays_match_the_eager_updates(compile, actor_grad):
    """Replaying the graph six times follows the eager sequence of updates (same seeds, same draws); with
    loss.actor_grad=backprop (continuous actions, symlog heads: its pairing) imagination is captured with its
    autograd. "fused": compiled with run.fuse_kernels (inductor's combo kernels and aggressive fusion)."""
    backprop = actor_grad == "backprop"
    (eager, captured), batches = _twins(bool(compile), CONTINUOUS if backprop else VECTOR, compile == "fused",
                                        actor_grad=actor_grad, **({"two_hot": "symlog"} if backprop else {}))
    captured.warmup(batches[0])
    for step, batch in enumerate(batches):
        results = []
        for learner in (eager, captured):
            torch.manual_seed(100 + step)
            _, belief = learner.update(batch.clone())
            results.append((learner.drain(), belief.clone()))
        (m_eager, b_eager), (m_graph, b_graph) = results
        for key, value in m_eager.items():
            assert abs(m_graph[key] - value) <= 1e-3 * max(1.0, abs(value)), (step, key, value, m_graph[key])
        assert torch.allclose(b_graph, b_eager, rtol=1e-3, atol=1e-4), step
    for a, b in zip(eager.params, captured.params):
        assert (a - b).norm() <= 1e-3 * max(1.0, float(a.norm()))


def test_the_compiled_captured_step_rounds_the_state_to_bf16_each_step():
    """run.state_precision=bf16 on CUDA (Triton's kernels, bf16 autocast, a CUDA graph): every posterior
    belief the captured step returns is a bfloat16 value; without it, not."""
    device = torch.device("cuda:0")
    size = _size("size1m", deter=64, hidden=16, classes=4, stoch=4, units=16, blocks=4)
    beliefs = {}
    for state_bf16 in (False, True):
        torch.manual_seed(0)
        with torch.device(device):
            agent = build_agent(VECTOR, size)
        learner = Learner(agent, _loss(imag_length=4), _optimizer(warmup=0), device, compile=True, cudagraph=True,
                          bf16=True, state_bf16=state_bf16)
        batch = _batch(VECTOR, size, 4, 8).to(device)
        learner.warmup(batch)
        beliefs[state_bf16] = learner.update(batch)[1].clone()
    assert all(torch.isfinite(b).all() for b in beliefs.values())
    assert torch.equal(beliefs[True], beliefs[True].bfloat16().float())
    assert not torch.equal(beliefs[False], beliefs[False].bfloat16().float())


GREY = EnvLayout.from_specs(Composite(pixels=Bounded(0, 255, (1, 32, 32), dtype=torch.uint8)), OneHot(4))


@pytest.mark.parametrize("layout", [GREY, IMAGE], ids=["grey", "colour"])
def test_the_compiled_captured_step_takes_grey_and_colour_images(layout):
    """One-channel images (`atari`) once stopped the compiled step in warm-up: the decoder's last
    transposed convolution's backward failed inductor's stride check on CUDA (ImageDecoder's
    `_contiguous_input`). Compiled and captured in bfloat16, as a run on the GPU trains."""
    torch.manual_seed(0)
    device = torch.device("cuda:0")
    size = _size("size1m", deter=64, hidden=16, classes=4, stoch=4, units=16, blocks=4, depth=8)
    with torch.device(device):
        agent = build_agent(layout, size)
    learner = Learner(agent, _loss(imag_length=4), _optimizer(warmup=0), device, compile=True, cudagraph=True,
                      bf16=True)
    learner.warmup(_batch(layout, size, 4, 8).to(device))
    last = agent.networks.image_decoder.net.layers[-1].weight  # the decoder's last transposed convolution
    before = last.detach().clone()
    for _ in range(2):
        learner.update(_batch(layout, size, 4, 8).to(device))
    assert all(torch.isfinite(torch.tensor(v)) for v in learner.drain().values())
    assert not torch.equal(last.detach(), before)


def test_write_back_from_cuda_tensors():
    replay = Replay(2, 40, 8, 3, torch.device("cuda:0"), seed=0, context_dtype=torch.float32)
    for step in range(10):
        replay.add(_records(step, 2))
    batch, handles = replay.sample()
    assert batch.device.type == "cuda"
    # The upload ran on the replay's copy stream; read on the current stream, the batch is the stored records.
    members, slots = handles.get(("index", "buffer_ids")), handles.get(("index", "index"))
    stored = [replay.stored(member).get("t") for member in range(2)]
    expected = torch.stack([stored[m][s] for m, s in zip(members.reshape(-1).tolist(), slots.reshape(-1).tolist())])
    assert torch.equal(batch.get("t").reshape(-1).cpu(), expected)
    state = batch.get("t")[:, :-1].float().unsqueeze(-1).expand(8, 3, 3).contiguous()
    result = replay.write_back(handles, state, state).result()
    assert result.updated_count > 0
    for member in range(2):
        stored = replay.stored(member)
        for value, t in zip(stored.get("state")[:, 0].tolist(), stored.get("t").tolist()):
            assert value in (0.0, float(t - 1))
    replay.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_cuda_batches_through_the_pinned_staging_ring_are_the_sampled_records(prefetch):
    """More batches than the staging ring holds, with inserts between them: each batch on the device is
    the records its handles name (a staging buffer reused before its copy ended would mix batches)."""
    replay = Replay(4, 400, 16, 7, torch.device("cuda:0"), seed=0, prefetch=prefetch, context_dtype=torch.float32)
    step = 0
    for step in range(20):
        replay.add(_records(step, 4))
    for _ in range(3 * len(replay._ring)):
        batch, handles = replay.sample()
        big = torch.empty(4096, 4096, device="cuda:0").normal_()  # keep the learner's stream busy
        t = (batch.get("t") + (big @ big).sum() * 0).cpu()
        members = handles.get(("index", "buffer_ids"))
        assert torch.equal(t // 1000, members)  # each sequence from the stream it was drawn from
        assert torch.equal(t[:, 1:] - t[:, :-1], torch.ones_like(t[:, 1:]))  # consecutive records
        for _ in range(3):
            step += 1
            replay.add(_records(step, 4))
    replay.close()


def test_the_cuda_graph_inference_server_acts_in_bf16_when_asked():
    """run.acting_precision=bf16 through the served CUDA graph (the policy's autocast captured with it): the
    answer's belief is a bfloat16 value and the eager bf16 policy's, up to one bfloat16 step."""
    from tests.test_pipeline import SIZE, _agent, _request

    from dreamer.inference import Inference

    layout, agent = _agent()
    device = torch.device("cuda:0")
    agent.networks.policy.to(device)
    agent.policy.bf16 = True  # as build_agent(..., acting_bf16=True) sets it
    inference = Inference(agent.policy, layout, SIZE, clients=9, device=device, explore=True).start()
    try:
        request = _request(layout, 3)
        belief = inference.clients[0](request).get(("policy", "belief"))
        assert belief.dtype == torch.float32 and torch.equal(belief, belief.to(torch.bfloat16).float())
        direct = agent.policy(request.unsqueeze(0).to(device)).get(("policy", "belief"))[0].cpu()
        torch.testing.assert_close(belief, direct, rtol=8e-3, atol=8e-3)
    finally:
        inference.close()


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_the_cuda_graph_inference_server_follows_the_policy_and_its_weight_syncs(process):
    """The served step is a CUDA graph on its own stream; the deterministic part (the belief) must match
    the learner's policy before and after a sync, and weights changed on the learner reach it only
    through the event-gated sync. The server in its own process multiplies in TF32 (dreamer.inference:
    the acting policy's precision there), which moves a belief by a few 1e-4 from the float32 policy's: the
    process case compares to TF32's rounding, far below what a missed sync (weights moved by 0.3 sigma) moves."""
    from tests.test_pipeline import SIZE, _agent, _request

    from dreamer.inference import Inference, RowPass

    tol = {"rtol": 2e-3, "atol": 2e-3} if process else {"rtol": 1e-4, "atol": 1e-4}
    layout, agent = _agent()
    device = torch.device("cuda:0")
    agent.networks.policy.to(device)
    # 9 clients: graphs of 8 and 9 rows; one request replays the one of 8, its other rows stale.
    inference = Inference(agent.policy, layout, SIZE, clients=9, device=device, explore=True,
                          process=process).start()
    try:
        if not process:  # our capture, replayed without a device-wide synchronize
            served = inference.server._cudagraph_model
            assert isinstance(served, RowPass) and list(served.graphs) == [8, 9]
        request = _request(layout, 3)

        def direct_belief():
            return agent.policy(request.unsqueeze(0).to(device)).get(("policy", "belief"))[0].cpu()

        client = inference.clients[0]
        torch.testing.assert_close(client(request).get(("policy", "belief")), direct_belief(), **tol)
        with torch.no_grad():
            for parameter in agent.policy.parameters():
                parameter.add_(0.3 * torch.randn_like(parameter))
        assert inference.sync() and inference.sync.wait(30) and inference.sync.applied == 1
        torch.testing.assert_close(client(request).get(("policy", "belief")), direct_belief(), **tol)
        action = client(request).get(("policy", "action"))
        assert action.sum() == 1 and ((action == 0) | (action == 1)).all()
        # All 9 at once, each its own request: whatever the passes' sizes, each answer is its own.
        requests = [_request(layout, 10 + i) for i in range(9)]
        answers = [None] * 9

        def ask(i: int) -> None:
            for _ in range(5):
                answers[i] = inference.clients[i](requests[i]).get(("policy", "belief"))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(9)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        for i in range(9):
            expected = agent.policy(requests[i].unsqueeze(0).to(device)).get(("policy", "belief"))[0].cpu()
            torch.testing.assert_close(answers[i], expected, **tol)
    finally:
        inference.close()


def test_a_weight_sync_never_waits_for_the_learners_later_work():
    """The sync waits for the update that produced the weights (its event), not for the work the learner
    queued after it: with a long kernel still running on the learner's stream, the sync is applied and
    inference answers."""
    from tests.test_pipeline import SIZE, _agent, _request

    from dreamer.inference import Inference

    layout, agent = _agent()
    device = torch.device("cuda:0")
    agent.networks.policy.to(device)
    inference = Inference(agent.policy, layout, SIZE, clients=1, device=device, explore=True).start()
    try:
        client, request = inference.clients[0], _request(layout, 3)
        client(request)
        learner_stream = torch.cuda.current_stream(device)
        assert inference.sync()
        torch.cuda._sleep(20_000_000_000)  # about 10 s of GPU cycles: the learner's next update, queued
        assert inference.sync.wait(60) and inference.sync.applied == 1
        answer = client(request)
        assert not learner_stream.query(), "the learner's queued work ended first: the check proves nothing"
        assert answer.get(("policy", "action")).sum() == 1
    finally:
        torch.cuda.synchronize(device)
        inference.close()


@pytest.mark.parametrize("cudagraph", [False, True], ids=["eager", "cudagraph"])
def test_the_inline_acting_copy_answers_beside_the_learners_queued_work_and_follows_syncs(cudagraph):
    """The inline source's acting copy (its own weights and stream): its answer matches the policy's
    deterministic part (the belief) before and after a sync, and comes while a long kernel still runs
    on the learner's stream (the overlap of acting and updates)."""
    from tests.test_pipeline import SIZE, _agent, _request

    from dreamer.pipeline import ActingCopy

    layout, agent = _agent()
    device = torch.device("cuda:0")
    agent.networks.policy.to(device)
    acting = ActingCopy(agent.policy, layout, SIZE, envs=3, device=device, cudagraph=cudagraph, sync_every=1)
    try:
        records = torch.stack([_request(layout, seed) for seed in range(3)])

        def direct_belief():
            return agent.policy(records.clone().to(device)).get(("policy", "belief")).cpu()

        torch.testing.assert_close(acting(records.clone()).get(("policy", "belief")), direct_belief(),
                                   rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            for parameter in agent.policy.parameters():
                parameter.add_(0.3 * torch.randn_like(parameter))
        acting.synced(1)  # as after the learner's first update
        assert acting.sync.wait(30) and acting.version == 1
        torch.testing.assert_close(acting(records.clone()).get(("policy", "belief")), direct_belief(),
                                   rtol=1e-4, atol=1e-4)
        learner_stream = torch.cuda.current_stream(device)
        torch.cuda._sleep(20_000_000_000)  # about 10 s of GPU cycles: the learner's queued updates
        answer = acting(records.clone())
        assert not learner_stream.query(), "the learner's queued work ended first: the check proves nothing"
        assert answer.get(("policy", "action")).sum() == 3
        assert acting.stats()["collect/weights_age"] == 0.0
    finally:
        torch.cuda.synchronize(device)
        acting.close()


def test_the_inline_source_on_cuda_steps_ahead_in_its_thread_and_gives_the_records_of_the_cpu_loop():
    """On a CUDA learner the inline source steps one step ahead in a thread of its own, acting through its
    acting copy: its records are those of the CPU source's in-loop steps (a deterministic policy)."""
    from tests.test_sources import LeanPolicy, _cfg, _layout, _stream

    from dreamer.config import validate
    from dreamer.pipeline import InlineSource
    from dreamer.replay import Replay

    envs, steps = 3, 40
    cfg = _cfg(f"run.envs={envs}", "seed=5", "env.max_episode_steps=15")
    settings = validate(cfg)
    layout = _layout(cfg)
    streams = []
    for device in (torch.device("cpu"), torch.device("cuda:0")):
        policy = LeanPolicy(settings.size.latent, settings.size.deter).to(device)
        replay = Replay(envs, 4096, 4, 8, device, seed=0, context_dtype=torch.float32)
        source = InlineSource(cfg, policy, layout, settings.size, device, device.type == "cuda", replay)
        assert (source.ahead is not None) == (device.type == "cuda")
        try:
            for _ in range(steps):
                assert source.gather()[0] == envs
        finally:
            source.close()
        streams.append([_stream(replay, stream, steps) for stream in range(envs)])
        replay.close()
    for on_cpu, on_cuda in zip(*streams):
        for key in on_cpu.keys(include_nested=True, leaves_only=True):
            torch.testing.assert_close(on_cpu.get(key), on_cuda.get(key), rtol=1e-5, atol=1e-5)
