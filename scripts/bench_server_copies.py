"""The inference server's host copies per pass, by its process's intra-op threads, beside busy processes.

    python scripts/bench_server_copies.py [--threads 0,1] [--busy 2] [--rows 6] [--model size200m]

A pass of the server (`dreamer.inference.RowPass`) gathers the ready requests' rows from the shared request
bank (`index_select`) and scatters the answers into the response bank (`index_copy_`): two host copies
of a few rows of the Minecraft preset's layout (a row per request: image, inventory and the policy's carry
at `--model`). torch runs them on an OpenMP team of `torch.get_num_threads()` threads. This times those two
copies, `--rows` rows at a time, in a process of its own for each `--threads` value (0: torch's default,
one thread per core), while `--busy` processes spin on the CPU (as env workers beside the server do), and
prints one JSON line per value (median, p99 and max in ms) and the p99 ratio of the first to the last.
The figures are CPU figures of the machine it runs on, not a GPU pass.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def spin(stop) -> None:
    count = 0
    while not stop.is_set():
        for _ in range(10_000):
            count += 1


def minecraft_widths(model: str) -> tuple[int, int]:
    """The request and response row widths (bytes) of the Minecraft preset at `model`."""
    from omegaconf import OmegaConf

    from dreamer.agent import EnvLayout
    from dreamer.config import reference_settings
    from dreamer.envs import emulated
    from dreamer.inference import Rows, request_spec, response_spec

    env_cfg = OmegaConf.create(dict(step_latency=0.0, reset_latency=0.0, max_episode_steps=100, break_speed=100.0,
                                    size=[64, 64]))
    env = emulated.make(env_cfg, 0)
    layout = EnvLayout.from_specs(env.observation_spec, env.action_spec)
    env.close()
    size = reference_settings(model)[0]
    return Rows(request_spec(layout, size)).width, Rows(response_spec(layout, size)).width


def measure(threads: int, widths: tuple[int, int], rows: int, passes: int, out) -> None:
    if threads > 0:
        torch.set_num_threads(threads)
    slots = 64
    requests = torch.zeros(slots, widths[0], dtype=torch.uint8).share_memory_()
    responses = torch.zeros(slots, widths[1], dtype=torch.uint8).share_memory_()
    host_request = torch.zeros(slots, widths[0], dtype=torch.uint8)
    host_response = torch.zeros(slots, widths[1], dtype=torch.uint8)
    times = []
    for _ in range(passes):
        index = torch.randperm(slots)[:rows]
        began = time.perf_counter()
        torch.index_select(requests, 0, index, out=host_request[:rows])
        responses.index_copy_(0, index, host_response[:rows])
        times.append((time.perf_counter() - began) * 1e3)
        time.sleep(0.0005)  # passes come about every millisecond or two
    times.sort()
    out.put({"threads": torch.get_num_threads(), "asked": threads, "rows": rows,
             "p50_ms": round(times[len(times) // 2], 3), "p99_ms": round(times[int(len(times) * 0.99)], 3),
             "max_ms": round(times[-1], 3)})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="0,1", help="comma-separated thread counts (0: torch's default)")
    parser.add_argument("--busy", type=int, default=2, help="spinning processes beside the measurement")
    parser.add_argument("--rows", type=int, default=6, help="requests per pass")
    parser.add_argument("--passes", type=int, default=3000)
    parser.add_argument("--model", default="size200m")
    args = parser.parse_args()
    try:
        counts = [int(t) for t in args.threads.split(",") if t]
    except ValueError:
        parser.error(f"--threads must be comma-separated integers, got {args.threads!r}")
    if not counts or min(counts) < 0 or args.busy < 0 or not 1 <= args.rows <= 64 or args.passes < 100:
        parser.error("--threads >= 0, --busy >= 0, --rows in [1, 64], --passes >= 100")
    widths = minecraft_widths(args.model)
    context = multiprocessing.get_context("spawn")
    stop, results = context.Event(), context.Queue()
    spinners = [context.Process(target=spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    for process in spinners:
        process.start()
    lines = []
    try:
        for threads in counts:
            worker = context.Process(target=measure, args=(threads, widths, args.rows, args.passes, results))
            worker.start()
            line = {**results.get(timeout=600), "busy": args.busy, "request_bytes": widths[0],
                    "response_bytes": widths[1], "model": args.model}
            worker.join()
            print(json.dumps(line), flush=True)
            lines.append(line)
    finally:
        stop.set()
        for process in spinners:
            process.join(timeout=5)
    if len(lines) > 1:
        ratio = lines[0]["p99_ms"] / max(lines[-1]["p99_ms"], 1e-9)
        print(json.dumps({"p99_ratio": round(ratio, 1), "of": f"{lines[0]['threads']} threads",
                          "against": f"{lines[-1]['threads']} threads"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
