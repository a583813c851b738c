"""Replay streams, sampling windows and the latent write-back."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from dreamer.replay import Replay, last_write_wins


def _records(step: int, streams: int, width: int = 3) -> TensorDict:
    """One record per stream; `t` encodes (stream, step) so every stored value is traceable."""
    t = torch.tensor([1000 * s + step for s in range(streams)])
    return TensorDict({
        "t": t,
        "state": torch.zeros(streams, width),
        "belief": torch.zeros(streams, width),
        "is_init": torch.zeros(streams, 1, dtype=torch.bool),
        "next": {"done": torch.zeros(streams, 1, dtype=torch.bool)},
    }, [streams])


def _replay(streams=2, size=40, batch_size=6, batch_length=3) -> Replay:
    # float32 contexts: these tests name records by exact context values (bf16 storage: its own test)
    return Replay(streams, size, batch_size, batch_length, torch.device("cpu"), seed=0, context_dtype=torch.float32)


def _stored(replay: Replay, member: int) -> TensorDict:
    return replay.stored(member)


@pytest.mark.parametrize("force_fallback", [False, True])
def test_last_write_wins_keeps_the_last_duplicate(force_fallback):
    coordinates = torch.tensor([[0, 5], [1, 5], [0, 5], [0, 2], [1, 5], [0, 5]])
    if force_fallback:  # a radix product beyond int64 takes the per-column path
        coordinates = torch.cat([coordinates, torch.tensor([[0, 2**62]])])
    keep = last_write_wins(coordinates).tolist()
    expected = [3, 5, 4] + ([6] if force_fallback else [])  # (0,2) (0,5)=last (1,5)=last, sorted
    assert keep == sorted(expected, key=lambda i: tuple(coordinates[i].tolist()))


def test_last_write_wins_both_paths_agree_on_random_input():
    generator = torch.Generator().manual_seed(0)
    coordinates = torch.randint(0, 7, (500, 3), generator=generator)
    packed = last_write_wins(coordinates)
    big = coordinates.clone()
    big[:, 0] *= 2**59  # same order, but the packed key would overflow int64
    assert torch.equal(packed, last_write_wins(big))
    for row in packed.tolist():  # each kept row is the last occurrence of its coordinate
        later = (coordinates[row + 1:] == coordinates[row]).all(1)
        assert not bool(later.any())
    assert len(packed) == len({tuple(r) for r in coordinates.tolist()})


def test_each_row_goes_to_its_env_stream_and_windows_are_consecutive():
    replay = _replay(streams=3, size=60, batch_size=32, batch_length=4)
    for step in range(12):
        replay.add(_records(step, 3))
    for member in range(3):
        assert _stored(replay, member).get("t").tolist() == [1000 * member + s for s in range(12)]
    batch, handles = replay.sample()
    assert batch.shape == (32, 5)
    t = batch.get("t")
    assert torch.all(t[:, 1:] - t[:, :-1] == 1)  # consecutive steps of one stream
    assert torch.equal(handles.get(("index", "buffer_ids")), t // 1000 * torch.ones_like(t))


def test_windows_never_cross_the_write_cursor():
    replay = _replay(streams=1, size=10, batch_size=64, batch_length=3)
    for step in range(23):  # wraps the 10-slot stream twice
        replay.add(_records(step, 1))
    t = replay.sample()[0].get("t")
    assert torch.all(t[:, 1:] - t[:, :-1] == 1) and int(t.min()) >= 13


def test_write_back_sets_the_context_of_the_next_record():
    replay = _replay(streams=2, size=40, batch_size=8, batch_length=3)
    for step in range(10):
        replay.add(_records(step, 2))
    batch, handles = replay.sample()
    learner_rows = batch[:, :-1]
    # A refreshed posterior that names the record it came from.
    state = learner_rows.get("t").float().unsqueeze(-1).expand(8, 3, 3).contiguous()
    replay.write_back(handles, state, state + 0.5).result()
    for member in range(2):
        stored = _stored(replay, member)
        for row, t in zip(stored.get("state")[:, 0].tolist(), stored.get("t").tolist()):
            assert row in (0.0, float(t - 1))  # untouched, or the posterior of the previous record
    touched = {int(t) for t in batch.get("t")[:, 1:].reshape(-1)}
    for member in range(2):
        stored = _stored(replay, member)
        for t, value in zip(stored.get("t").tolist(), stored.get("belief")[:, 0].tolist()):
            assert (value == t - 1 + 0.5) == (t in touched)


def test_duplicated_coordinates_keep_the_last_value():
    replay = _replay(streams=1, size=20, batch_size=2, batch_length=3)
    for step in range(4):  # exactly one window: both sampled rows address the same slots
        replay.add(_records(step, 1))
    batch, handles = replay.sample()
    assert torch.equal(batch.get("t")[0], batch.get("t")[1])
    state = torch.stack([torch.full((3, 3), 1.0), torch.full((3, 3), 2.0)])
    result = replay.write_back(handles, state, state).result()
    assert result.updated_count == 3  # three distinct slots, once each
    assert _stored(replay, 0).get("state")[1:, 0].tolist() == [2.0, 2.0, 2.0]


def test_stale_generation_is_skipped():
    replay = _replay(streams=1, size=5, batch_size=1, batch_length=3)
    for step in range(5):
        replay.add(_records(step, 1))
    batch, handles = replay.sample()
    overwritten = batch.get("t")[0, 1:].tolist()
    for step in range(5, 5 + 5):  # rewrite every slot: all sampled handles are now stale
        replay.add(_records(step, 1))
    result = replay.write_back(handles, torch.ones(1, 3, 3), torch.ones(1, 3, 3)).result()
    assert result.updated_count == 0 and result.stale_count == 3
    stored = _stored(replay, 0)
    assert stored.get("state").abs().sum() == 0 and not set(overwritten) & set(stored.get("t").tolist())


def test_replay_too_small_for_one_sequence_is_refused():
    with pytest.raises(ValueError, match="less than one sequence"):
        Replay(4, 10, 1, 3, torch.device("cpu"))


@given(st.lists(st.one_of(st.tuples(st.just("add"), st.integers(1, 6)), st.just(("sample",)),
                         st.just(("write_back",))), min_size=1, max_size=30))
@settings(max_examples=40, deadline=None)
def test_a_stale_write_back_is_never_applied_even_racing_inserts(operations):
    """Property: whatever the interleaving of inserts, samples and write-backs (inserts between a sample
    and its write-back, as while the learner steps, and while torchrl's update thread applies earlier
    write-backs), a stored context is either untouched (0) or the posterior of the record just before it
    in its stream (t - 1), never a patch meant for a record that has since been overwritten."""
    replay = _replay(streams=2, size=16, batch_size=4, batch_length=2)  # 8 slots per stream: overwrites
    step, sampled, futures = 0, [], []

    def submit():
        batch, handles = sampled.pop(0)
        source = batch.get("t")[:, :-1].float().unsqueeze(-1).expand(4, 2, 3).contiguous()
        futures.append(replay.write_back(handles, source, source, wait=False))

    for _ in range(3):
        replay.add(_records(step, 2))
        step += 1
    for operation in operations:
        if operation[0] == "add":
            for _ in range(operation[1]):
                replay.add(_records(step, 2))
                step += 1
        elif operation[0] == "sample":
            sampled.append(replay.sample())
        elif sampled:
            submit()
    while sampled:
        submit()
    for future in futures:
        future.result()
    for member in range(2):
        stored = _stored(replay, member)
        for value, t in zip(stored.get("state")[:, 0].tolist(), stored.get("t").tolist()):
            assert value in (0.0, float(t - 1)), (value, t)
    replay.close()


def _chunk(stream: int, steps: range, width: int = 3) -> TensorDict:
    """Consecutive records of one stream, traceable like _records."""
    n = len(steps)
    return TensorDict({
        "t": torch.tensor([1000 * stream + step for step in steps]),
        "state": torch.zeros(n, width),
        "belief": torch.zeros(n, width),
        "is_init": torch.zeros(n, 1, dtype=torch.bool),
        "next": {"done": torch.zeros(n, 1, dtype=torch.bool)},
    }, [n])


def test_a_chunk_goes_to_its_own_stream_in_order():
    replay = _replay(streams=3, size=60, batch_size=8, batch_length=3)
    for step in range(0, 8, 4):  # chunks of 4 arrive per stream, in any stream order
        for stream in (2, 0, 1):
            replay.add_chunk(stream, _chunk(stream, range(step, step + 4)))
    for stream in range(3):
        assert _stored(replay, stream).get("t").tolist() == [1000 * stream + s for s in range(8)]
    batch, _ = replay.sample()
    t = batch.get("t")
    assert ((t[:, 1:] - t[:, :-1]) == 1).all()  # windows stay inside one stream, consecutive


def test_end_stream_marks_only_the_newest_record_of_that_stream():
    replay = _replay(streams=2, size=40, batch_size=2, batch_length=3)
    replay.add_chunk(0, _chunk(0, range(25)))  # wraps around: the newest record is not the last slot
    replay.add_chunk(1, _chunk(1, range(5)))
    assert replay.end_stream(0)
    stored = _stored(replay, 0)
    done = stored.get(("next", "done"))[:, 0]
    assert done.sum() == 1 and int(stored.get("t")[done]) == 24
    assert not _stored(replay, 1).get(("next", "done")).any()
    assert not _replay(streams=1, size=20, batch_size=1, batch_length=3).end_stream(0)  # empty: nothing to end


def test_grouped_write_back_equals_one_masked_update_per_member():
    """The ensemble's grouping (one stable sort and a bincount) against the plain per-member masks."""
    grouped, masked = _replay(streams=4, size=80, batch_size=12, batch_length=3), \
        _replay(streams=4, size=80, batch_size=12, batch_length=3)
    for step in range(15):
        grouped.add(_records(step, 4))
        masked.add(_records(step, 4))
    (batch, handles), (batch_m, handles_m) = grouped.sample(), masked.sample()
    assert torch.equal(batch.get("t"), batch_m.get("t"))
    state = torch.randn(12, 3, 3)
    grouped.write_back(handles, state, state + 1).result()

    index = handles_m.get("index")[:, 1:].reshape(-1)
    generation = handles_m.get("index_generation")[:, 1:].reshape(-1)
    members, slots = index.get("buffer_ids"), index.get("index")
    keep = last_write_wins(torch.stack([members, slots], -1))
    rows = state.reshape(-1, 3)[keep]
    for member in range(4):
        mask = members[keep] == member
        masked.buffer._rbs[member].update_if_present(
            index=slots[keep][mask], generation=generation[keep][mask],
            patch={"state": rows[mask], "belief": rows[mask] + 1})
    for member in range(4):
        assert torch.equal(_stored(grouped, member).get("state"), _stored(masked, member).get("state"))
        assert torch.equal(_stored(grouped, member).get("belief"), _stored(masked, member).get("belief"))
    assert any(_stored(grouped, member).get("state").abs().sum() > 0 for member in range(4))


