"""What a run reports: a live console line, metrics.jsonl in the run folder (always), and wandb on request.

The console line (rich) shows env steps, env steps/s, updates/s, the last episode return and the ETA.
When stdout is not a terminal (CI, a log file) the same fields are printed as one plain line per record.

The line's rates are those of the last `window` seconds, refreshed at every pass of the loop; the ETA
divides the steps left by the rate since training began (the replay's prefill, much faster, apart), and
reads --:-- until then. A record's rates are those of its own span (since the previous record).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


def duration(seconds: float) -> str:
    """H:MM:SS or MM:SS; --:-- for a time not known (inf)."""
    if not math.isfinite(seconds):
        return "--:--"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60:02d}:{rest % 60:02d}"


def summarize_episodes(episodes: list) -> dict[str, float]:
    """Means over the episodes of a log period: return, length, and each logged flag as a success rate.

    When the env logs achievements (Crafter), also the Crafter score: the geometric mean of the success
    rates in percent, exp(mean(ln(1 + s))) - 1.
    """
    if not episodes:
        return {}
    count = len(episodes)
    record = {
        "episode/return": sum(e.score for e in episodes) / count,
        "episode/length": sum(e.length for e in episodes) / count,
        "episode/count": count,
        "episode/fault_truncated": sum(e.truncated_by_fault for e in episodes),
    }
    names = sorted({name for e in episodes for name in e.stats})
    for name in names:
        record[f"episode/{name}"] = sum(e.stats.get(name, 0.0) for e in episodes) / count
    achievements = [record[f"episode/{n}"] for n in names if n.startswith("achievement_")]
    if achievements:
        record["episode/crafter_score"] = math.exp(
            sum(math.log(1 + 100 * rate) for rate in achievements) / len(achievements)) - 1
    return record


class Rates:
    """env steps/s and updates/s over the span since the previous call."""

    def __init__(self, env_steps: int, updates: int, now: float | None = None):
        self._last = (time.perf_counter() if now is None else now, env_steps, updates)

    def __call__(self, env_steps: int, updates: int, now: float | None = None) -> tuple[float, float]:
        """`now`: the perf_counter time at which the counters were read (default: this call's)."""
        now = time.perf_counter() if now is None else now
        then, steps0, updates0 = self._last
        span = max(now - then, 1e-9)
        self._last = (now, env_steps, updates)
        return (env_steps - steps0) / span, (updates - updates0) / span


class WandbSink:
    """wandb, configured from `logger` settings. Offline when no API key is configured; never holds up
    training: an online start that fails (no answer within `logger.init_timeout` seconds, a bad key)
    falls back to an offline run with the same id, then to nothing, with one warning line."""

    def __init__(self, settings: dict, run_dir: Path, name: str, config: dict):
        import wandb

        mode = settings.get("mode", "auto")
        if mode == "auto":
            mode = "online" if self._has_key() else "offline"
        id_file = run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        id_file.write_text(run_id)
        # init_timeout: how long an online start may take before the offline fallback (logger/wandb.yaml);
        # run folders from before the setting existed get wandb's default.
        timeout = settings.get("init_timeout")
        kwargs = dict(
            project=settings.get("project"),
            entity=settings.get("entity"),
            group=settings.get("group"),
            tags=list(settings.get("tags") or []),
            name=name,
            dir=str(run_dir),
            config=config,
            id=run_id,
            resume="allow",
            settings=wandb.Settings(silent=True, **({"init_timeout": timeout} if timeout else {})),
        )
        self.run = None
        failures = []
        for attempt in ([mode, "offline"] if mode == "online" else [mode]):
            # Silent before init too: wandb's login line would be a second line on stderr.
            wandb.setup(wandb.Settings(silent=True))
            try:
                self.run = wandb.init(mode=attempt, **kwargs)
                break
            except Exception as error:  # no network, a bad key, a server error: training goes on without it
                failures.append(str(error).splitlines()[0] if str(error) else type(error).__name__)
                self._teardown(wandb)
        if failures and self.run is not None:
            folder = self.run.settings.sync_dir
            print(f"warning: wandb did not start online ({failures[0]}); logging offline to {folder}; "
                  f"upload it later with `wandb sync {folder}`", file=sys.stderr)
        elif self.run is not None and mode == "offline":
            why = "no API key: `wandb login` or WANDB_API_KEY logs online" if settings.get("mode", "auto") == "auto" \
                else "logger.mode=offline"
            print(f"dreamer: wandb logs offline ({why}) to {self.run.settings.sync_dir}; upload it with "
                  f"`wandb sync {self.run.settings.sync_dir}`", flush=True)
        elif failures:
            print(f"warning: wandb did not start ({'; '.join(failures)}); not logging to wandb", file=sys.stderr)

    @staticmethod
    def _teardown(wandb) -> None:
        """Stops wandb's service process after a failed start. The service keeps the failed attempt's run
        id registered (a retry in the same process gets `run ID ... is in use`); a new service has no
        such record, so the offline fallback can reuse the id."""
        try:
            wandb.teardown()
        except (Exception, SystemExit):  # teardown exits when the service reports an error code
            pass

    @staticmethod
    def _has_key() -> bool:
        if os.environ.get("WANDB_API_KEY"):
            return True
        netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
        return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")

    def log(self, record: dict, step: int) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step)

    def media(self, videos: dict[str, Path], step: int) -> None:
        if self.run is None:
            return
        try:
            import wandb

            self.run.log({k: wandb.Video(str(path), format="mp4") for k, path in videos.items()}, step=step)
        except Exception as error:  # a video that cannot be logged never stops training
            print(f"warning: wandb could not log {sorted(videos)} ({str(error).splitlines()[0]})", file=sys.stderr)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


