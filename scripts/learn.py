"""Runs a set of training runs (tasks x seeds) within a time budget, one or more at once; rerun to go on.

    python scripts/learn.py --dir runs/learn-dmc --preset dmc_proprio_paper --tasks walker_walk,cartpole_swingup \\
        --seeds 0,1,2 --frames 100000 [--parallel 1] [--seconds 540] [OVERRIDE ...]

Each run is `python -m dreamer.train +exp=PRESET env.task=TASK seed=SEED run.steps=STEPS` in its own folder,
`DIR/<task>-seed<seed>`, with the overrides given after the options. STEPS is `--steps` (agent steps), or
`--frames` over the action repeat of the run's composed config (frames as the reference's curves count
them: agent steps x repeat; an `env.repeat` among the overrides counts). `--variant NAME:OVERRIDES` (repeatable)
runs each task and seed once per variant, with the variant's overrides last, in `DIR/<task>-seed<seed>-<NAME>`
(its `variant` file names it, and the report and plots keep variants apart): an A/B on the same seeds.
Up to `--parallel` runs go at once (on one H200 a dmc_proprio run alone keeps the learner 0.99 busy: two side by
side made 122 updates/s together against 134 for one alone, as their CUDA contexts take turns; under CUDA's
multi-process service, which `reproduce.sh learn-dmc` starts, three made 215 and six 315, BENCHMARKS.md); runs
start in seed-major order, so that a partial set holds every task's first seed. At `--seconds` every run still
going gets SIGINT: it finishes its update, saves a checkpoint with its replay and exits. Rerunning the same command
resumes the unfinished runs from their checkpoints (the training command's own resume) and skips the finished ones,
so a set longer than one 10-minute GPU command is a chain of such commands. No run is started with less than
`--min-start` seconds left (its compile warm-up would be lost).

`--round-frames F` (with `--frames`): a resume starts every env's episode afresh, so a run whose command
stopped within the last F frames of its length (F: one round of episodes, e.g. 16 envs x 1,000 frames) would
end before its last episodes do, and its last training returns would come from a round or more earlier.
The driver reads each run's pace from its records in this command (two records after its warm-up), and
where the command would stop the run in that last round, it stops it early instead (SIGINT), a little more
than F frames before its end (a quarter of F more, planned again at every record), so that the next
command makes the whole last round.

Each start appends the code's commit (DREAMER_COMMIT if set, else git's HEAD) to the run folder's `commit`
(scripts/learning_report.py prints it) and its output to `DIR/logs/<task>-seed<seed>.log`. A line per run
says where it stands at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def frames_reached(folder: Path) -> tuple[int, bool]:
    """(env steps of the newest record or checkpoint, whether the run has finished: a final evaluation is
    recorded). A stopped run's checkpoint is newer than its last record (records come every run.log_every)."""
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return 0, False
    saved = [int(found.group(1)) for file in (folder / "checkpoints").glob("ckpt-*.pt")
             if (found := re.fullmatch(r"ckpt-(\d+)\.pt", file.name))]
    steps, done = max(saved, default=0), False
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            steps = max(steps, record.get("env_steps", 0))
            done = done or record.get("kind") == "final_eval"
    return steps, done


def newest_record(folder: Path) -> int:
    """Env steps of the run's newest record (0: none yet)."""
    path = folder / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return max((json.loads(line).get("env_steps", 0) for line in lines if line.strip()), default=0)