def _with_context(step: int, streams: int, width: int = 3) -> TensorDict:
    """Records whose stored context names them: state = t, belief = -t."""
    records = _records(step, streams, width)
    t = records.get("t").float().unsqueeze(-1).expand(streams, width)
    records.set("state", t.clone())
    records.set("belief", -t)
    return records


def test_a_sample_carries_the_context_of_each_sequences_first_record():
    replay = _replay(streams=3, size=60, batch_size=16, batch_length=4)
    for step in range(12):
        replay.add(_with_context(step, 3))
    batch, _ = replay.sample()
    first = batch.get("t")[:, 0].float()
    for key, sign in (("state", 1), ("belief", -1)):
        context = batch.get(key)
        assert context.shape == (16, 5, 3)
        assert torch.equal(context[:, 0, 0], sign * first)
        assert torch.equal(context, context[:, :1].expand_as(context))  # the same along the sequence
    assert replay.lost_contexts == 0
    replay.close()


def _stock_replay_class():
    """scripts/bench_replay.py's replay on torchrl's own storage and SliceSampler (the benchmark's reference)."""
    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    from bench_replay import StockReplay

    return StockReplay


@pytest.mark.parametrize("stock", [False, True], ids=["ours", "torchrl_sampler"])
def test_windows_start_from_the_stored_context_and_are_not_marked_as_episode_starts(stock):
    """A window's first record keeps its stored is_init (False here): were it forced True, as torchrl's
    SliceSampler does by default, the learner would reset there and never use the stored context."""
    kind = _stock_replay_class() if stock else Replay
    replay = kind(2, 40, 64, 3, torch.device("cpu"), seed=0, context_dtype=torch.float32)
    for step in range(10):
        replay.add(_with_context(step, 2))
    batch, handles = replay.sample()
    t = batch.get("t")
    assert torch.all(t[:, 1:] - t[:, :-1] == 1)
    assert not batch.get("is_init").any()
    assert torch.equal(batch.get("state")[:, 0, 0], t[:, 0].float())
    assert torch.equal(batch.get("belief")[:, 0, 0], -t[:, 0].float())
    assert set(t[:, 0].remainder(1000).tolist()) == set(range(7))  # every window start of 10 records
    replay.close()


