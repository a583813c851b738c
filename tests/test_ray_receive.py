"""The order in which `RayPool.receive` hands over a pump's messages (dreamer/ray_workers.py).

Needs no Ray: the pump's side of the pipe is written here, message by message, in the orders a real pump
can produce (tests/test_ray.py runs the real pump, actors and kills, where those orders come by chance).
"""

from __future__ import annotations

import multiprocessing
import time

import torch
from tensordict import TensorDict

from dreamer.ray_workers import OUT_OF_MEMORY, Packed, Placed, RayPool, Restarted
from dreamer.workers import Chunk


def _chunk(stream: int, first: int) -> Chunk:
    return Chunk(stream, Packed.of(TensorDict({"step": torch.arange(first, first + 4)}, batch_size=[4])), [], 0)


def _pool(events: list) -> tuple[RayPool, object]:
    """A pool of three streams (one `receive` hands over up to three chunks) fed through a pipe written here."""
    pool = RayPool({}, 0, None, None, [None] * 3, on_restart=lambda s: events.append(("restart", s)),
                   announce=None)
    context = multiprocessing.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    pool.shards[0].pipe, pool.shards[0].taken = reader, context.RawValue("q", 0)
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
    assert events == [("chunk", 0, 0)] and pool.shards[0].pipe is not None  # not yet dead: that chunk goes first
    pool._closing = True  # the pump's end is then read as a closing pool's, which starts no new pump
    pool.shards[0].process = multiprocessing.get_context("spawn").Process(target=int)
    pool.shards[0].process.start()
    _read(pool, events)
    assert pool.shards[0].pipe is None and events == [("chunk", 0, 0)]


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_pump_busy_is_the_pumps_cpu_time_over_the_wall_time():
    """`collect/pump_busy` of a process that spins (as a pump bound by its work does) and of one that sleeps."""
    pool, _ = _pool([])
    context = multiprocessing.get_context("spawn")
    for target, low, high in ((_spin, 0.3, 1.2), (time.sleep, 0.0, 0.1)):
        pool.shards[0].process = context.Process(target=target, args=(6.0,))
        pool.shards[0].process.start()
        time.sleep(2.0)  # past the child's start (its imports count as busy)
        assert pool.stats() == {}  # the first call of a pump only marks the start
        time.sleep(2.0)
        busy = pool.stats()["collect/pump_busy"]
        assert low <= busy <= high, (target, busy)
        pool.shards[0].process.join()


def _transport(slots: int):
    from dreamer.inference import KillSafeSlotTransport

    request = TensorDict(observation=torch.zeros(3))
    response = TensorDict(policy=TensorDict(action=torch.zeros(2)), policy_version=torch.zeros((), dtype=torch.long))
    return KillSafeSlotTransport(request, response, num_slots=slots)


def test_the_pumps_start_takes_the_clients_of_many_streams():
    """The pump is started with every stream's client, and a forkserver start passes at most 252 descriptors:
    with each slot's error queue (a pipe, two descriptors) the 128 streams of a GPU run failed with "too many
    fds". The pool's clients leave their queues behind (`RowClient.without_errors`)."""
    transport = _transport(200)
    clients = [transport.client() for _ in range(200)]
    context = multiprocessing.get_context("forkserver")
    whole = context.Process(target=len, args=(clients,))
    try:
        whole.start()
    except ValueError as error:  # what the pump's start met
        assert "too many fds" in str(error)
    else:
        whole.join(30)
        raise AssertionError("a start with 200 error queues passed: the limit this test guards is gone")
    pool = RayPool({}, 0, None, None, clients, announce=None)
    child = context.Process(target=len, args=(pool.clients,))  # the child unpickles them all, then len()s them
    child.start()
    child.join(60)
    assert child.exitcode == 0


def test_a_client_without_its_error_queue_names_its_slot_when_the_server_fails(capfd):
    transport = _transport(2)
    client = transport.client().without_errors()
    client.post(torch.zeros(client.request_rows.width, dtype=torch.uint8))
    transport.resolve_exception(0, ValueError("the policy's input is wrong"))
    try:
        client.answer()
    except RuntimeError as error:
        assert "slot 0's request" in str(error)
    else:
        raise AssertionError("a failed request returned an answer")
    assert "ValueError(\"the policy's input is wrong\")" in capfd.readouterr().err


