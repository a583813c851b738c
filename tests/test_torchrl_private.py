"""torchrl's private names that the project relies on, checked in one place.

The replay (dreamer/replay.py) and the inference server (dreamer/inference.py) subclass torchrl's
storage, sampler, process-slot transport and inference server and reach into their private state (locks,
cursors, slot arrays, hooks); the learner (dreamer/learner.py, dreamer/scan.py, dreamer/losses.py) and
the agent (dreamer/agent.py) reimplement torchrl arithmetic on weights found by layer index, state-dict prefix or
private attribute; an env adapter overrides a private EnvBase hook. None of that is torchrl's public
API, so a torchrl upgrade may rename, reshape or stop calling any of it. Each entry of ENTRIES names
one such use (where the project uses it, the object, what is expected) and its test builds the
smallest real torchrl objects to check it, failing with one line that names what changed. A second
test checks that the project's subclasses of torchrl classes add no private name that torchrl's base
class now has as well (a silent override).

tensordict: the project uses no private tensordict name (only TensorDict, TensorDictBase and tensordict.nn's
public modules), so nothing of tensordict is listed here.
"""

from __future__ import annotations

import ast
import functools
import inspect
import multiprocessing
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import torchrl
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.data import (
    Composite,
    LazyTensorStorage,
    OneHot,
    ReplayBufferEnsemble,
    SliceSampler,
    TensorDictReplayBuffer,
    TensorDictRoundRobinWriter,
    Unbounded,
)
from torchrl.envs import EnvBase
from torchrl.modules.inference_server import InferenceServer, ProcessSlotTransport