def test_a_first_record_overwritten_before_its_context_is_read_starts_afresh():
    """The context is read after the batch was gathered; a slot rewritten in between (its generation
    moved on) gives a zero context and is_init at the sequence start, never the new record's context."""
    replay = _replay(streams=1, size=5, batch_size=1, batch_length=3)
    for step in range(5):
        replay.add(_with_context(step, 1))
    data = replay.buffer.sample().reshape(1, 4)
    handles = data.select("index", "index_generation")
    first_t = int(data.get("t")[0, 0])
    state, belief, lost = replay._first_contexts(handles)
    assert not lost.any() and float(state[0, 0]) == first_t
    for step in range(5, 10):  # rewrite every slot
        replay.add(_with_context(step, 1))
    state, belief, lost = replay._first_contexts(handles)
    assert lost.tolist() == [True] and state.abs().sum() == 0 and belief.abs().sum() == 0
    assert replay.lost_contexts == 1
    replay.close()


def test_a_lost_context_marks_the_sequence_start_as_an_episode_start():
    replay = _replay(streams=2, size=40, batch_size=4, batch_length=3)
    for step in range(10):
        replay.add(_with_context(step, 2))
    lost = torch.tensor([False, True, False, True])
    replay._first_contexts = lambda handles: (torch.zeros(4, 3), torch.zeros(4, 3), lost)
    batch, _ = replay.sample()
    is_init = batch.get("is_init").reshape(4, 4)  # the slice sampler may drop the trailing 1
    assert is_init[:, 0].tolist() == lost.tolist() and not is_init[:, 1:].any()
    replay.close()


