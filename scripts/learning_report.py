"""The learning report: each run's returns at given frames beside the reference's, as Markdown and PNGs.

    python scripts/learning_report.py RUNS_DIR [--out LEARNING.md] [--frames 50000,100000]

RUNS_DIR holds run folders (`scripts/reproduce.sh learn-dmc` makes one per task and seed). For each run: the
training-episode return (`episode/return`, the reference's own measure) and the evaluation return
(`eval/return_mean`, where the run evaluated) at each point of `--frames`, interpolated linearly between the
run's records (past the last training return: its value, as long as the point lies no further past it than
the run's returns ever lay apart, from its start on; past the last evaluation: none)
and left out ("-") where the run has not reached the point or has no value of that kind at or before it (the first
evaluation comes at `run.eval_every`; a resumed command starts its envs' episodes afresh, and one shorter than a
round of episodes records none); the wall-clock to the last point (the summed `time` of the run's commands: each
resumed command counts from its own start, so a command's start-up is counted and the work lost after its last
checkpoint is not); the median updates/s; and the commits it ran (each run folder's `commit` file, written by
reproduce.sh at each command).

Per task: the mean over seeds of the training return at each point beside the reference's mean and
min-max over its seeds (`dreamer/reference`), and whether it meets the bar: within the reference's
min-max and at least 0.8 x its mean. A plot per task (all seeds over the reference band, as
scripts/plot.py draws them) is written beside the report, in `<out stem>/`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plot import draw, load_run, run_folders, run_variant  # noqa: E402

from dreamer.metrics import elapsed  # noqa: E402
from dreamer.reference import curve  # noqa: E402

TRAIN, EVAL = "episode/return", "eval/return_mean"
BAR = 0.8  # the mean over seeds must reach this fraction of the reference's mean (and lie in its range)
REACHED = 0.98  # a run has reached a point once its last record is this close to it


@dataclass
class Run:
    folder: Path
    key: tuple
    env: dict
    seed: int
    frames: np.ndarray  # of the training-return records
    returns: np.ndarray
    evals: tuple[np.ndarray, np.ndarray] | None
    wall: list[tuple[float, float]]  # (frames, cumulative seconds) of every record
    reached: float  # the frames of the run's newest record
    updates_per_s: float | None
    commits: list[str] = field(default_factory=list)

    @property
    def variant(self) -> str:
        """The run's `scripts/learn.py --variant` name, "" for the set's own recipe."""
        return run_variant(self.folder)

    @property
    def task(self) -> str:
        return " ".join(str(part) for part in self.key if part)

    def at(self, point: float, evaluation: bool = False) -> float | None:
        if evaluation and self.evals is None:  # the run has not evaluated (yet)
            return None
        frames, values = self.evals if evaluation else (self.frames, self.returns)
        if not len(frames) or self.reached < REACHED * point or point < REACHED * frames[0]:
            return None  # not reached yet, or before the run's first value of this kind (nothing to interpolate)
        if evaluation and point - frames[-1] > (1 - REACHED) * point:
            return None  # an evaluation measures its own point: none is carried past the last one
        gaps = np.diff(frames, prepend=0)  # from the run's start: the first value came one episode in
        if point - frames[-1] > gaps.max() + (1 - REACHED) * point:
            return None  # its values stopped further before the point than they ever lay apart: none there
        return float(np.interp(point, frames, values))  # past the last record, within that gap: its value

    def seconds_to(self, point: float) -> float | None:
        return next((seconds for frames, seconds in self.wall if frames >= REACHED * point), None)


def load(folder: Path) -> Run:
    import yaml

    key, env, frames, returns = load_run(folder, TRAIN)
    config = yaml.safe_load((folder / "config.yaml").read_text())
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = None
    try:
        evals = load_run(folder, EVAL)[2:]
    except ValueError:  # the run did not evaluate
        pass
    wall = [(record.get("frames", record["env_steps"]), seconds) for record, seconds in zip(records, elapsed(records))]
    rates = [r["updates_per_s"] for r in records if r["kind"] == "train" and r.get("updates_per_s")]
    commit_file = folder / "commit"
    commits = list(dict.fromkeys(commit_file.read_text().split())) if commit_file.is_file() else []
    return Run(folder, key, env, int(config.get("seed", 0)), frames, returns, evals, wall,
               max(frames for frames, _ in wall), statistics.median(rates) if rates else None, commits)


def _number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f} min"


def _frames(point: float) -> str:
    return f"{point / 1000:g}K"


def task_rows(runs: list[Run], points: list[float]) -> tuple[list[str], dict[float, bool | None]]:
    """The Markdown rows of one task (a row per seed, then the mean and the reference), and per point
    whether the mean meets the bar (None: not every seed reached the point, or no reference)."""
    reference = curve(runs[0].env)
    rows, met = [], {}
    for run in sorted(runs, key=lambda r: r.seed):
        cells = [run.task, str(run.seed), *(_number(run.at(p)) for p in points),
                 *(_number(run.at(p, evaluation=True)) for p in points), _minutes(run.seconds_to(points[-1])),
                 _number(run.updates_per_s, 1), ", ".join(c[:7] for c in run.commits) or "-"]
        rows.append("| " + " | ".join(cells) + " |")
    means = []
    for point in points:
        values = [run.at(point) for run in runs]
        mean = statistics.mean(values) if values and None not in values else None
        means.append(mean)
        if mean is None or reference is None:
            met[point] = None
        else:
            ref_mean, low, high = reference.at(point)
            met[point] = low <= mean <= high and mean >= BAR * ref_mean
    blank = [""] * (len(points) + 3)
    rows.append("| " + " | ".join([f"**{runs[0].task}**", f"mean of {len(runs)}",
                                   *(f"**{_number(m)}**" for m in means), *blank]) + " |")
    if reference is not None:
        cells = []
        for point in points:
            ref_mean, low, high = reference.at(point)
            verdict = {None: "", True: " met", False: " **missed**"}[met[point]]
            if met[point] is False and means[points.index(point)] > high:
                verdict = " **missed** (above its range)"
            cells.append(f"{ref_mean:.0f} ({low:.0f}-{high:.0f}){verdict}")
        rows.append("| " + " | ".join(["", f"reference ({reference.seeds} seeds)", *cells, *blank]) + " |")
    else:
        rows.append("| " + " | ".join(["", "reference", *(["none published"] * len(points)), *blank]) + " |")
    return rows, met


def report(runs: list[Run], points: list[float], plots: Path, title_link: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_task: dict[tuple, list[Run]] = defaultdict(list)
    for run in runs:
        by_task[run.key].append(run)
    plots.mkdir(parents=True, exist_ok=True)
    head = ["task", "seed", *(f"train return {_frames(p)}" for p in points),
            *(f"eval return {_frames(p)}" for p in points), f"wall-clock to {_frames(points[-1])}", "updates/s",
            "commit"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    verdicts: dict[tuple[str, float], list[bool | None]] = defaultdict(list)  # by (variant, point)
    images = []
    for key, group in sorted(by_task.items(), key=lambda item: str(item[0])):
        rows, met = task_rows(group, points)
        lines += rows
        for point, verdict in met.items():
            verdicts[group[0].variant, point].append(verdict)
        figure, axis = plt.subplots(figsize=(5, 3.6))
        draw(axis, group[0].task, [(r.env, r.frames, r.returns) for r in group], TRAIN)
        figure.tight_layout()
        image = plots / f"{'-'.join(str(k) for k in key if k)}.png"
        figure.savefig(image, dpi=100)
        plt.close(figure)
        images.append(image)
    summary = []  # the set's own recipe first, then each variant's tasks apart (an A/B is not the recipe)
    for variant, point in sorted(verdicts, key=lambda vp: (vp[0], points.index(vp[1]))):
        given, judged = verdicts[variant, point], [v for v in verdicts[variant, point] if v is not None]
        summary.append(f"- {f'variant {variant}, ' if variant else ''}at {_frames(point)} frames: "
                       f"**{sum(judged)} of {len(judged)}** tasks meet the bar"
                       + (f" ({len(given) - len(judged)} not judged: a seed short of the point or without "
                          f"a value at it yet, or no reference)" if len(judged) < len(given) else ""))
    body = [*summary, "", *lines, ""]
    body += [f"![{image.stem}]({title_link}/{image.name})" for image in images]
    return "\n".join(body) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="run folders, or folders of them")
    parser.add_argument("--out", type=Path, default=Path("LEARNING.md"))
    parser.add_argument("--frames", default="50000,100000", help="the points of the table, in frames")
    parser.add_argument("--title", default="Learning report", help="the report's heading")
    parser.add_argument("--preamble", default="", help="Markdown put between the heading and the results")
    args = parser.parse_args()
    try:
        points = sorted(float(p) for p in args.frames.split(","))
        if not points or points[0] <= 0:
            raise ValueError(f"--frames must list positive frame counts, got {args.frames!r}")
        runs = [load(folder) for folder in run_folders(args.runs)]
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    plots = args.out.parent / args.out.stem.lower()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent)
    made = f"Made by `python scripts/learning_report.py {' '.join(str(r) for r in args.runs)}`" + (
        f" at commit {head.stdout.strip()}" if head.returncode == 0 else "") + "."
    text = (f"# {args.title}\n\n{args.preamble + chr(10) * 2 if args.preamble else ''}{made} The bar: the mean "
            f"training return over seeds within the reference's min-max and at least {BAR} x its mean.\n\n"
            + report(runs, points, plots, plots.name))
    args.out.write_text(text)
    print(text.split("\n\n| task")[0].split("\n\n", 2)[-1])
    print(f"{len(runs)} runs -> {args.out} and {plots}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
