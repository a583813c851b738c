"""One env worker's own cost per env step: the worker process of `run.collect=workers`, without a server.

    python scripts/bench_worker.py [--latency 0] [--seconds 5] [--windows 5] [--model size200m] [--chunk 64]
    python scripts/bench_worker.py --latency 0.05 --seconds 10 --windows 3   # the env's step at MineRL's latency

Runs `dreamer.workers._worker_main` (the code a worker runs: `dreamer.collect.Collector` on one emulated
Minecraft env, its policy a `dreamer.inference.RowClient` of a real slot transport, its chunks sent over a
pipe) in a process of its own, with one change: the slot's doorbell answers at once, in the worker, by
writing an action into the slot's response row (a deterministic cycle through the 25 actions, so every
branch of the env is taken), instead of waiting for a server. A step thus costs the worker's own work
only: the env's step (the adapter and the emulated latency), the request's copy into the slot and the
answer's copy out, the collector's records and checks, and the loop's chunks (read here by this process).

Prints one JSON line per window of `--seconds` s (after a warm-up), then a summary line with the medians:
env_steps_per_s; cpu_ms_per_step (the worker process's CPU time, user and system, per env step: with
`--latency 0` the worker's whole cost); and ms per step by part, from the worker's own timing slots
(`WorkerPool.timing`): policy (the request, the answer and the doorbell), env (the env's calls: with a
latency, its excess over the latency is the adapter's work and the sleep's overshoot, env_excess_ms),
own (the collector's work around them) and between (the loop outside the collector's step).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]


class InstantDoorbell:
    """A slot's doorbell that answers the request itself: it writes the next action of a fixed cycle into
    the slot's response row (the state and belief stay zeros) and reports the ring at once."""

    def __init__(self, responses: torch.Tensor, response_rows, slot: int, actions: int):
        self.responses, self.response_rows, self.slot, self.actions = responses, response_rows, slot, actions
        self.count = 0
        self.action = None

    def clear(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> bool:
        if self.action is None:
            views = dict(self.response_rows.views(self.responses[self.slot:self.slot + 1]))
            self.action = views[("policy", "action")]
        self.action.zero_()
        self.action[0, (self.count * 7) % self.actions] = 1.0
        self.count += 1
        return True


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process `pid` so far (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drain(reader, stop: threading.Event) -> None:
    """Reads (and drops) the worker's chunks, as the trainer's ingest thread would."""
    while not stop.is_set():
        try:
            if reader.poll(0.1):
                reader.recv()
        except (EOFError, OSError):
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=float, default=0.0, help="the emulated env's seconds per step")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of a window")
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds stepped before the first window")
    parser.add_argument("--model", default="size200m", help="the carry's size (configs/model/<model>.yaml)")
    parser.add_argument("--chunk", type=int, default=64, help="records per chunk (run.chunk)")
    args = parser.parse_args()

    from omegaconf import OmegaConf

    from dreamer import reaper
    from dreamer.agent import EnvLayout
    from dreamer.config import reference_settings
    from dreamer.envs import make_env
    from dreamer.inference import KillSafeSlotTransport, request_spec, response_spec
    from dreamer.workers import TIMES, _worker_main

    reaper.guard()
    env_cfg = OmegaConf.load(ROOT / "configs" / "env" / "emulated.yaml")
    env_cfg.step_latency = args.latency
    env = make_env(env_cfg, 0)
    layout = EnvLayout.from_specs(env.observation_spec, env.action_spec)
    env.close()
    size = reference_settings(args.model)[0]
    transport = KillSafeSlotTransport(request_spec(layout, size), response_spec(layout, size), num_slots=1)
    client = transport.client()
    client.doorbell = InstantDoorbell(transport.responses, transport.response_rows, 0, layout.action_dim)

    context = multiprocessing.get_context("spawn")
    stop, stepped, timing = context.Event(), context.RawArray("q", 1), context.RawArray("d", TIMES)
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=_worker_main, name="dreamer-env-0", daemon=True,
                              args=(0, OmegaConf.to_container(env_cfg), 0, layout, size, client, writer, stop,
                                    args.chunk, "emulated", 10, stepped, timing, os.getpid()))
    process.start()
    reaper.register(process.pid)
    writer.close()
    done = threading.Event()
    reading = threading.Thread(target=drain, args=(reader, done), daemon=True)
    reading.start()
    while stepped[0] == 0 and process.is_alive():
        time.sleep(0.05)
    time.sleep(args.warmup)

    def snapshot():
        return time.perf_counter(), stepped[0], cpu_seconds(process.pid), list(timing)

    rows = []
    for window in range(args.windows):
        before = snapshot()
        time.sleep(args.seconds)
        after = snapshot()
        steps = after[1] - before[1]
        part = [(a - b) / steps * 1e3 for a, b in zip(after[3], before[3])]  # policy, env, step, loop, ...
        row = {
            "window": window, "latency": args.latency, "env_steps_per_s": steps / (after[0] - before[0]),
            "cpu_ms_per_step": (after[2] - before[2]) / steps * 1e3,
            "policy_ms": part[0], "env_ms": part[1], "own_ms": part[2] - part[0] - part[1],
            "between_ms": part[3] - part[2], "env_excess_ms": part[1] - args.latency * 1e3,
        }
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    stop.set()
    process.join(timeout=10)
    if process.is_alive():
        process.kill()
    done.set()
    summary = {"summary": "median", "latency": args.latency, "windows": len(rows)}
    for key in rows[0]:
        if key not in ("window", "latency"):
            summary[key] = round(statistics.median(row[key] for row in rows), 4)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