class Metrics:
    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        start_steps: int = 0,
        start_updates: int = 0,
        wandb: dict | None = None,
        name: str = "",
        config: dict | None = None,
        console: Console | None = None,
        frames_per_step: int = 1,
        clock: Callable[[], float] = time.perf_counter,
        window: float = 30.0,
    ):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.frames_per_step = frames_per_step  # frames = env steps x action repeat, as the reference counts
        self.total = total_steps
        self.console = console or Console()
        self.clock, self.window = clock, window
        self.start = clock()
        self.rates = Rates(start_steps, start_updates, self.start)
        self._recent = deque([(self.start, start_steps, start_updates)])  # the live line's samples
        self._start_updates = start_updates
        self._training_from: tuple[float, int] | None = None  # (time, env steps) when updates began
        self.last_return: float | None = None
        self.fps = 0.0
        self.ups = 0.0
        # logger.mode=disabled: not even imported, so it costs nothing.
        enabled = wandb and wandb.get("mode", "auto") != "disabled"
        self.sink = WandbSink(wandb, Path(run_dir), name, config or {}) if enabled else None
        self.live = self.console.is_terminal
        self.progress = None
        if self.live:
            self.progress = Progress(
                TextColumn("[bold]{task.completed:,.0f}[/]/{task.total:,.0f} env steps"),
                BarColumn(bar_width=24),
                TextColumn("{task.fields[fps]:,.0f} steps/s  {task.fields[ups]:.2f} updates/s"),
                TextColumn("return {task.fields[ret]}"),
                TimeElapsedColumn(),
                TextColumn("ETA {task.fields[eta]}"),
                console=self.console,
                transient=False,
            )
            self.task = self.progress.add_task(
                "train", total=total_steps, completed=start_steps, fps=0.0, ups=0.0, ret="-", eta="--:--"
            )
            self.progress.start()

    def eta(self, env_steps: int) -> float:
        """Seconds left at the rate since training began; inf before (or too early to tell: 5 s)."""
        if self._training_from is None:
            return math.inf
        then, steps0 = self._training_from
        seconds = self.clock() - then
        if seconds < 5.0 or env_steps <= steps0:
            return math.inf
        return max(self.total - env_steps, 0) / ((env_steps - steps0) / seconds)

    def episode(self, score: float) -> None:
        self.last_return = score

    def _sample(self, env_steps: int, updates: int) -> None:
        """Adds a reading to the live line's window; the first reading with a new update starts training."""
        now = self.clock()
        if self._training_from is None and updates > self._start_updates:
            self._training_from = (now, env_steps)
        self._recent.append((now, env_steps, updates))
        while len(self._recent) > 2 and now - self._recent[1][0] >= self.window:
            self._recent.popleft()  # the oldest kept is the last one at least `window` old
        then, steps0, updates0 = self._recent[0]
        if now - then >= 1.0:
            self.fps, self.ups = (env_steps - steps0) / (now - then), (updates - updates0) / (now - then)

    def tick(self, env_steps: int, updates: int | None = None) -> None:
        """Takes a reading of the counters (with `updates`) and refreshes the live line (cheap; rich
        redraws at its own rate)."""
        if updates is not None:
            self._sample(env_steps, updates)
        if self.progress is not None:
            ret = "-" if self.last_return is None else f"{self.last_return:.1f}"
            self.progress.update(
                self.task, completed=env_steps, fps=self.fps, ups=self.ups, ret=ret, eta=duration(self.eta(env_steps))
            )

    def write(self, record: dict, env_steps: int, updates: int, kind: str = "train", at: float | None = None) -> dict:
        """Appends one record to metrics.jsonl (and wandb); prints it when there is no live line.

        `at`: the clock's time at which env_steps and updates were read, when the record is written
        later (a train record waits for the learner's device values): its time and rates are of that moment.
        """
        at = self.clock() if at is None else at
        rates = self.rates(env_steps, updates, at) if kind == "train" else None
        if rates and self.progress is None:
            self.fps, self.ups = rates  # no live window: the plain line shows the record's span
        record = {
            "kind": kind,
            "env_steps": env_steps,
            "frames": env_steps * self.frames_per_step,
            "updates": updates,
            "time": round(at - self.start, 3),
            **({"env_steps_per_s": rates[0], "updates_per_s": rates[1]} if rates else {}),
            **record,
        }
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.sink is not None:
            self.sink.log({f"{kind}/{k}" if "/" not in k and k not in ("env_steps", "frames", "updates") else k: v
                           for k, v in record.items()}, step=env_steps)
        self.tick(env_steps)
        if kind != "train" or not self.live:
            self.print_record(record)
        return record

    def media(self, videos: dict[str, Path], env_steps: int) -> None:
        """Evaluation videos (already written under the run folder) to wandb, when it is on."""
        if self.sink is not None and videos:
            self.sink.media(videos, env_steps)

    def print_record(self, record: dict) -> None:
        kind = record["kind"]
        parts = [f"[{kind}]", f"{record['env_steps']:,}/{self.total:,} env steps"]
        if kind == "train":
            ret = "-" if self.last_return is None else f"{self.last_return:.1f}"
            parts += [
                f"{record['env_steps_per_s']:,.0f} steps/s",
                f"{record['updates_per_s']:.2f} updates/s",
                f"return {ret}",
                f"ETA {duration(self.eta(record['env_steps']))}",
            ]
        else:
            parts += [f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                      for k, v in record.items() if k not in ("kind", "env_steps", "frames", "updates", "time")]
        line = "  ".join(parts)
        if self.progress is not None:  # plain text: "[eval]" is not rich markup
            self.progress.console.print(line, markup=False, highlight=False)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.sink is not None:
            self.sink.close()