@pytest.mark.parametrize("chunks", [3, 4, 11])
def test_windows_of_chunked_streams_stay_inside_the_newest_records(chunks):
    """Chunks wrap the circular stream at any offset; every window is consecutive and fully stored."""
    replay = _replay(streams=1, size=10, batch_size=64, batch_length=3)
    for c in range(chunks):
        replay.add_chunk(0, TensorDict({key: torch.cat([_records(3 * c + k, 1)[key] for k in range(3)])
                                        for key in ("t", "state", "belief", "is_init", "next")}, [3]))
    written = 3 * chunks
    t = replay.sample()[0].get("t")
    assert torch.all(t[:, 1:] - t[:, :-1] == 1)
    assert int(t.min()) >= max(0, written - 10) and int(t.max()) <= written - 1
    assert set(t[:, 0].tolist()) == set(range(max(0, written - 10), written - 3))  # every window, uniformly
    replay.close()


def test_training_can_start_before_every_stream_has_a_sequence():
    """A stream whose producer has not delivered yet is never drawn; the others are sampled."""
    replay = _replay(streams=2, size=40, batch_size=4, batch_length=3)
    assert not replay.ready()
    replay.add_chunk(0, torch.cat([_records(step, 1) for step in range(3)]))
    assert not replay.ready()  # 3 records: short of one sequence of 4
    replay.add_chunk(0, torch.cat([_records(step, 1) for step in range(3, 6)]))
    assert replay.ready() and not replay.ready(every=True)
    batch, handles = replay.sample()
    assert (handles.get(("index", "buffer_ids")) == 0).all()
    assert (batch.get("t")[:, 1:] - batch.get("t")[:, :-1] == 1).all()  # consecutive records of stream 0
    replay.add_chunk(1, torch.cat([_records(step, 1) for step in range(4)]))
    assert replay.ready(every=True)
    replay.close()