def agent_steps(args, task: str, overrides: list[str]) -> int:
    """`--steps`, or `--frames` over the action repeat of the run's composed config (rounded up)."""
    if args.steps:
        return args.steps
    sys.path.insert(0, str(ROOT))
    from dreamer.config import compose_config
    from dreamer.envs import frames_per_step

    cfg = compose_config([f"+exp={args.preset}", f"env.task={task}",
                          *[o for o in overrides if not o.startswith("hydra")]])
    return -(-args.frames // frames_per_step(cfg.env))


def early_stop(steps: int, total: int, round_steps: int, pace: float | None, seconds_left: float) -> float | None:
    """Seconds after which to stop a run now at `steps` of its `total` agent steps, so that its stop does
    not fall within its last round (`round_steps`; module docstring); None: no early stop. `pace`: its agent
    steps per second (None: not known yet); `seconds_left`: this command's. A stop within a margin (a
    quarter of a round) of the round's edges counts as within it: a run speeds up when its neighbours stop,
    and steps on while it saves (with an eighth, one run of six stopped 1,080 agent steps past its target,
    the margin being 1,000)."""
    if not round_steps or not pace or pace <= 0:
        return None
    margin = round_steps // 4
    reach = steps + pace * seconds_left
    target = total - round_steps - margin
    if reach >= total + margin or reach <= target or target <= steps:
        return None  # it finishes, stops before the last round, or already started within it
    return (target - steps) / pace


def commit() -> str:
    """The code's commit: DREAMER_COMMIT where the tree was copied without its git history, else git's HEAD."""
    if os.environ.get("DREAMER_COMMIT"):
        return os.environ["DREAMER_COMMIT"]
    found = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return found.stdout.strip() if found.returncode == 0 else "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="the set's folder (one folder per run in it)")
    parser.add_argument("--preset", required=True, help="+exp=PRESET of every run")
    parser.add_argument("--tasks", required=True, help="comma-separated env.task values")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    length = parser.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=int, help="run.steps (agent steps) of every run")
    length.add_argument("--frames", type=int, help="frames of every run: agent steps x the preset's action repeat")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once")
    parser.add_argument("--seconds", type=float, default=540, help="this command's budget; SIGINT to all at its end")
    parser.add_argument("--min-start", type=float, default=150, help="no run starts with less time than this left")
    parser.add_argument("--round-frames", type=int, default=0,
                        help="frames of one round of episodes (envs x an episode's frames): no command stops a run "
                             "within its last round (module docstring); 0: off")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:OVERRIDES",
                        help="a variant of every run: its name, a colon, then overrides separated by spaces "
                             "(repeat the option for more; each task x seed runs once per variant)")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("overrides", nargs="*", help="more overrides for every run (e.g. run.log_every=2000)")
    args = parser.parse_args()
    tasks = [t for t in args.tasks.split(",") if t]
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if not tasks or not seeds or args.parallel < 1 or (args.steps or args.frames or 0) < 1:
        parser.error("give at least one task and one seed, --parallel >= 1 and --steps or --frames >= 1")
    if args.round_frames and not args.frames:
        parser.error("--round-frames counts frames: give the runs' length with --frames")
    if args.round_frames < 0:
        parser.error(f"--round-frames must be 0 (off) or positive, got {args.round_frames}")
    variants: list[tuple[str, tuple[str, ...]]] = []
    for given in args.variant:
        name, _, overrides = given.partition(":")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or not overrides.strip():
            parser.error(f"--variant must be NAME:OVERRIDES with a name of letters, digits and _.- and at least "
                         f"one override, got {given!r}")
        variants.append((name, tuple(shlex.split(overrides))))
    if len({name for name, _ in variants}) < len(variants):
        parser.error("two --variant options have the same name")
    deadline = time.monotonic() + args.seconds
    logs = args.dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    jobs = [(task, seed, variant) for seed in seeds for task in tasks for variant in (variants or [None])]

    def folder_of(job) -> Path:
        task, seed, variant = job
        return args.dir / (f"{task}-seed{seed}" + (f"-{variant[0]}" if variant else ""))

    def label(job) -> str:
        task, seed, variant = job
        return f"{task} seed {seed}" + (f" [{variant[0]}]" if variant else "")

    def overrides_of(job) -> list[str]:
        return [*args.overrides, *(job[2][1] if job[2] else [])]

    try:  # every run's length first: a bad preset or override stops the set before any run starts
        run_steps = {job: agent_steps(args, job[0], overrides_of(job)) for job in jobs}
    except Exception as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        parser.error(f"the runs' config does not compose ({lines[0] if lines else type(error).__name__}); "
                     f"check --preset, the tasks and the overrides")
    waiting = [job for job in jobs if not frames_reached(folder_of(job))[1]]
    print(f"[learn] {len(jobs) - len(waiting)} of {len(jobs)} runs finished; {len(waiting)} to go, "
          f"{args.parallel} at a time, {args.seconds:.0f} s", flush=True)
    running: dict[tuple, subprocess.Popen] = {}
    seen: dict[tuple, list[tuple[float, int]]] = {}  # (clock, steps) of the records each run wrote in this command
    early: dict[tuple, float] = {}  # the clock at which a run stops early (--round-frames); inf once signalled
    head = commit()
    stopping = False
    while waiting or running:
        now = time.monotonic()
        while waiting and len(running) < args.parallel and deadline - now > args.min_start and not stopping:
            job = waiting.pop(0)
            task, seed, variant = job
            folder = folder_of(job)
            folder.mkdir(parents=True, exist_ok=True)
            with (folder / "commit").open("a") as handle:
                handle.write(head + "\n")
            if variant:  # the report and plots group runs by it (scripts/plot.py's load_run)
                (folder / "variant").write_text(variant[0] + "\n")
            steps, _ = frames_reached(folder)
            command = [args.python, "-m", "dreamer.train", f"+exp={args.preset}", f"env.task={task}", f"seed={seed}",
                       f"run.steps={run_steps[job]}", f"hydra.run.dir={folder.resolve()}", *overrides_of(job)]
            print(f"[learn] {label(job)}: {'resumes at ' + format(steps, ',') if steps else 'starts'} "
                  f"(run.steps={run_steps[job]:,} agent steps)", flush=True)
            seen[job] = [(time.monotonic(), newest_record(folder))]  # its records from before this command
            log = (logs / f"{folder.name}.log").open("a")
            running[job] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
            log.close()
        if not running:
            break  # too little time left to start another
        if time.monotonic() >= deadline and not stopping:
            stopping = True
            for job, process in running.items():
                if early.get(job) != math.inf:  # a second SIGINT would stop it at once, mid-save
                    process.send_signal(signal.SIGINT)  # it saves a checkpoint and exits
            stopped_at = time.monotonic()
        for job in running if args.round_frames and not stopping else ():
            steps, records = newest_record(folder_of(job)), seen[job]
            if steps <= records[-1][1]:
                continue
            records.append((time.monotonic(), steps))
            if len(records) < 3 or early.get(job) == math.inf:  # the first new record's interval holds the warm-up
                continue
            # Planned again at every record until signalled, at the faster of the command's mean pace and the
            # latest interval's (a run speeds up when its neighbours stop); a plan only ever moves earlier, and
            # once made it stands (a run already past its planned stop is stopped at once).
            (first_at, first), (before_at, before), (last_at, last) = records[1], records[-2], records[-1]
            pace = max((last - first) / (last_at - first_at), (last - before) / (last_at - before_at))
            round_steps = -(-args.round_frames * run_steps[job] // args.frames)
            after = early_stop(last, run_steps[job], round_steps, pace, deadline - last_at)
            if after is not None:
                if job not in early:
                    print(f"[learn] {label(job)}: stops in about {last_at + after - time.monotonic():.0f} s, at "
                          f"about {last + after * pace:,.0f} agent steps, before its last round of "
                          f"{round_steps:,} (its next command makes that round whole)", flush=True)
                early[job] = min(early.get(job, math.inf), last_at + after)
        for job, at in list(early.items()):
            if job in running and time.monotonic() >= at and not stopping:
                running[job].send_signal(signal.SIGINT)  # before its last round; the deadline's kill covers it
                early[job] = math.inf  # signalled: never again (a second SIGINT stops a run at once)
        if stopping and time.monotonic() - stopped_at > 120:
            for process in running.values():
                process.kill()
        for job, process in list(running.items()):
            if process.poll() is not None:
                del running[job]
                early.pop(job, None)
                steps, done = frames_reached(folder_of(job))
                state = "finished" if done else ("stopped to resume" if process.returncode == 0 else
                                                 f"exited with code {process.returncode} (see its log)")
                print(f"[learn] {label(job)}: {state} at {steps:,} env steps", flush=True)
        soonest = min(early.values(), default=math.inf) - time.monotonic()
        time.sleep(min(1.0, max(0.02, soonest)))  # an early stop on time, not up to a second late
    finished = sum(frames_reached(folder_of(job))[1] for job in jobs)
    print(f"[learn] {finished} of {len(jobs)} runs finished"
          + ("" if finished == len(jobs) else "; run the same command again to go on"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
