"""One table row per job of a sweep: its overrides, final evaluation return and env steps/s.

    python scripts/summarize.py SWEEP_DIR

A job is any folder under SWEEP_DIR that holds a metrics.jsonl (Hydra's multirun writes one folder per job;
the run writes the job's overrides to overrides.yaml in it, older runs have them in .hydra/overrides.yaml).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def job_row(folder: Path) -> dict:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in records if r["kind"] in ("eval", "final_eval")]
    train = [r for r in records if r["kind"] == "train" and r.get("env_steps_per_s")]
    overrides_file = folder / "overrides.yaml"
    if not overrides_file.is_file():
        overrides_file = folder / ".hydra" / "overrides.yaml"
    overrides = []
    if overrides_file.is_file():
        overrides = [line[2:].strip() for line in overrides_file.read_text().splitlines() if line.startswith("- ")]
    return {
        "job": str(folder),
        "overrides": " ".join(overrides) or "-",
        "env_steps": max((r["env_steps"] for r in records), default=0),
        "final_return": evals[-1]["eval/return_mean"] if evals else None,
        "env_steps_per_s": sum(r["env_steps_per_s"] for r in train) / len(train) if train else None,
    }


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python scripts/summarize.py SWEEP_DIR", file=sys.stderr)
        return 2
    root = Path(sys.argv[1])
    folders = sorted({p.parent for p in root.rglob("metrics.jsonl")})
    if not folders:
        print(f"error: no job folder with a metrics.jsonl under {root}", file=sys.stderr)
        return 2
    rows = [job_row(folder) for folder in folders]
    header = ("job", "overrides", "env steps", "final eval return", "env steps/s")
    table = [header] + [
        (str(Path(r["job"]).relative_to(root)) if Path(r["job"]) != root else ".", r["overrides"], f"{r['env_steps']:,}",
         "-" if r["final_return"] is None else f"{r['final_return']:.2f}",
         "-" if r["env_steps_per_s"] is None else f"{r['env_steps_per_s']:.1f}")
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for index, row in enumerate(table):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        if index == 0:
            print("  ".join("-" * width for width in widths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