ROOT = Path(__file__).resolve().parent.parent
PINNED = re.search(r'"torchrl==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
CAPACITY, STREAMS, WRITES = 4, 2, 6  # each replay stream written 6 times: wrapped once, newest at slot 1


class Mismatch(Exception):
    """What a torchrl object does differently from what the project expects (one line)."""


def expect(condition, problem: str) -> None:
    if not condition:
        raise Mismatch(problem)


def parameters(function) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


def expect_parameters(function, names: list[str], keyword_only: tuple[str, ...] = ()) -> None:
    """`function` takes `names` in this order (the ones the project passes or overrides with)."""
    found = parameters(function)
    expect(found[: len(names)] == names, f"takes ({', '.join(found)}), not ({', '.join(names)})")
    signature = inspect.signature(function).parameters
    for name in keyword_only:
        expect(name in signature and signature[name].kind is inspect.Parameter.KEYWORD_ONLY,
               f"has no keyword-only parameter {name!r} (it takes ({', '.join(found)}))")


# ---- the smallest real objects, built on first use ----

class BuildFailed(Exception):
    """Building an object an entry is checked on failed: the message names the object and the error."""


def built(what: str):
    """Turns an error while building `what` into BuildFailed, so that an entry reports it as such."""

    def wrap(build):
        @functools.wraps(build)
        def builder(*args, **kwargs):
            try:
                return build(*args, **kwargs)
            except BuildFailed:
                raise
            except Exception as error:
                raise BuildFailed(f"could not be checked: building {what} failed ({type(error).__name__}: "
                                  f"{_first_line(error)})") from error

        return builder

    return wrap


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else ""


class World:
    """torchrl objects built the way the project builds them, each on first use."""

    @functools.cached_property
    @built("the project's tiny model size")
    def settings(self):
        from dreamer.config import reference_settings

        size, loss, _ = reference_settings("size1m")
        tiny = replace(size, deter=16, hidden=8, stoch=2, classes=4, units=8, blocks=2, bins=15,
                       enc_layers=1, dec_layers=1, head_layers=1, actor_layers=1, critic_layers=2, dyn_layers=2)
        return tiny, replace(loss, imag_length=2)

    @functools.cached_property
    @built("a tiny agent (dreamer.agent.build_agent)")
    def agent(self):
        from dreamer.agent import EnvLayout, build_agent

        torch.manual_seed(0)
        layout = EnvLayout.from_specs(Composite(observation=Unbounded(4)), OneHot(2))
        return build_agent(layout, self.settings[0])

    @functools.cached_property
    @built("torchrl's losses on the tiny agent (dreamer.agent.torchrl_loss)")
    def oracle(self):
        from dreamer.agent import torchrl_loss

        return torchrl_loss(self.agent, self.settings[1])[0]

    @functools.cached_property
    @built("a replay ensemble as dreamer.replay.Replay's")
    def replay(self):
        """As dreamer.replay.Replay: one member per stream whose writer's slot generations are a row of
        one table (set on the storage before the writer registers), routed by row; WRITES records each."""
        from torchrl.data.replay_buffers.writers.round_robin import _SLOT_GENERATIONS_ATTR

        generations = torch.full((STREAMS, CAPACITY), -1, dtype=torch.long)
        members, counted = [], []

        class CountingSampler(SliceSampler):
            def _sampleable_count(self, storage, batch_size):
                counted.append((storage, batch_size))
                return super()._sampleable_count(storage, batch_size)

        for stream in range(STREAMS):
            storage = LazyTensorStorage(CAPACITY)
            setattr(storage, _SLOT_GENERATIONS_ATTR, generations[stream])
            members.append(TensorDictReplayBuffer(
                storage=storage,
                sampler=CountingSampler(slice_len=2, traj_key="stream", strict_length=True, init_key=None),
                writer=TensorDictRoundRobinWriter(track_generations=True)))
        generator = torch.Generator().manual_seed(0)
        ensemble = ReplayBufferEnsemble(*members, p="sampleable", num_buffer_sampled=2, routing_dim=0,
                                        batch_size=4, generator=generator, pin_memory=False, prefetch=None)
        for t in range(WRITES):
            ensemble.extend(TensorDict(t=torch.tensor([t, 100 + t]), stream=torch.arange(STREAMS), batch_size=[2]))
        return ensemble, members, generations, generator, counted

    @staticmethod
    @built("a ProcessSlotTransport")
    def transport(slots: int = 2) -> ProcessSlotTransport:
        """A fresh process-slot transport, as dreamer.inference.KillSafeSlotTransport makes it."""
        request = TensorDict(x=torch.zeros(2))
        response = TensorDict(y=torch.zeros(2), policy_version=torch.zeros((), dtype=torch.long))
        return ProcessSlotTransport(request, response, num_slots=slots, ctx=multiprocessing.get_context("spawn"))

    @classmethod
    @built("an InferenceServer")
    def server(cls, server_class=InferenceServer, transport=None) -> InferenceServer:
        """An inference server on the CPU, with the keywords of dreamer.inference._make_server."""
        model = TensorDictModule(nn.Linear(2, 2), in_keys=["x"], out_keys=["y"])
        return server_class(model, transport or cls.transport(), max_batch_size=2, min_batch_size=1,
                            static_batch_size=None, request_spec=None, timeout=0.05, policy_device="cpu",
                            output_device="cpu")


# ---- replay: dreamer/replay.py ----

def check_slot_generations_attr(world):
    from torchrl.data.replay_buffers.writers.round_robin import _SLOT_GENERATIONS_ATTR

    expect(isinstance(_SLOT_GENERATIONS_ATTR, str), f"is a {type(_SLOT_GENERATIONS_ATTR).__name__}, not a str")
    _, members, generations, _, _ = world.replay
    held = getattr(members[0].storage, _SLOT_GENERATIONS_ATTR, None)
    expect(held is not None and held.data_ptr() == generations[0].data_ptr(),
           "no longer names the storage attribute where the writer keeps the slot generations")


def check_writer_generation(world):
    _, members, generations, _, _ = world.replay
    for stream, member in enumerate(members):
        kept = member.writer._generation
        expect(isinstance(kept, torch.Tensor) and kept.data_ptr() == generations[stream].data_ptr(),
               "is not the tensor set on the storage under _SLOT_GENERATIONS_ATTR after inserts (replaced, not "
               "bumped in place)")
        expect(kept.tolist() == [1, 1, 0, 0], f"counts {kept.tolist()} after {WRITES} writes into {CAPACITY} slots, "
               "not [1, 1, 0, 0] (a slot's first write is generation 0)")


def check_writer_cursor(world):
    _, members, _, _, _ = world.replay
    cursor = members[0].writer._cursor
    expect(isinstance(cursor, int) and cursor == WRITES % CAPACITY,
           f"is {cursor!r} after {WRITES} writes into {CAPACITY} slots, not the next slot {WRITES % CAPACITY}")


def check_last_cursor_index(world):
    _, members, _, _, _ = world.replay
    newest = members[0].storage._last_cursor_index
    expect(isinstance(newest, int) and newest == (WRITES - 1) % CAPACITY,
           f"is {newest!r} after {WRITES} writes into {CAPACITY} slots, not the newest slot {(WRITES - 1) % CAPACITY}")


def check_storage_table(world):
    _, members, _, _, _ = world.replay
    stored = members[1].storage._storage
    expect(isinstance(stored, TensorDict) and stored.batch_size == torch.Size([CAPACITY]),
           f"is {type(stored).__name__} {getattr(stored, 'batch_size', '')}, not a TensorDict [{CAPACITY}] of records")
    newest = (WRITES - 1) % CAPACITY
    expect(stored[torch.tensor([newest])].get("t").tolist() == [100 + WRITES - 1],
           "does not hold the records by slot (the newest record is not at the writer's last slot)")


def check_init_standard(world):
    expect_parameters(LazyTensorStorage._init_standard, ["data"])
    seen = []

    class Probe(LazyTensorStorage):
        def _init_standard(self, data):
            seen.append(data)
            return super()._init_standard(data)

    storage = Probe(CAPACITY)
    buffer = TensorDictReplayBuffer(storage=storage)
    buffer.extend(TensorDict(t=torch.arange(2), batch_size=[2]))
    expect(len(seen) == 1, f"is called {len(seen)} times by the first insert, not once")
    expect(storage.initialized and isinstance(storage._storage, TensorDict),
           "leaves `initialized` / `_storage` unset, where an override sets them")


def check_storage_fill(world):
    _, members, _, _, _ = world.replay
    storage = members[0].storage
    expect(storage._is_full is True, f"is {storage._is_full!r} for a full storage, not True")
    expect(storage._len_along_dim0 == CAPACITY, f"_len_along_dim0 is {storage._len_along_dim0!r}, not {CAPACITY}")
    fresh = LazyTensorStorage(CAPACITY)
    TensorDictReplayBuffer(storage=fresh).extend(TensorDict(t=torch.arange(1), batch_size=[1]))
    expect(fresh._is_full is False and fresh._len_along_dim0 == 1,
           f"a storage holding 1 of {CAPACITY} reads _is_full={fresh._is_full!r}, _len_along_dim0="
           f"{fresh._len_along_dim0!r}")


def check_sampleable_count(world):
    expect_parameters(SliceSampler._sampleable_count, ["storage", "batch_size"])
    ensemble, _, _, _, counted = world.replay
    counted.clear()
    ensemble.sample()
    expect(counted, "is not called by ReplayBufferEnsemble(p='sampleable') to weigh its members")


def check_sampler_rng(world):
    _, members, _, generator, _ = world.replay
    rng = members[0].sampler._rng
    expect(rng is generator, f"is {rng!r}, not the ensemble's generator")


def check_rbs(world):
    ensemble, members, _, _, _ = world.replay
    rbs = ensemble._rbs
    expect(len(rbs) == len(members) and all(a is b for a, b in zip(rbs, members)),
           "is not the member buffers in the order given")


def _reentrant(lock) -> bool:
    if not lock.acquire(False):
        return False
    try:
        again = lock.acquire(False)
        if again:
            lock.release()
        return again
    finally:
        lock.release()


def check_replay_lock(world):
    ensemble, members, _, _, _ = world.replay
    for buffer in (ensemble, *members):
        lock = buffer._replay_lock
        expect(hasattr(lock, "acquire") and hasattr(lock, "release"), f"is a {type(lock).__name__}, not a lock")
        expect(_reentrant(lock), "is not re-entrant: the ensemble's extend takes it again under the replay's hold")


def check_write_lock(world):
    ensemble, _, _, _, _ = world.replay
    try:
        with ensemble._write_lock, ensemble._write_lock:
            pass
    except (TypeError, AttributeError) as error:
        raise Mismatch(f"is not a context manager ({error})") from None


def check_prefetch(world):
    ensemble, _, _, _, _ = world.replay
    expect(isinstance(ensemble._prefetch, bool), f"_prefetch is a {type(ensemble._prefetch).__name__}, not a bool")
    expect(len(ensemble._prefetch_queue) == 0, "_prefetch_queue has no len() or is not empty without prefetch")


# ---- inference: dreamer/inference.py ----

def check_transport_init(world):
    expect_parameters(ProcessSlotTransport.__init__, ["request_spec", "response_spec"],
                      keyword_only=("num_slots", "ctx"))


def check_num_slots(world):
    transport = world.transport(3)
    expect(transport._num_slots == 3, f"is {transport._num_slots!r} for num_slots=3")


def check_next_client_slot(world):
    transport = world.transport()
    expect(transport._next_client_slot == 0, f"is {transport._next_client_slot!r} before any client, not 0")
    transport.client()
    expect(transport._next_client_slot == 1, f"is {transport._next_client_slot!r} after one client(), not 1")


def check_request_ready(world):
    transport = world.transport()
    ready = transport._request_ready
    expect(len(ready) == 2, f"has {len(ready)} entries for 2 slots")
    ready[1] = 1
    slots, _ = transport.drain_slots(2)
    expect(slots == [1] and not ready[1], f"a slot marked 1 is drained as {slots} and left at {ready[1]!r}, "
           "not claimed and cleared")


def check_submitted_at(world):
    transport = world.transport()
    expect(len(transport._submitted_at) == 2, f"has {len(transport._submitted_at)} entries for 2 slots")
    transport._submitted_at[0], transport._request_ready[0] = 12.5, 1
    _, submitted = transport.drain_slots(2)
    expect(submitted == [12.5], f"drain_slots reports {submitted}, not the submission time written there")


def check_response_status(world):
    transport = world.transport()
    status = transport._response_status
    expect(len(status) == 2, f"has {len(status)} entries for 2 slots")
    transport.resolve_exception(0, RuntimeError("boom"))
    expect(status[0] == 1, f"reads {status[0]!r} after resolve_exception, not 1")


def check_exception_queues(world):
    transport = world.transport()
    queues = transport._exception_queues
    expect(len(queues) == 2, f"has {len(queues)} queues for 2 slots")
    transport.resolve_exception(1, RuntimeError("boom"))
    error = queues[1].get()
    expect(isinstance(error, RuntimeError) and error.args == ("boom",),
           f"slot 1's queue gives {error!r}, not the exception resolve_exception sent")


def check_response_events(world):
    transport = world.transport()
    expect(len(transport._response_events) == 2, f"has {len(transport._response_events)} entries for 2 slots")
    bells = [mock.Mock(), mock.Mock()]
    transport._response_events = bells  # replaced, as KillSafeSlotTransport does
    transport.resolve_exception(1, RuntimeError("boom"))
    transport.resolve(0, TensorDict(y=torch.zeros(2), policy_version=torch.zeros((), dtype=torch.long)))
    expect(bells[1].set.called and bells[0].set.called,
           "is not what resolve / resolve_exception ring (by slot, with .set())")


def check_work_semaphore(world):
    transport = world.transport()
    semaphore = transport._work_semaphore
    semaphore.release()
    transport.wait_for_work(timeout=1.0)
    expect(not semaphore.acquire(False), "is not the semaphore wait_for_work takes")


def check_slot_batches(world):
    calls, answer = [], TensorDict(y=torch.ones(2), policy_version=torch.zeros((), dtype=torch.long))

    class Probe(InferenceServer):
        def _serve_slot_batch(self, batches, slots, submitted_at):
            calls.append((batches, list(slots), list(submitted_at)))
            for slot in slots:
                self.transport.resolve(slot, answer)

    transport = world.transport()
    server = world.server(Probe, transport)
    expect(server._slot_batches is None, f"is {server._slot_batches!r} on a new server, not None")
    batches = object()
    server._slot_batches = batches  # as _StreamServer.start does before torchrl's start
    client = transport.client()
    server.start()
    try:
        client(TensorDict(x=torch.zeros(2)), timeout=10)
    finally:
        server.shutdown()
    expect(len(calls) == 1 and calls[0][0] is batches and calls[0][1] == [0],
           f"a preset value is not what the loop serves one request with (calls: {[c[1] for c in calls]})")
    expect(all(isinstance(at, float) and at > 0 for at in calls[0][2]), "submitted_at holds no submission times")


def check_serve_slot_batch(world):
    expect_parameters(InferenceServer._serve_slot_batch, ["batches", "slots", "submitted_at"])


def check_run(world):
    expect(parameters(InferenceServer._run) == [], f"takes ({', '.join(parameters(InferenceServer._run))}), not ()")


def check_model_lock(world):
    server = world.server()
    held = []
    server.update_model(lambda model: held.append(server._model_lock.locked()))
    expect(held == [True], "is not held by update_model while it updates the weights")


def check_record_batch_stats(world):
    expect_parameters(InferenceServer._record_batch_stats, [],
                      keyword_only=("batch_size", "queue_wait_ms", "forward_ms"))
    server = world.server()
    server._record_batch_stats(batch_size=2, queue_wait_ms=[1.0, 3.0], forward_ms=4.0)
    stats = server.stats()
    missing = {"batches", "batches_per_s", "avg_batch_size", "p50_queue_ms"} - set(stats)
    expect(not missing, f"feeds stats() without {sorted(missing)}")
    expect(stats["batches"] == 1 and stats["avg_batch_size"] == 2.0,
           f"is not counted by stats() (batches {stats['batches']}, avg_batch_size {stats['avg_batch_size']})")


def check_forward_ms(world):
    server = world.server()
    server._record_batch_stats(batch_size=1, queue_wait_ms=[], forward_ms=4.0)
    with server._stats_lock:
        forward = list(server._forward_ms)
    expect(forward == [4.0], f"holds {forward}, not the recorded pass durations [4.0] (under _stats_lock)")


def check_cudagraph_bookkeeping(world):
    server = world.server()
    for name in ("_cudagraph_model", "_cudagraph_tensor_references", "_cudagraph_storage_signature"):
        expect(getattr(server, name) is None, f"{name} is {getattr(server, name)!r} on a new server, not None")
    references = server._model_tensor_references()
    expect(isinstance(references, tuple) and all(isinstance(r[1], torch.Tensor) for r in references),
           "_model_tensor_references() gives no (name, tensor) pairs")
    server._cudagraph_model = object()
    server._cudagraph_tensor_references = references
    server._cudagraph_storage_signature = server._tensor_storage_signature(references)
    try:
        server.update_model(lambda model: model.module.weight.data.add_(1.0))
    except RuntimeError as error:
        raise Mismatch(f"set as _StreamServer.prepare_cudagraph sets them, an in-place update is refused ({error})")


def check_prepare_cudagraph(world):
    expect_parameters(InferenceServer.prepare_cudagraph, ["request_spec"], keyword_only=("interaction_type",))
    server = world.server()
    expect(hasattr(server, "_cudagraph_request_spec") and hasattr(server, "static_batch_size"),
           "the server keeps no _cudagraph_request_spec / static_batch_size for start() to capture with")


# ---- envs: dreamer/envs/minecraft.py ----

class _ProbeEnv(EnvBase):
    def __init__(self):
        super().__init__(batch_size=torch.Size([]))
        self.observation_spec = Composite(obs=Unbounded(1))
        self.action_spec = Unbounded(1)
        self.reward_spec = Unbounded(1)
        self.seen = []

    def _flags(self, **values):
        return TensorDict(obs=torch.zeros(1), done=torch.zeros(1, dtype=torch.bool),
                          terminated=torch.zeros(1, dtype=torch.bool), truncated=torch.zeros(1, dtype=torch.bool),
                          **values)

    def _reset(self, tensordict=None, **kwargs):
        return self._flags()

    def _step(self, tensordict):
        return self._flags(reward=torch.ones(1))

    def _set_seed(self, seed):
        pass

    def _step_proc_data(self, next_tensordict_out):
        self.seen.append(next_tensordict_out)
        return super()._step_proc_data(next_tensordict_out)


def check_step_proc_data(world):
    expect_parameters(EnvBase._step_proc_data, ["next_tensordict_out"])
    env = _ProbeEnv()
    expect(isinstance(env.run_type_checks, bool), "run_type_checks is not a bool")
    env.step(env.reset().set("action", torch.zeros(1)))
    expect(len(env.seen) == 1 and float(env.seen[0].get("reward").sum()) == 1.0,
           f"is called {len(env.seen)} times by one step, not once with the output of _step")


# ---- learner and agent: dreamer/learner.py, dreamer/scan.py, dreamer/losses.py, dreamer/agent.py ----

def check_straight_through(world):
    import torchrl.modules.models.model_based as model_based

    expect_parameters(model_based._straight_through_categorical, ["logits", "unimix", "uniform"])
    sample = model_based._straight_through_categorical(torch.zeros(1, 2, 4), 0.0, torch.tensor([[0.1, 0.6]]))
    expect(sample.argmax(-1).tolist() == [[0, 2]] and sample.sum(-1).tolist() == [[1.0, 1.0]],
           "does not draw class #(cumulative probabilities below the given uniform) as a one-hot")
    nets, size = world.agent.networks, world.settings[0]
    sampling = mock.patch.object(model_based, "_straight_through_categorical",
                                 wraps=model_based._straight_through_categorical)
    with sampling as drawn:
        nets.posterior(torch.zeros(1, size.deter), torch.zeros(1, nets.encoder.out_features))
        nets.prior(torch.zeros(1, size.latent), torch.zeros(1, size.deter), torch.zeros(1, 2))
    expect(drawn.call_count == 2, "is no longer what RSSMPriorV3 / RSSMPosteriorV3 sample their state with")


def check_unimix_probs(world):
    from torchrl.modules.models.model_based import _unimix_probs

    expect_parameters(_unimix_probs, ["logits", "unimix"])
    probs = _unimix_probs(torch.tensor([0.0, float(torch.tensor(3.0).log())]), 0.1)
    expect(torch.allclose(probs, torch.tensor([0.275, 0.725])),
           f"mixes to {probs.tolist()}, not (1 - u) softmax + u / K")


def check_default_bins(world):
    from torchrl.modules.models.model_based import _default_bins

    bins = _default_bins(world.settings[0].bins)
    reward_bins = world.oracle.model_loss.reward_bins
    expect(bins.shape == reward_bins.shape and torch.allclose(bins, reward_bins.to(bins)),
           "is not the support of the model loss's reward head")


def check_target_prefix(world):
    targets = world.oracle.value_loss.target_value_model_params.flatten_keys(".")
    head = dict(world.agent.networks.critic_head.named_parameters())
    prefix = "module.0.module."
    found = {key[len(prefix):]: targets[key] for key in targets.keys() if key.startswith(prefix)}
    expect(set(found) == set(head), f"keys under {prefix!r} are {sorted(found)[:4]}..., not the critic head's "
           f"parameter names {sorted(head)[:4]}...")
    expect(all(found[name].shape == p.shape for name, p in head.items()), "shapes differ from the critic head's")


def check_gru_projections(world):
    rnn, size = world.agent.networks.prior.rnn, world.settings[0]
    for name in ("belief_projection", "state_projection"):
        projection = getattr(rnn, name)
        expect(len(projection) == 3 and isinstance(projection[0], nn.Linear) and isinstance(projection[2], nn.SiLU),
               f"{name} is not Sequential(Linear, RMS norm, SiLU): {[type(m).__name__ for m in projection]}")
        norm = projection[1]
        expect(isinstance(norm.eps, float) and norm.weight.shape == torch.Size([size.hidden]),
               f"{name}[1] has no float eps and [hidden] weight")
        y = torch.randn(3, size.hidden)
        expect(torch.allclose(norm(y), F.rms_norm(y, (size.hidden,), None, norm.eps) * norm.weight, atol=1e-6),
               f"{name}[1] is not rms_norm(y, eps) * weight")
    features = rnn.action_projection(torch.zeros(3, 2))
    expect(features.shape == torch.Size([3, size.hidden]), f"action_projection gives {tuple(features.shape)}")


def check_gru_blocks(world):
    rnn, size = world.agent.networks.prior.rnn, world.settings[0]
    blocks = rnn.num_blocks
    expect(blocks == size.blocks, f"num_blocks is {blocks!r}, not {size.blocks}")
    layers = rnn.hidden_layers
    expect(len(layers) == 3 * size.dyn_layers, f"hidden_layers has {len(layers)} modules, not 3 per layer")
    for i in range(0, len(layers), 3):
        block, norm, act = layers[i], layers[i + 1], layers[i + 2]
        expect(isinstance(act, nn.SiLU) and norm.weight.shape == torch.Size([block.out_features]),
               f"hidden_layers[{i}:{i + 3}] is not (block linear, RMS norm, SiLU)")
    for where, block in (("hidden_layers[0]", layers[0]), ("gates", rnn.gates)):
        weight = block.weight
        expect(weight.ndim == 3 and weight.shape[0] == blocks and block.bias.shape == torch.Size([block.out_features]),
               f"{where}.weight is {tuple(weight.shape)}, not [blocks, in / blocks, out / blocks] with bias [out]")
        x = torch.randn(5, weight.shape[0] * weight.shape[1])
        grouped = x.reshape(5, blocks, -1)
        y = torch.bmm(grouped.transpose(0, 1), weight).transpose(0, 1).reshape(5, -1) + block.bias
        expect(torch.allclose(block(x), y, atol=1e-5), f"{where} is not a block-diagonal bmm plus bias")
    expect(rnn.gates.out_features == 3 * size.deter, f"gates gives {rnn.gates.out_features}, not 3 x deter")


def check_posterior_layout(world):
    nets, size = world.agent.networks, world.settings[0]
    post = nets.posterior.obs_rnn_to_post_projector
    kinds = [type(m).__name__ for m in post]
    expect(len(post) % 3 == 1 and isinstance(post[0], nn.Linear) and isinstance(post[-1], nn.Linear)
           and all(isinstance(post[i + 1], nn.SiLU) and isinstance(post[i + 2], nn.Linear)
                   for i in range(1, len(post) - 1, 3)),
           f"is {kinds}, not Linear, then (RMS norm, SiLU, Linear) per layer")
    embed = nets.encoder.out_features
    expect(post[0].in_features == size.deter + embed and post[-1].out_features == size.latent,
           f"takes {post[0].in_features} and gives {post[-1].out_features}, not deter + embed and stoch x classes")
    belief, observed = torch.randn(3, size.deter), torch.randn(3, embed)
    logits, _ = nets.posterior(belief, observed)
    expect(torch.allclose(logits.flatten(-2), post(torch.cat([belief, observed], -1)), atol=1e-6),
           "is not applied to [belief, embedding] in this order")
    prior_logits = nets.prior.rnn_to_prior_projector(belief)
    expect(prior_logits.shape == torch.Size([3, size.latent]), "rnn_to_prior_projector does not map belief to logits")
    expect(nets.prior.unimix == nets.posterior.unimix == size.unimix, "prior / posterior unimix differ from the size's")


def check_mlp_model(world):
    from torchrl.modules import DreamerV3MLP

    mlp = DreamerV3MLP(6, 4, depth=2, num_cells=8)
    last = mlp.model[-1]
    expect(isinstance(last, nn.Linear) and last.weight.shape == torch.Size([4, 8]),
           f"[-1] is {type(last).__name__}, not the output Linear(num_cells, out)")
    names = [name for name, _ in mlp.named_parameters()]
    expect("model.6.weight" in names, f"has no 'model.6.weight' (depth 2: 3 modules per layer, then the output); "
           f"checkpoints and state-dict keys name it so: {names}")


def check_image_decoder_last_layer(world):
    from torchrl.modules import DreamerV3ImageDecoder

    decoder = DreamerV3ImageDecoder(12, image_shape=(1, 16, 16), depth=4, mults=(1, 2), num_blocks=2)
    last = decoder.layers[-1]
    expect(isinstance(last, nn.ConvTranspose2d) and last.out_channels == 1,
           f"layers[-1] is {type(last).__name__}, not the ConvTranspose2d that makes the image's channels")
    seen = []
    last.register_forward_pre_hook(lambda layer, args: seen.append(args[0].shape) or None)
    image = decoder(torch.randn(3, 8), torch.randn(3, 4))
    expect(image.shape == torch.Size([3, 1, 16, 16]) and seen == [torch.Size([3, 4, 8, 8])],
           f"does not end in layers[-1] on the (N, C, H / 2, W / 2) maps (its input: {seen})")


def check_discrete_actor(world):
    from torchrl.modules import DreamerV3DiscreteActor

    actor = DreamerV3DiscreteActor(12, 3, depth=1, num_cells=8)
    net = actor.module[0].module
    expect(isinstance(net, nn.Module), f"module[0].module is {type(net).__name__}, not the network")
    logits = net(torch.randn(5, 8), torch.randn(5, 4))
    expect(logits.shape == torch.Size([5, 3]) and torch.allclose(logits.logsumexp(-1), torch.zeros(5), atol=1e-5),
           "is not called (state, belief) -> [..., actions] log-probabilities")


@dataclass(frozen=True)
class Entry:
    path: str  # the object, as the project reaches it
    where: str  # file:function that uses it
    expected: str
    check: Callable[[World], None]


R, I, L, S = "dreamer/replay.py", "dreamer/inference.py", "dreamer/learner.py", "dreamer/scan.py"
WRITER = "torchrl.data.replay_buffers.writers.round_robin"
SERVER = "torchrl.modules.inference_server.InferenceServer"
TRANSPORT = "torchrl.modules.inference_server.ProcessSlotTransport"
MODEL_BASED = "torchrl.modules.models.model_based"
RSSM = "RSSMPriorV3.rnn"  # torchrl.modules.models.model_based._DreamerV3BlockGRU

ENTRIES = [
    Entry(f"{WRITER}._SLOT_GENERATIONS_ATTR", f"{R}:_StreamStorage.__init__",
          "a str naming the storage attribute the writer keeps its slot generations in", check_slot_generations_attr),
    Entry("RoundRobinWriter._generation", f"{R}:Replay.__init__",
          "the [capacity] int64 tensor set on the storage, bumped in place", check_writer_generation),
    Entry("RoundRobinWriter._cursor", f"{R}:Replay._take_fresh, snapshot, end_stream",
          "int, the next slot to write", check_writer_cursor),
    Entry("Storage._last_cursor_index", f"{R}:_StreamWindows.sample, Replay._prepare",
          "int, the newest record's slot", check_last_cursor_index),
    Entry("TensorStorage._storage", f"{R}:Replay.snapshot, stored; _StreamStorage",
          "the TensorDict [capacity] of records", check_storage_table),
    Entry("LazyTensorStorage._init_standard", f"{R}:_StreamStorage._init_standard",
          "a hook (data) called by the first insert, setting _storage and initialized", check_init_standard),
    Entry("TensorStorage._is_full, _len_along_dim0", f"{R}:_StreamStorage.get",
          "bool, and the number of records held", check_storage_fill),
    Entry("SliceSampler._sampleable_count", f"{R}:_StreamWindows",
          "a hook (storage, batch_size) that ReplayBufferEnsemble(p='sampleable') calls", check_sampleable_count),
    Entry("Sampler._rng", f"{R}:_StreamWindows.sample", "the ensemble's generator", check_sampler_rng),
    Entry("ReplayBufferEnsemble._rbs", f"{R}:Replay (every stream access)", "the member buffers, in order", check_rbs),
    Entry("ReplayBuffer._replay_lock", f"{R}:Replay.add, add_chunk, snapshot, _prepare, _first_contexts, _apply",
          "a re-entrant lock on the ensemble and on each member", check_replay_lock),
    Entry("ReplayBuffer._write_lock", f"{R}:Replay.add_chunk", "a context manager", check_write_lock),
    Entry("ReplayBuffer._prefetch, _prefetch_queue", "scripts/bench_replay.py:StockReplay.sample",
          "a bool and a queue of prepared samples", check_prefetch),
    Entry(f"{TRANSPORT}.__init__", f"{I}:KillSafeSlotTransport.__init__",
          "(request_spec, response_spec, *, num_slots, ctx)", check_transport_init),
    Entry(f"{TRANSPORT}._num_slots", f"{I}:KillSafeSlotTransport.client, RowPass.__init__", "int, num_slots",
          check_num_slots),
    Entry(f"{TRANSPORT}._next_client_slot", f"{I}:KillSafeSlotTransport.client", "int, the next slot client() gives",
          check_next_client_slot),
    Entry(f"{TRANSPORT}._request_ready", f"{I}:RowClient.ask, Inference.forget_slot",
          "a shared byte per slot that drain_slots claims and clears", check_request_ready),
    Entry(f"{TRANSPORT}._submitted_at", f"{I}:RowClient.ask", "a shared double per slot that drain_slots reports",
          check_submitted_at),
    Entry(f"{TRANSPORT}._response_status", f"{I}:RowClient.ask, KillSafeSlotTransport.ring",
          "a shared byte per slot, 1 after resolve_exception", check_response_status),
    Entry(f"{TRANSPORT}._exception_queues", f"{I}:RowClient.__init__", "a queue per slot of resolve_exception's errors",
          check_exception_queues),
    Entry(f"{TRANSPORT}._response_events", f"{I}:KillSafeSlotTransport.__init__, ring; Inference.forget_slot",
          "a replaceable list, one object per slot that resolve / resolve_exception .set()", check_response_events),
    Entry(f"{TRANSPORT}._work_semaphore", f"{I}:RowClient.ask", "the semaphore wait_for_work takes",
          check_work_semaphore),
    Entry(f"{SERVER}._slot_batches", f"{I}:_StreamServer.start, prepare_cudagraph",
          "None at first; a preset value is what _run passes to _serve_slot_batch", check_slot_batches),
    Entry(f"{SERVER}._serve_slot_batch", f"{I}:_StreamServer._serve_slot_batch",
          "a hook (batches, slots, submitted_at)", check_serve_slot_batch),
    Entry(f"{SERVER}._run", f"{I}:_StreamServer._run", "the serving loop, no parameters", check_run),
    Entry(f"{SERVER}._model_lock", f"{I}:_StreamServer._serve_slot_batch", "the lock update_model holds",
          check_model_lock),
    Entry(f"{SERVER}._record_batch_stats", f"{I}:_StreamServer._serve_slot_batch",
          "(*, batch_size, queue_wait_ms, forward_ms), counted by stats()", check_record_batch_stats),
    Entry(f"{SERVER}._stats_lock, _forward_ms", f"{I}:Inference.snapshot, _serve",
          "a lock, and the recorded pass durations (ms)", check_forward_ms),
    Entry(f"{SERVER}._cudagraph_model, _cudagraph_tensor_references, _cudagraph_storage_signature, "
          "_model_tensor_references, _tensor_storage_signature", f"{I}:_StreamServer.prepare_cudagraph",
          "the captured graph's bookkeeping that update_model validates", check_cudagraph_bookkeeping),
    Entry(f"{SERVER}.prepare_cudagraph, _cudagraph_request_spec", f"{I}:_StreamServer.prepare_cudagraph",
          "(request_spec, *, interaction_type), with the spec start() captures from", check_prepare_cudagraph),
    Entry("torchrl.envs.EnvBase._step_proc_data", "dreamer/envs/minecraft.py:MinecraftEnv._step_proc_data",
          "a hook (next_tensordict_out) called once per step on _step's output", check_step_proc_data),
    Entry(f"{MODEL_BASED}._straight_through_categorical", f"{S}:Scan.cell_fn, prior_step",
          "(logits, unimix, uniform) -> one-hot, what the RSSM modules sample with", check_straight_through),
    Entry(f"{MODEL_BASED}._unimix_probs", "tests/test_learner.py:test_the_acting_policy_carries_the_learners_posterior",
          "(logits, unimix) -> (1 - unimix) softmax + unimix / K", check_unimix_probs),
    Entry(f"{MODEL_BASED}._default_bins", "dreamer/losses.py:Losses.__init__, scripts/diagnose_learning.py",
          "the reward and value heads' bins, as torchrl's losses hold them", check_default_bins),
    Entry("DreamerV3ValueLoss.target_value_model_params 'module.0.module.' prefix", f"{L}:Learner._from_format_1",
          "the slow critic under the critic head's parameter names (the learner's first checkpoint format)",
          check_target_prefix),
    Entry(f"{RSSM}.belief_projection[0..2], state_projection, action_projection", f"{S}:Scan.__init__, tap_specs, gru",
          "Sequential(Linear, RMS norm with eps and weight, SiLU)", check_gru_projections),
    Entry(f"{RSSM}.hidden_layers, gates, num_blocks", f"{S}:Scan.tap_specs, gru",
          "(block linear [blocks, in, out], RMS norm, SiLU) per layer; gates 3 x deter", check_gru_blocks),
    Entry("RSSMPosteriorV3.obs_rnn_to_post_projector[0], [-1]; RSSMPriorV3.rnn_to_prior_projector, unimix",
          f"{S}:Scan.tap_specs, embed_fn, cell_fn, prior_step", "Linear over [belief, embed], (norm, SiLU, Linear)...",
          check_posterior_layout),
    Entry("torchrl.modules.DreamerV3MLP.model[-1]", "dreamer/agent.py:ContinuousActor.__init__",
          "the output nn.Linear, last of (Linear, norm, SiLU) per layer", check_mlp_model),
    Entry("torchrl.modules.DreamerV3ImageDecoder.layers[-1]", "dreamer/agent.py:ImageDecoder.__init__",
          "the ConvTranspose2d that makes the image's channels, called last on the (N, C, H, W) maps",
          check_image_decoder_last_layer),
    Entry("torchrl.modules.DreamerV3DiscreteActor.module[0].module", "dreamer/agent.py:build_networks",
          "the network, (state, belief) -> log-probabilities", check_discrete_actor),
]


def _problem(entry: Entry, world: World) -> str | None:
    try:
        entry.check(world)
    except (Mismatch, BuildFailed) as mismatch:
        return str(mismatch)
    except Exception as error:  # a missing name or a changed signature: its own error says what
        return f"fails: {type(error).__name__}: {_first_line(error)}".rstrip(": ")
    return None


@pytest.fixture(scope="module")
def world() -> World:
    return World()


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda entry: entry.path.split(" ")[0].rstrip(",;"))
def test_private_torchrl_name_is_as_the_project_expects(entry, world):
    problem = _problem(entry, world)
    broken = problem is not None  # asserted as a bool: the message alone says what changed
    assert not broken, (f"torchrl {torchrl.__version__}: {entry.path} (used by {entry.where}) {problem} "
                             f"(expected: {entry.expected}); the project is pinned to torchrl {PINNED}")


