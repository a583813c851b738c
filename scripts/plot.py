"""Learning curves of runs or sweeps, over the reference's mean and min-max band at equal frames, as PNG.

    python scripts/plot.py RUN_DIR [RUN_DIR ...] [--out curves.png] [--metric episode/return]
    python scripts/plot.py runs/sweeps/<time>        # a sweep folder: each of its run folders
    python scripts/plot.py RUN_DIR ... --compare OTHER_LOGDIR   # beside a run of the reference's own code

Runs are grouped by environment (suite, task and observations, from each run's config.yaml). Each run is
drawn at its own records (markers), against frames (env steps x action repeat, as the reference counts);
where a group has several seeds, their median and inter-quartile range are drawn too, over the frames
all of them reached. The reference's curve for the task (`dreamer/reference`: training-episode returns,
mean and min-max over its seeds) is drawn under them where it exists. The default metric is the
training-episode return, the reference's own measure; `--metric eval/return_mean` plots evaluations.

`--compare` draws, on a figure of one task, the training returns of a run of the reference's own code: its
logdir's `scores.jsonl` (one record per episode, `step` in frames, `episode/score`), averaged per round of
episodes that end together (DeepMind Control's envs step in lock-step through fixed-length episodes).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dreamer.reference import curve  # noqa: E402


def is_run(folder: Path) -> bool:
    return (folder / "metrics.jsonl").is_file() and (folder / "config.yaml").is_file()


def run_folders(paths: list[Path]) -> list[Path]:
    """The run folders among `paths`: a run folder itself, or the run folders inside a sweep folder.
    Other files (a sweep's multirun.yaml) are skipped; a folder with no run in it is an error."""
    runs = []
    for path in paths:
        if path.is_file():
            continue  # e.g. multirun.yaml beside a sweep's job folders (runs/sweeps/<time>/*)
        if is_run(path):
            runs.append(path)
            continue
        inside = sorted(child for child in path.iterdir() if child.is_dir() and is_run(child)) if path.is_dir() else []
        if not inside:
            raise ValueError(f"{path} is not a run folder (no metrics.jsonl and config.yaml) and holds none")
        runs += inside
    if not runs:
        raise ValueError("no run folder among the paths given")
    return runs


def run_variant(run: Path) -> str:
    """The run's `scripts/learn.py --variant` name (its `variant` file), "" for its set's own recipe."""
    path = run / "variant"
    return path.read_text().strip() if path.is_file() else ""


def load_run(run: Path, metric: str) -> tuple[tuple, dict, np.ndarray, np.ndarray]:
    """(group key, env config, frames, values) of one run's `metric` records."""
    import yaml

    config = yaml.safe_load((run / "config.yaml").read_text())
    env = config["env"]
    repeat = int(env.get("repeat", 1)) if env["suite"] in ("dmc", "atari") else 1
    key = (env["suite"], env["task"], env.get("obs") if env["suite"] == "dmc" else None)
    if variant := run_variant(run):  # scripts/learn.py --variant: runs of a variant are a group of their own
        key = (*key, variant)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # Records written before frames were recorded: env steps x the run's action repeat.
    points = {r.get("frames", r["env_steps"] * repeat): r[metric] for r in records if metric in r}
    if not points:
        raise ValueError(f"{run}/metrics.jsonl has no '{metric}' records")
    frames, values = zip(*sorted(points.items()))
    return key, env, np.array(frames, dtype=float), np.array(values, dtype=float)


def load_scores(logdir: Path, gap: float = 2000) -> tuple[np.ndarray, np.ndarray]:
    """(frames, mean score) per round of a run of the reference's own code: its `scores.jsonl` episodes,
    a new round wherever `gap` frames or more pass without an episode ending."""
    path = logdir / "scores.jsonl"
    if not path.is_file():
        raise ValueError(f"{logdir} has no scores.jsonl (--compare takes a logdir of the reference's own code)")
    episodes = sorted((r["step"], r["episode/score"]) for r in map(json.loads, path.read_text().splitlines())
                      if "episode/score" in r and "step" in r)
    if not episodes:
        raise ValueError(f"{path} has no 'episode/score' records")
    rounds: list[list[tuple[float, float]]] = []
    for step, score in episodes:
        if rounds and step - rounds[-1][-1][0] < gap:
            rounds[-1].append((step, score))
        else:
            rounds.append([(step, score)])
    return (np.array([np.mean([s for s, _ in r]) for r in rounds]),
            np.array([np.mean([v for _, v in r]) for r in rounds]))


def draw(axis, title: str, curves: list[tuple[dict, np.ndarray, np.ndarray]], metric: str,
         compare: list[tuple[str, np.ndarray, np.ndarray]] = ()):
    """One environment's runs [(env config, frames, values)] on `axis`, over the reference's band where it
    has one, and runs of the reference's own code [(label, frames, values)]; returns the reference curve
    (or None)."""
    reference = curve(curves[0][0])
    end = max(f[-1] for _, f, _ in [*curves, *compare])
    if reference is not None:
        shown = reference.frames <= end * 1.05
        axis.fill_between(reference.frames[shown], reference.low[shown], reference.high[shown], color="0.85",
                          label=f"reference min-max ({reference.seeds} seeds)")
        axis.plot(reference.frames[shown], reference.mean[shown], "k--", linewidth=1, label="reference mean")
    for index, (_, frames, values) in enumerate(curves):
        axis.plot(frames, values, "o-", markersize=3, linewidth=0.8, alpha=0.6 if len(curves) > 1 else 1.0,
                  label="dreamer" if len(curves) == 1 else ("dreamer, each seed" if index == 0 else None),
                  color="C0")
    if len(curves) > 1:  # over the frames every seed reached: no point is invented beyond a run's records
        start, stop = max(f[0] for _, f, _ in curves), min(f[-1] for _, f, _ in curves)
        if stop > start:
            grid = np.linspace(start, stop, 50)
            stacked = np.stack([np.interp(grid, f, v) for _, f, v in curves])
            low, median, high = np.percentile(stacked, [25, 50, 75], axis=0)
            axis.plot(grid, median, color="C1", label=f"dreamer median ({len(curves)} seeds)")
            axis.fill_between(grid, low, high, color="C1", alpha=0.25)
    for index, (label, frames, values) in enumerate(compare):
        axis.plot(frames, values, "s-", markersize=4, linewidth=1.2, color=f"C{2 + index}", label=label)
    axis.set_title(title)
    axis.set_xlabel("frames (env steps x action repeat)")
    axis.set_ylabel(metric)
    axis.legend(loc="best", fontsize=7)
    return reference


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders or sweep folders")
    parser.add_argument("--out", type=Path, default=Path("curves.png"))
    parser.add_argument("--metric", default="episode/return",
                        help="a metrics.jsonl key (default: the training-episode return, as the reference's)")
    parser.add_argument("--compare", type=Path, action="append", default=[], metavar="LOGDIR",
                        help="a logdir of the reference's own code (its scores.jsonl), drawn on a one-task figure")
    args = parser.parse_args()
    try:
        runs = run_folders(args.runs)
        loaded = [load_run(run, args.metric) for run in runs]
        compare = [(f"reference's code run here, {logdir.name}", *load_scores(logdir)) for logdir in args.compare]
        if compare and len({key for key, *_ in loaded}) > 1:
            raise ValueError("--compare draws on a figure of one task; pass the runs of that task only")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = defaultdict(list)
    for key, env, frames, values in loaded:
        groups[key].append((env, frames, values))
    figure, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.6), squeeze=False)
    for axis, (key, curves) in zip(axes[0], sorted(groups.items(), key=lambda item: str(item[0]))):
        reference = draw(axis, " ".join(str(k) for k in key if k), curves, args.metric, compare)
        print(f"{' '.join(str(k) for k in key if k)}: {len(curves)} run(s), reference "
              f"{reference.source if reference else 'none published'}")
    figure.tight_layout()
    figure.savefig(args.out, dpi=100)
    print(f"{len(runs)} runs in {len(groups)} group(s)"
          f"{f', beside {len(compare)} of the reference code' if compare else ''} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
