"""The served policy's pass alone: its CUDA graph (`dreamer.inference._ServingGraph`) by batch and precision.

    python scripts/bench_serving.py                       # +exp=minecraft env=emulated (size200m), batches 8..64
    python scripts/bench_serving.py --preset dmc_proprio --model size1m --batches 4,16

One JSON line per (precision, batch): replay_gpu_ms, the graph's replay between two CUDA events on the
serving stream; call_ms, the whole call as a server makes it (inputs from pinned host memory, replay,
the action back to the host), host clock. Medians of --repeats. Precisions: fp32 (as served now), tf32
(float32 products on TF32 tensor cores, the flag on while capturing), bf16 (autocast, as the learner).
The inference server's own work around the pass (gathering requests, answering slots) is not in it: the
server's inference/p50_ms minus call_ms is that work.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dreamer.agent import EnvLayout, build_agent  # noqa: E402
from dreamer.config import compose_config, validate  # noqa: E402
from dreamer.envs import make_env  # noqa: E402
from dreamer.inference import _Acting, _ServingGraph, request_spec  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="minecraft")
    parser.add_argument("--model", help="model=NAME override (default: the preset's)")
    parser.add_argument("--batches", default="8,16,32,64")
    parser.add_argument("--precisions", default="fp32,tf32,bf16")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--out", help="also append the JSON lines to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench_serving.py measures CUDA graphs: run it on a machine with a GPU")
    overrides = [f"+exp={args.preset}", "run.dir=."] + (["env=emulated"] if args.preset == "minecraft" else [])
    overrides += [f"model={args.model}"] if args.model else []
    cfg = compose_config(overrides)
    settings = validate(cfg)
    env = make_env(cfg.env, 0)
    layout = EnvLayout.from_specs(env.observation_spec, env.action_spec)
    env.close()
    device = torch.device("cuda")
    with torch.device(device):
        policy = build_agent(layout, settings.size, settings.acting_bf16).policy.eval().requires_grad_(False)
    stream = torch.cuda.Stream(device)
    for precision in args.precisions.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            acting = _Acting(policy, explore=True)

            def model(td, acting=acting, autocast=precision == "bf16"):
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    return acting(td)
            example = request_spec(layout, settings.size).expand(batch).clone().to(device)
            host = request_spec(layout, settings.size).expand(batch).clone().pin_memory()
            torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"  # read at capture: the graph keeps it
            with torch.cuda.stream(stream):
                graph = _ServingGraph(model, example)
                torch.backends.cuda.matmul.allow_tf32 = False
                replays, calls = [], []
                for _ in range(args.repeats):
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record(stream)
                    graph.graph.replay()
                    end.record(stream)
                    end.synchronize()
                    replays.append(begin.elapsed_time(end))
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    graph(host).get(("policy", "action")).to("cpu", non_blocking=True)
                    stream.synchronize()
                    calls.append((time.perf_counter() - start) * 1e3)
            replays.sort(), calls.sort()
            line = json.dumps({"preset": args.preset, "model": cfg.model.name, "precision": precision, "batch": batch,
                               "replay_gpu_ms": round(replays[len(replays) // 2], 3),
                               "call_ms": round(calls[len(calls) // 2], 3), "gpu": torch.cuda.get_device_name(device)})
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
