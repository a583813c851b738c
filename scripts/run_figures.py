"""The throughput figures of one training run, from its metrics.jsonl: collecting alone against training.

    python scripts/run_figures.py RUN_DIR [--out FILE] [--collecting]

Collecting alone: the train records written before the first update (the first record left out: it
holds the start of the workers). Training: the records whose whole span had updates (the record before
them had some already). Medians over each set of records: env steps/s, updates/s, the learner device's
busy fraction, the inference server's p50 / p99 pass time, queue wait and busy fraction, and where a
collector's step went (policy round trip, env, own work). One JSON line, with the ratio training /
collecting of env steps/s. `--collecting`: the collecting figures alone, for a run that never trained
(`run.train_start` past its end, as `scripts/reproduce.sh server-threads` runs it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

FIGURES = ("env_steps_per_s", "updates_per_s", "learner/busy", "inference/busy", "inference/p50_ms",
           "inference/p99_ms", "inference/queue_ms", "inference/batch", "collect/policy_ms", "collect/served_ms",
           "collect/wake_ms", "collect/env_ms", "collect/own_ms", "collect/pump_busy")


def _medians(records: list[dict]) -> dict:
    return {key: round(statistics.median(r[key] for r in records), 4)
            for key in FIGURES if records and all(key in r for r in records)}


def figures(run_dir: Path, collecting_only: bool = False) -> dict:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        sys.exit(f"error: {path} not found: pass the folder of a run (it holds metrics.jsonl)")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("kind") == "train" and "env_steps_per_s" in r]
    collecting = [r for r in train[1:] if r["updates"] == 0]
    training = [r for before, r in zip(train, train[1:]) if before["updates"] > 0]
    if collecting_only:
        if not collecting:
            sys.exit(f"error: {path} has no train record after the first one without updates: run longer or "
                     f"log more often (run.log_every)")
        return {"run": str(run_dir), "records": {"collecting": len(collecting)}, "collecting": _medians(collecting),
                "collecting_env_steps_per_s_mean": round(statistics.mean(r["env_steps_per_s"] for r in collecting), 1)}
    if not collecting or not training:
        sys.exit(f"error: {path} needs train records before and after training started "
                 f"({len(collecting)} collecting, {len(training)} training): run longer or log more often "
                 f"(run.log_every; --collecting for a run that only collects)")
    alone, trained = _medians(collecting), _medians(training)
    return {"run": str(run_dir), "records": {"collecting": len(collecting), "training": len(training)},
            "collecting": alone, "training": trained,
            "training_over_collecting": round(trained["env_steps_per_s"] / alone["env_steps_per_s"], 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", help="also append the JSON line to this file")
    parser.add_argument("--collecting", action="store_true", help="collecting figures alone (a run that never trained)")
    args = parser.parse_args()
    line = json.dumps(figures(args.run_dir, args.collecting))
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
