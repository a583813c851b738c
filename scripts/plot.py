"""Learning curves: median and inter-quartile range over seeds, against the reference scores, as PNG.

    python scripts/plot.py RUN_DIR [RUN_DIR ...] [--out curves.png] [--metric eval/return_mean]

Runs are grouped by environment (suite and task from each run's config.yaml); the seeds of a group are
interpolated onto common env-step points. Where REFERENCE_SCORES knows the task, its points are drawn too.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

# Mean training-episode returns of the reference runs (env steps -> return).
REFERENCE_SCORES = {
    ("dmc", "cartpole_balance", "proprio"): {20e3: 227, 50e3: 490, 100e3: 840, 200e3: 941, 500e3: 991},
    ("dmc", "cartpole_swingup", "proprio"): {20e3: 189, 50e3: 322, 100e3: 528, 200e3: 788, 500e3: 856},
    ("dmc", "walker_walk", "proprio"): {20e3: 89, 50e3: 289, 100e3: 475, 200e3: 799, 500e3: 881},
    ("dmc", "reacher_easy", "proprio"): {20e3: 36, 50e3: 631, 100e3: 693, 200e3: 956, 500e3: 962},
    ("dmc", "cartpole_balance", "pixels"): {20e3: 227, 50e3: 591, 100e3: 945, 200e3: 984, 500e3: 994},
    ("dmc", "walker_walk", "pixels"): {20e3: 150, 50e3: 390, 100e3: 601, 200e3: 892, 500e3: 940},
}


def load_run(run: Path, metric: str) -> tuple[tuple, np.ndarray, np.ndarray]:
    import yaml

    config = yaml.safe_load((run / "config.yaml").read_text())
    env = config["env"]
    key = (env["suite"], env["task"], env.get("obs", "proprio") if env["suite"] == "dmc" else None)
    points = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    points = [(p["env_steps"], p[metric]) for p in points if metric in p]
    if not points:
        raise ValueError(f"{run}/metrics.jsonl has no '{metric}' records")
    steps, values = zip(*sorted(points))
    return key, np.array(steps, dtype=float), np.array(values, dtype=float)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("curves.png"))
    parser.add_argument("--metric", default="eval/return_mean")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = defaultdict(list)
    for run in args.runs:
        if not (run / "metrics.jsonl").is_file() or not (run / "config.yaml").is_file():
            print(f"error: {run} is not a run folder (needs metrics.jsonl and config.yaml)", file=sys.stderr)
            return 2
        try:
            key, steps, values = load_run(run, args.metric)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        groups[key].append((steps, values))
    figure, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.6), squeeze=False)
    for axis, (key, curves) in zip(axes[0], sorted(groups.items(), key=lambda item: str(item[0]))):
        grid = np.linspace(0, min(s[-1] for s, _ in curves), 50)
        stacked = np.stack([np.interp(grid, s, v) for s, v in curves])
        low, median, high = np.percentile(stacked, [25, 50, 75], axis=0)
        axis.plot(grid, median, label=f"dreamer ({len(curves)} seed{'s' * (len(curves) > 1)})")
        axis.fill_between(grid, low, high, alpha=0.3)
        if key in REFERENCE_SCORES:
            ref = REFERENCE_SCORES[key]
            axis.plot(list(ref), list(ref.values()), "k--o", markersize=3, label="reference")
        axis.set_title(" ".join(str(k) for k in key if k))
        axis.set_xlabel("env steps")
        axis.set_ylabel(args.metric)
        axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(args.out, dpi=100)
    print(f"{len(args.runs)} runs in {len(groups)} group(s) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