def read_records(run_dir: Path) -> list[dict]:
    """The records of a run folder's metrics.jsonl (none when it has none); a torn last line is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    records = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a run killed in the middle of a write
                continue
    return records


def elapsed(records: list[dict]) -> list[float]:
    """Each record's wall-clock seconds since the run began, summed over its commands: a record's `time`
    starts again at each resumed command."""
    total, offset, last = [], 0.0, 0.0
    for record in records:
        if record["time"] < last:
            offset += last
        last = record["time"]
        total.append(offset + last)
    return total


def run_summary(run_dir: Path, total_steps: int, ending: str) -> str:
    """The closing block of a run: what was trained and how far (`ending` says how it ended), the
    wall-clock, the final evaluation (or the last one, and the last training return), the command and
    the folder. Read from the run folder, so an interrupted or resumed run reads the same."""
    import yaml

    run_dir = Path(run_dir)
    records = read_records(run_dir)
    config, overrides = {}, []
    if (run_dir / "config.yaml").is_file():
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    if (run_dir / "overrides.yaml").is_file():
        overrides = yaml.safe_load((run_dir / "overrides.yaml").read_text()) or []
    name = (config.get("run") or {}).get("name") or run_dir.name
    last = records[-1] if records else {"env_steps": 0, "updates": 0}
    frames = last.get("frames", last["env_steps"])
    commands = 1 + sum(1 for a, b in zip(records, records[1:]) if b["time"] < a["time"])
    wall = elapsed(records)[-1] if records else 0.0
    lines = [f"run {name} {ending}: {last['env_steps']:,} of {total_steps:,} env steps"
             + (f" ({frames:,} frames)" if frames != last["env_steps"] else "")
             + f", {last['updates']:,} updates, {duration(wall)} of wall-clock"
             + (f" over {commands} commands" if commands > 1 else "")]
    final = [r for r in records if r["kind"] == "final_eval" and "eval/return_mean" in r]
    evals = [r for r in records if r["kind"] == "eval" and "eval/return_mean" in r]
    shown = final[-1] if final else evals[-1] if evals else None
    if shown is not None:
        label = "final evaluation" if final else f"last evaluation (at {shown['env_steps']:,} env steps)"
        lines.append(f"  {label}: return {shown['eval/return_mean']:.2f} mean, {shown['eval/return_min']:.2f} min, "
                     f"{shown['eval/return_max']:.2f} max over {shown['eval/episodes']} episodes")
    else:
        lines.append("  no evaluation recorded")
    returns = [r["episode/return"] for r in records if r["kind"] == "train" and "episode/return" in r]
    if returns:
        lines.append(f"  training return (the last record's episodes): {returns[-1]:.2f}")
    command = f"python -m dreamer.train {' '.join(overrides)}".rstrip()
    if run_dir.resolve() != (Path("runs") / name).resolve():  # a sweep's job, or a folder named by hydra.run.dir:
        command += f" hydra.run.dir={run_dir}"  # the command that resumes this folder says so
    lines.append(f"  command: {command}")
    lines.append(f"  folder: {run_dir}")
    return "\n".join(f"dreamer: {line}" for line in lines)


def training_rates(records: list[dict]) -> tuple[float, float] | None:
    """(env steps/s, updates/s) of the training phase: from the first train record with updates to the
    last one, in wall-clock summed over resumed commands (evaluations and checkpoints inside it count, the
    replay's prefill does not). None when the run has not trained over two records yet."""
    train = [(record, seconds) for record, seconds in zip(records, elapsed(records))
             if record.get("kind") == "train" and record.get("updates", 0) > 0]
    if len(train) < 2 or train[-1][1] <= train[0][1]:
        return None
    (first, start), (last, end) = train[0], train[-1]
    seconds = end - start
    return (last["env_steps"] - first["env_steps"]) / seconds, (last["updates"] - first["updates"]) / seconds