def test_inserts_never_wait_for_a_cuda_stream(monkeypatch):
    """Records arrive with no device (a worker's chunk, unpickled). Moving such a tensordict to the
    storage's host device through tensordict's `.to("cpu")` waits for the calling thread's CUDA stream,
    where a GPU learner's updates queue; an insert holds the replay's locks meanwhile. The wait is
    tensordict's `_sync_all`, counted here (on a CPU-only machine it returns at once, but is called)."""
    from tensordict.base import TensorDictBase

    calls = []
    original = TensorDictBase._sync_all
    monkeypatch.setattr(TensorDictBase, "_sync_all", lambda self: calls.append(1) or original(self))
    replay = _replay(streams=2, size=40)
    for step in range(0, 8, 4):
        for stream in range(2):
            replay.add_chunk(stream, _chunk(stream, range(step, step + 4)))
    replay.add(_records(8, 2))
    assert calls == []
    assert _stored(replay, 1).get("t").tolist() == [1000 + s for s in range(8)] + [1008]


def test_a_sample_prepared_after_a_write_back_observes_it_and_one_prepared_before_does_not_wait():
    """With a sample prepared ahead: the batch handed out next was prepared before the write-back was
    submitted, so it is handed out while that write-back is still held back (no chained waits); the
    batch after it was prepared after the submission and is handed out only once it is applied.
    The write-back thread is held at a gate to make the order visible."""
    import threading

    replay = Replay(2, 40, 6, 3, torch.device("cpu"), seed=0, prefetch=1, context_dtype=torch.float32)
    for step in range(12):
        replay.add(_records(step, 2))
    gate, original = threading.Event(), replay._apply

    def held(*args):
        assert gate.wait(30)
        return original(*args)

    replay._apply = held
    batch, handles = replay.sample()  # hands out one, prepares the next
    source = batch.get("t")[:, :-1].float().unsqueeze(-1).expand(6, 3, 3).contiguous()
    write = replay.write_back(handles, source, source, wait=False)
    handed = []
    second = threading.Thread(target=lambda: handed.append(replay.sample()))
    second.start()
    second.join(30)
    assert handed and not write.done()  # prepared before the submission: not held back by it
    third = threading.Thread(target=lambda: handed.append(replay.sample()))
    third.start()
    third.join(1.0)
    assert third.is_alive()  # held until the write-back is applied (a correct order never passes it)
    gate.set()
    third.join(30)
    assert len(handed) == 2 and write.done() and write.result().updated_count > 0
    # The third batch's contexts were read after the write-back: each first record it patched holds t - 1.
    patched = set(zip(handles.get(("index", "buffer_ids"))[:, 1:].reshape(-1).tolist(),
                      handles.get(("index", "index"))[:, 1:].reshape(-1).tolist()))
    batch, handles = handed[1]
    firsts = zip(handles.get(("index", "buffer_ids"))[:, 0].tolist(), handles.get(("index", "index"))[:, 0].tolist(),
                 batch.get("t")[:, 0].tolist(), batch.get("state")[:, 0, 0].tolist())
    seen = [(value, t) for member, slot, t, value in firsts if (member, slot) in patched]
    assert seen and all(value == float(t - 1) for value, t in seen)
    replay.close()


