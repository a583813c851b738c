"""The Ray pump's loop (dreamer/ray_workers.py, `_Pump.run`) against a server held mid-pass.

A real local Ray cluster, real actors and the real slot transport; the actors step no env (each reply
comes after a fixed sleep, as an env's step would) and the server is a thread of this test that answers
slots by hand, so that it can hold a pass open: that is the behaviour faked here. Skipped where the
`ray` extra is not installed.
"""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import torch
from tensordict import TensorDict

pytest.importorskip("ray")

import ray  # noqa: E402

from dreamer.inference import KillSafeSlotTransport  # noqa: E402
from dreamer.ray_workers import Reply, _Pump  # noqa: E402
from dreamer.workers import TIMES  # noqa: E402


class _Stepper:
    """An actor with `EnvWorker`'s calls whose env step is a sleep: stream s replies `delays[s]` seconds
    after each call, with a request row of zeros."""

    def __init__(self, stream, env_cfg, seed, layout, size, chunk, suite, max_restarts):
        self.delay, self.width = env_cfg["delays"][stream], env_cfg["width"]

    def where(self):
        return "node", "host"

    def exchange(self, answer):
        time.sleep(self.delay)
        return Reply(request=bytes(self.width), steps=1, seconds=[0.0, 0.0, 0.0, 0.0])

    def close(self):
        pass


@pytest.mark.parametrize("mode", ["pipelined", "sweep"])
def test_a_reply_that_comes_while_the_server_holds_a_pass_waits_for_that_pass_in_a_sweep_only(mode):
    """Stream 0 replies at once, stream 1 after 0.3 s. Once both actors have stepped, the server takes a
    request of stream 0 that comes while stream 1 is stepping and holds its pass open until stream 1's
    request is in its slot (3 s at most): the pipelined pump posts it meanwhile; the sweep pump waits for the
    pass's answers before it takes more replies, so stream 1's request stays unposted for all of the 3 s.
    Then the server answers every request, and both streams go on stepping."""
    transport = KillSafeSlotTransport(TensorDict(observation=torch.zeros(3)),
                                      TensorDict(policy=TensorDict(action=torch.zeros(2))), num_slots=2)
    ready = transport._request_ready
    clients = {0: transport.client(), 1: transport.client()}
    stop, serving = threading.Event(), threading.Event()  # the pump's stop; the held pass answered
    closing = threading.Event()  # the server's stop, once the pump has stopped (a sweep may wait on it)
    stepped = multiprocessing.RawArray("q", 2)
    held: dict = {}

    def answer(slots) -> None:
        slots = [slot for slot in slots if ready[slot]]
        for slot in slots:
            ready[slot] = 0
        transport.ring(slots)

    def serve() -> None:
        # Every request answered as it comes until both actors have stepped: their starts may come in either
        # order, seconds apart, and a sweep waits for the answer to whichever request it posted first.
        while min(stepped) < 1 and not closing.is_set():
            answer((0, 1))
            time.sleep(0.001)
        # The held pass: a request of stream 0 in its slot while stream 1 steps. One of stream 1 alone is
        # answered; with both in, or stream 1's following within 50 ms (posted with it), both are answered
        # and the next one looked for.
        while not closing.is_set():
            if ready[0] and not ready[1]:
                time.sleep(0.05)
                if not ready[1]:
                    break
            answer((0, 1))
            time.sleep(0.001)
        start = time.monotonic()
        while not ready[1] and time.monotonic() - start < 3.0 and not closing.is_set():
            time.sleep(0.001)
        held.update(posted=bool(ready[1]), seconds=time.monotonic() - start)
        answer((0,))
        serving.set()
        while not closing.is_set():  # then every request, as it comes
            answer((0, 1))
            time.sleep(0.001)

    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    reader, writer = multiprocessing.Pipe(duplex=False)
    args = ({"delays": [0.0, 0.3], "width": transport.requests.shape[1]}, 0, None, None, 8, 3)
    pump = _Pump(ray.remote(_Stepper), args, clients, writer, stop, 3, 60.0, stepped,
                 multiprocessing.RawArray("d", 2 * TIMES), multiprocessing.RawValue("q", 0), {"num_cpus": 0.5},
                 "test", None, mode)
    server = threading.Thread(target=serve, daemon=True)
    looping = threading.Thread(target=pump.run, daemon=True)
    try:
        server.start()
        looping.start()
        assert serving.wait(120), f"no pass held: steps {list(stepped)}, pump running {looping.is_alive()}"
        deadline = time.monotonic() + 60
        while min(stepped) < 5 and time.monotonic() < deadline and looping.is_alive():
            time.sleep(0.05)
        assert held["posted"] == (mode == "pipelined"), held  # stream 1's request posted while the pass was held
        assert stepped[0] >= 5 and stepped[1] >= 5, list(stepped)  # answers went back: both streams step
    finally:
        stop.set()
        looping.join(30)
        closing.set()
        server.join(10)
        pump.close()
        ray.shutdown()
    assert not looping.is_alive()
    while reader.poll():  # the pump's notes (its actors' placement): it sent them, nothing else
        assert type(reader.recv()).__name__ in ("Placed", "Note")