# ---- silent overrides: a private name of ours that torchrl's base class now has too ----

def _own_private_names(path: Path, class_name: str) -> set[str]:
    """Private names a class of the project defines: its methods and class attributes, and what its
    methods set on self (assignments and setattr with a constant name)."""
    tree = ast.parse((ROOT / path).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    names = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(item.name)
        elif isinstance(item, (ast.Assign, ast.AnnAssign)):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and getattr(sub.value, "id", "") == "self":
            names.add(sub.attr)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def _env_instance() -> EnvBase:
    return _ProbeEnv()


def _base_names(base: type, instance) -> set[str]:
    return set(dir(base)) | set(vars(instance))


ENV_HOOKS = {"_reset", "_step", "_set_seed", "_step_proc_data"}
SUBCLASSES = [
    # (file, class, torchrl base, an instance of the base, the private names it overrides on purpose)
    ("dreamer/replay.py", "_StreamWindows", SliceSampler, lambda: SliceSampler(slice_len=2, traj_key="stream"),
     {"_sampleable_count"}),
    ("dreamer/replay.py", "_StreamStorage", LazyTensorStorage, lambda: LazyTensorStorage(CAPACITY),
     {"_init_standard", "_storage"}),
    ("dreamer/inference.py", "KillSafeSlotTransport", ProcessSlotTransport, World.transport,
     {"_response_events", "_next_client_slot"}),
    ("dreamer/inference.py", "_StreamServer", InferenceServer, World.server,
     {"_serve_slot_batch", "_run", "_slot_batches", "_cudagraph_model", "_cudagraph_tensor_references",
      "_cudagraph_storage_signature"}),
    ("dreamer/envs/atari.py", "AtariEnv", EnvBase, _env_instance, ENV_HOOKS),
    ("dreamer/envs/crafter.py", "CrafterEnv", EnvBase, _env_instance, ENV_HOOKS),
    ("dreamer/envs/dmc.py", "DMCEnv", EnvBase, _env_instance, ENV_HOOKS),
    ("dreamer/envs/minecraft.py", "MinecraftEnv", EnvBase, _env_instance, ENV_HOOKS),
]


@pytest.mark.parametrize("path, class_name, base, make, overrides", SUBCLASSES, ids=[s[1] for s in SUBCLASSES])
def test_no_private_name_of_ours_shadows_torchrls(path, class_name, base, make, overrides):
    instance = make()
    shadowed = sorted((_own_private_names(Path(path), class_name) - overrides) & _base_names(base, instance))
    them, clash = "them" if len(shadowed) > 1 else "it", bool(shadowed)
    assert not clash, (f"torchrl {torchrl.__version__}: {base.__module__}.{base.__name__}.{', '.join(shadowed)} "
                          f"(used by {path}:{class_name} as its own) now in torchrl too: the subclass silently "
                          f"overrides {them}, rename ours; the project is pinned to torchrl {PINNED}")
