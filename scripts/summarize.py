"""One table row per run folder under the paths given: overrides, progress, wall-clock, rates, final return.

    python scripts/summarize.py runs/sweeps/<time>      # a sweep: one row per job
    python scripts/summarize.py runs                    # every run folder under runs/

A run folder is any folder that holds a metrics.jsonl (Hydra's multirun writes one folder per job; the
run writes its overrides to overrides.yaml, older runs have them in .hydra/overrides.yaml). The rates
are those of the training phase (from the first record with updates to the last, wall-clock summed over
resumed commands; the replay's prefill apart). The return is the final evaluation's, or the last
evaluation's with the env steps it was made at ("@"), or "-" (none recorded, or interrupted before an
episode ended).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dreamer.metrics import duration, elapsed, read_records, training_rates  # noqa: E402


def job_row(folder: Path) -> dict:
    records = [r for r in read_records(folder) if "kind" in r and "env_steps" in r]
    evals = [r for r in records if r["kind"] in ("eval", "final_eval") and "eval/return_mean" in r]
    overrides_file = folder / "overrides.yaml"
    if not overrides_file.is_file():
        overrides_file = folder / ".hydra" / "overrides.yaml"
    overrides = []
    if overrides_file.is_file():
        overrides = [line[2:].strip() for line in overrides_file.read_text().splitlines() if line.startswith("- ")]
    rates = training_rates(records)
    final = evals[-1] if evals else None
    return {
        "job": str(folder),
        "overrides": " ".join(overrides) or "-",
        "env_steps": max((r["env_steps"] for r in records), default=0),
        "updates": max((r.get("updates", 0) for r in records), default=0),
        "seconds": elapsed(records)[-1] if records else 0.0,
        "return": None if final is None else final["eval/return_mean"],
        "return_at": None if final is None or final["kind"] == "final_eval" else final["env_steps"],
        "env_steps_per_s": rates[0] if rates else None,
        "updates_per_s": rates[1] if rates else None,
    }


def main() -> int:
    if len(sys.argv) < 2 or any(arg.startswith("-") for arg in sys.argv[1:]):
        print("usage: python scripts/summarize.py RUN_OR_SWEEP_DIR [...]", file=sys.stderr)
        return 2
    rows = []
    for root in map(Path, sys.argv[1:]):
        if not root.is_dir():
            print(f"error: {root} is not a folder", file=sys.stderr)
            return 2
        folders = sorted({p.parent for p in root.rglob("metrics.jsonl")})
        if not folders:
            print(f"error: no run folder (one with a metrics.jsonl) under {root}", file=sys.stderr)
            return 2
        rows += [(root, job_row(folder)) for folder in folders]
    header = ("run", "overrides", "env steps", "updates", "wall-clock", "train env steps/s", "updates/s",
              "eval return")
    table = [header] + [
        (str(Path(r["job"]).relative_to(root)) if Path(r["job"]) != root else root.name, r["overrides"],
         f"{r['env_steps']:,}", f"{r['updates']:,}", duration(r["seconds"]),
         "-" if r["env_steps_per_s"] is None else f"{r['env_steps_per_s']:.1f}",
         "-" if r["updates_per_s"] is None else f"{r['updates_per_s']:.2f}",
         "-" if r["return"] is None else f"{r['return']:.2f}" + (f" @{r['return_at']:,}" if r["return_at"] else ""))
        for root, r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for index, row in enumerate(table):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        if index == 0:
            print("  ".join("-" * width for width in widths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