def test_every_window_of_a_stream_can_be_drawn_and_none_past_its_newest_record():
    replay = _replay(streams=2, size=40, batch_size=64, batch_length=3)
    for step in range(10):  # stream 0: 10 records, 7 windows of 4; stream 1 stays shorter than one window
        replay.add_chunk(0, _chunk(0, range(step, step + 1)))
    replay.add_chunk(1, _chunk(1, range(2)))
    starts = set()
    for _ in range(5):
        t = replay.sample()[0].get("t")
        assert bool((t // 1000 == 0).all())  # the stream without a window is never drawn
        starts.update(t[:, 0].tolist())
    assert starts == set(range(7))


def test_the_table_generations_are_the_writers_own():
    """Sampling and write-backs read generations from the table; the writers bump them there."""
    replay = _replay(streams=3, size=30, batch_size=4, batch_length=3)
    for step in range(25):  # 2.5 passes over each stream's 10 slots
        replay.add(_records(step, 3))
    replay.add_chunk(1, _chunk(1, range(25, 29)))
    for stream, member in enumerate(replay.buffer._rbs):
        expected = member.writer.generations_of(torch.arange(10))
        assert torch.equal(replay.table.generations[stream], expected)
    assert replay.table.generations[1].tolist() == [2] * 9 + [1]  # 29 writes into 10 slots (a first write: 0)


def test_online_sampling_hands_each_fresh_window_to_the_next_batch_once_and_uniform_fills_the_rest():
    """Streams of 2 envs, windows of batch_length + 1 = 4 records: every 3 records of a stream make a fresh
    window (its last 4), which the next batch holds once; a batch with no fresh window is all uniform.
    A chunk of one stream completes several windows at once; a window evicted before any batch took it
    is dropped. Off, nothing is guaranteed beyond the uniform draw."""
    replay = Replay(2, 2 * 12, 4, 3, torch.device("cpu"), seed=0, online=True)
    for step in range(4):
        replay.add(_records(step, 2))
    batch, _ = replay.sample()  # positions 0..3 of both streams are fresh
    assert sorted(batch.get("t")[:2].tolist()) == [[0, 1, 2, 3], [1000, 1001, 1002, 1003]]
    assert replay.online_sampled == 2
    replay.sample()  # nothing new: uniform only
    assert replay.online_sampled == 2
    for step in range(4, 7):
        replay.add(_records(step, 2))
    batch, _ = replay.sample()
    assert sorted(batch.get("t")[:2, 0].tolist()) == [3, 1003]  # positions 3..6: one record shared with the last
    # One stream's chunk of 7 records completes windows ending at positions 10 and 13 of stream 1.
    chunk = torch.arange(7, 14) + 1000
    replay.add_chunk(1, _records(0, 7).set("t", chunk))
    batch, _ = replay.sample()
    assert batch.get("t")[:2, 0].tolist() == [1006, 1009]  # fresh windows first, oldest first
    # Windows queued, then overwritten (12 records per stream) before a batch took them: dropped.
    replay.add_chunk(1, _records(0, 15).set("t", torch.arange(14, 29) + 1000))
    taken = replay.online_sampled
    batch, _ = replay.sample()
    assert replay.online_sampled - taken == 3  # of 5 queued windows (ends 16, 19, 22, 25, 28), 3 still held
    assert batch.get("t")[:3, 0].tolist() == [1018, 1021, 1024]
    replay.close()
