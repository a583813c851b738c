"""Environment throughput: env steps/s of one suite with random actions, for 1..N worker processes.

    python scripts/bench_envs.py --suite crafter --workers 1,16,64 --seconds 20 [key=value ...]

Each worker process builds one env with `dreamer.envs.make_env` (the same code training uses), steps it
with uniformly random actions for `--seconds` after a warm-up, and reports its count; the total over
workers is the figure. Extra `key=value` arguments override the suite's configs/env/<suite>.yaml.
Prints one JSON line per worker count: suite, workers, cores, steps_per_second, per_worker.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "env"


def _worker(env_cfg: dict, seed: int, seconds: float, start, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from omegaconf import OmegaConf

    from dreamer.envs import make_env

    torch.set_num_threads(1)
    env = make_env(OmegaConf.create(env_cfg), seed)
    td = env.reset()
    for _ in range(20):  # warm-up: first resets and steps are slower
        td = env.rand_step(td)
        td = env.reset() if bool(td.get(("next", "done"))) else td.get("next")
    start.wait(timeout=900)
    steps, begin = 0, time.perf_counter()
    while time.perf_counter() - begin < seconds:
        td = env.rand_step(td)
        steps += 1
        td = env.reset() if bool(td.get(("next", "done"))) else td.get("next")
    results.put(steps / (time.perf_counter() - begin))
    env.close()


def measure(env_cfg: dict, workers: int, seconds: float) -> dict:
    context = mp.get_context("spawn")
    start = context.Barrier(workers + 1)
    results = context.Queue()
    processes = [context.Process(target=_worker, args=(env_cfg, i, seconds, start, results)) for i in range(workers)]
    for p in processes:
        p.start()
    start.wait(timeout=900)  # a worker that dies before the start breaks the barrier instead of hanging
    rates = [results.get(timeout=seconds + 600) for _ in processes]
    for p in processes:
        p.join()
    return {
        "suite": env_cfg["suite"],
        "task": env_cfg["task"],
        "workers": workers,
        "cores": os.cpu_count(),
        "steps_per_second": round(sum(rates), 1),
        "per_worker": round(sum(rates) / workers, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", required=True)
    parser.add_argument("--workers", default="1", help="comma-separated worker counts")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("overrides", nargs="*", help="key=value settings of the env config")
    args = parser.parse_args()
    from omegaconf import OmegaConf

    env_cfg = OmegaConf.load(CONFIGS / f"{args.suite}.yaml")
    env_cfg.merge_with_dotlist(args.overrides)
    env_cfg = OmegaConf.to_container(env_cfg, resolve=True)
    for workers in (int(w) for w in args.workers.split(",")):
        print(json.dumps(measure(env_cfg, workers, args.seconds)), flush=True)


if __name__ == "__main__":
    main()