def _pumps(pool: RayPool) -> list:
    """Each of the pool's pumps fed through a pipe written here: the writers."""
    context = multiprocessing.get_context("spawn")
    writers = []
    for shard in pool.shards:
        reader, writer = context.Pipe(duplex=False)
        shard.pipe, shard.taken = reader, context.RawValue("q", 0)
        writers.append(writer)
    return writers


def test_a_pool_of_two_pumps_hands_over_both_and_says_where_the_actors_went_once_both_placed_theirs():
    events, notes = [], []
    pool = RayPool({}, 0, None, None, [None] * 3, on_restart=lambda s: events.append(("restart", s)),
                   announce=notes.append, envs_per_pump=2)
    assert [shard.streams for shard in pool.shards] == [[0, 1], [2]]
    writers = _pumps(pool)
    now = time.monotonic()
    pool.shards[0].spawned = now - 5.0
    writers[0].send(Placed({"cpu-1": 2}, now, 1.5))
    writers[0].send(_chunk(1, 0))
    _read(pool, events)
    assert events == [("chunk", 1, 0)] and notes == []  # the second pump's actors are not placed yet
    writers[1].send(_chunk(2, 0))
    writers[1].send(Placed({"cpu-2": 1}, now + 2.0, 0.0))
    writers[0].send(_chunk(0, 0))
    _read(pool, events)
    assert sorted(events) == [("chunk", 0, 0), ("chunk", 1, 0), ("chunk", 2, 0)]
    assert notes == ["dreamer: 3 Ray env workers on 2 node(s): cpu-1 (2), cpu-2 (1); all placed 7.0 s after the "
                     "pump's start (Ray's own start 1.5 s); 2 pumps of up to 2 env workers"]
    assert [shard.taken.value for shard in pool.shards] == [2, 1]  # each pump's backpressure counts its own


def _wait_for(stop) -> None:
    stop.wait(60)  # a live pump: it ends when the pool sets stop


def test_a_pumps_death_stops_the_other_pumps_ends_every_stream_and_starts_them_again(monkeypatch):
    """The second pump dies: the first (here a process that waits for `stop`, as a pump's loop does) ends,
    every stream ends with its slot forgotten, and the pool starts new pumps (recorded here, not started:
    a real start is tests/test_ray.py's)."""
    events, forgotten, started = [], [], []
    pool = RayPool({}, 0, None, None, [None] * 2, on_restart=lambda s: events.append(("restart", s)),
                   forget_slot=forgotten.append, announce=None, envs_per_pump=1)
    writers = _pumps(pool)
    stop = pool.stop
    context = multiprocessing.get_context("spawn")
    pool.shards[0].process = context.Process(target=_wait_for, args=(stop,))
    pool.shards[1].process = context.Process(target=int)
    for shard in pool.shards:
        shard.process.start()
    pool.shards[1].process.join()
    writers[1].close()  # the second pump died
    monkeypatch.setattr(pool, "_spawn", lambda: started.append(pool.stop))
    _read(pool, events)
    assert pool.shards[0].process.exitcode == 0  # it ended on stop, not killed
    assert stop.is_set() and [shard.pipe for shard in pool.shards] == [None, None]
    assert events == [("restart", 0), ("restart", 1)] and forgotten == [0, 1] and pool.restarts == 2
    assert started and started[0] is not stop and not started[0].is_set()  # the new pumps' own stop


def test_a_pool_names_the_pump_modes_when_given_another():
    try:
        RayPool({}, 0, None, None, [None], announce=None, pump="pipeline")
    except ValueError as error:
        assert str(error) == "pump must be one of pipelined, sweep, got 'pipeline'"
    else:
        raise AssertionError("a pool took an unknown pump mode")


def test_workers_killed_for_memory_are_replaced_and_the_run_says_once_what_to_set():
    """Ray's memory monitor kills actors when a node is full (reason as the pump passes it on); each
    replacement is announced, and one line says what to do about it."""
    events: list = []
    pool, writer = _pool(events)
    said: list[str] = []
    pool.announce = said.append
    killed = "OutOfMemoryError: 8 worker(s) were killed due to the node running low on memory."
    for stream in (2, 1, 2):
        writer.send(Restarted(stream, killed))
    for _ in range(3):
        _read(pool, events)
    assert events == [("restart", 2), ("restart", 1), ("restart", 2)] and pool.memory_kills == 3
    assert said.count(OUT_OF_MEMORY) == 1 and sum("replaced (OutOfMemoryError" in line for line in said) == 3
    assert "run.ray_env_memory_gb" in OUT_OF_MEMORY
