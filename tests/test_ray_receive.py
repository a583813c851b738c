"""The order in which `RayPool.receive` hands over a pump's messages (dreamer/ray_workers.py).

Needs no Ray: the pump's side of the pipe is written here, message by message, in the orders a real pump
can produce (tests/test_ray.py runs the real pump, actors and kills, where those orders come by chance).
"""

from __future__ import annotations

import multiprocessing
import time

import torch
from tensordict import TensorDict

from dreamer.ray_workers import Packed, RayPool, Restarted
from dreamer.workers import Chunk


def _chunk(stream: int, first: int) -> Chunk:
    return Chunk(stream, Packed.of(TensorDict({"step": torch.arange(first, first + 4)}, batch_size=[4])), [], 0)


def _pool(events: list) -> tuple[RayPool, object]:
    """A pool of three streams (one `receive` hands over up to three chunks) fed through a pipe written here."""
    pool = RayPool({}, 0, None, None, [None] * 3, on_restart=lambda s: events.append(("restart", s)),
                   announce=None)
    context = multiprocessing.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    pool.pipe, pool.taken = reader, context.RawValue("q", 0)
    return pool, writer


def _read(pool: RayPool, events: list) -> None:
    for chunk in pool.receive(timeout=1.0):
        events.append(("chunk", chunk.stream, int(chunk.records["step"][0])))


def test_a_replacement_read_after_its_streams_chunk_ends_the_stream_after_that_chunk_is_handed_over():
    events: list = []
    pool, writer = _pool(events)
    for message in (_chunk(0, 0), _chunk(1, 0), Restarted(0, "gone"), _chunk(0, 100), Restarted(1, "gone")):
        writer.send(message)
    _read(pool, events)  # the chunks of both streams; stream 0's replacement waits for the next call
    assert events == [("chunk", 0, 0), ("chunk", 1, 0)]
    _read(pool, events)  # stream 0 ends before its new actor's chunk; stream 1, with no chunk in this read, at once
    assert events == [("chunk", 0, 0), ("chunk", 1, 0), ("restart", 0), ("restart", 1), ("chunk", 0, 100)]
    assert pool.restarts == 2


def test_packed_records_come_back_as_they_were_through_a_pipe():
    """A chunk's records as the actors send them (numpy arrays): every leaf back with its key, dtype and
    values, writable, after the pipe between the pump and the trainer."""
    records = TensorDict({"observation": torch.randint(0, 255, (8, 3, 4, 4), dtype=torch.uint8),
                          "belief": torch.randn(8, 5), "is_init": torch.rand(8) > 0.5,
                          "next": {"reward": torch.randn(8), "done": torch.zeros(8, 1, dtype=torch.bool)}},
                         batch_size=[8])
    reader, writer = multiprocessing.get_context("spawn").Pipe(duplex=False)
    writer.send(Packed.of(records))
    back = reader.recv().tensordict()
    assert back.batch_size == records.batch_size
    assert set(back.keys(True, True)) == set(records.keys(True, True))
    for key, value in records.items(True, True):
        assert back.get(key).dtype == value.dtype and torch.equal(back.get(key), value), key
    back.get("belief").add_(1)  # its own memory, writable


def test_a_replacement_of_a_stream_without_chunks_in_the_same_read_ends_it_at_once():
    events: list = []
    pool, writer = _pool(events)
    for message in (_chunk(1, 0), Restarted(0, "gone"), _chunk(0, 100)):
        writer.send(message)
    _read(pool, events)
    assert events == [("restart", 0), ("chunk", 1, 0), ("chunk", 0, 100)]


def test_chunks_read_before_the_pumps_end_are_handed_over_before_it_counts_as_dead():
    events: list = []
    pool, writer = _pool(events)
    writer.send(_chunk(0, 0))
    writer.close()  # the pump died after sending a chunk
    _read(pool, events)
    assert events == [("chunk", 0, 0)] and pool.pipe is not None  # not yet dead: that chunk goes first
    pool._closing = True  # the pump's end is then read as a closing pool's, which starts no new pump
    pool.process = multiprocessing.get_context("spawn").Process(target=int)
    pool.process.start()
    _read(pool, events)
    assert pool.pipe is None and events == [("chunk", 0, 0)]


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_pump_busy_is_the_pumps_cpu_time_over_the_wall_time():
    """`collect/pump_busy` of a process that spins (as a pump bound by its work does) and of one that sleeps."""
    pool, _ = _pool([])
    context = multiprocessing.get_context("spawn")
    for target, low, high in ((_spin, 0.3, 1.2), (time.sleep, 0.0, 0.1)):
        pool.process = context.Process(target=target, args=(6.0,))
        pool.process.start()
        time.sleep(2.0)  # past the child's start (its imports count as busy)
        assert pool.stats() == {}  # the first call of a pump only marks the start
        time.sleep(2.0)
        busy = pool.stats()["collect/pump_busy"]
        assert low <= busy <= high, (target, busy)
        pool.process.join()
