"""What a run reports: a live console line, metrics.jsonl in the run folder (always), and wandb on request.

The console line (rich) shows env steps, env steps/s, updates/s, the last episode return and the ETA.
When stdout is not a terminal (CI, a log file) the same fields are printed as one plain line per record.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


def _eta(seconds: float) -> str:
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

    def __init__(self, env_steps: int, updates: int):
        self._last = (time.perf_counter(), env_steps, updates)

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
    ):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.frames_per_step = frames_per_step  # frames = env steps x action repeat, as the reference counts
        self.total = total_steps
        self.console = console or Console()
        self.start = time.perf_counter()
        self.rates = Rates(start_steps, start_updates)
        self._overall = (time.perf_counter(), start_steps)
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
        then, steps0 = self._overall
        rate = (env_steps - steps0) / max(time.perf_counter() - then, 1e-9)
        return max(self.total - env_steps, 0) / rate if rate > 0 else math.inf

    def episode(self, score: float) -> None:
        self.last_return = score

    def tick(self, env_steps: int) -> None:
        """Refreshes the live line (cheap; rich redraws at its own rate)."""
        if self.progress is not None:
            ret = "-" if self.last_return is None else f"{self.last_return:.1f}"
            self.progress.update(
                self.task, completed=env_steps, fps=self.fps, ups=self.ups, ret=ret, eta=_eta(self.eta(env_steps))
            )

    def write(self, record: dict, env_steps: int, updates: int, kind: str = "train", at: float | None = None) -> dict:
        """Appends one record to metrics.jsonl (and wandb); prints it when there is no live line.

        `at`: the perf_counter time at which env_steps and updates were read, when the record is written
        later (a train record waits for the learner's device values): its time and rates are of that moment.
        """
        at = time.perf_counter() if at is None else at
        if kind == "train":
            self.fps, self.ups = self.rates(env_steps, updates, at)
        record = {
            "kind": kind,
            "env_steps": env_steps,
            "frames": env_steps * self.frames_per_step,
            "updates": updates,
            "time": round(at - self.start, 3),
            **({"env_steps_per_s": self.fps, "updates_per_s": self.ups} if kind == "train" else {}),
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
                f"ETA {_eta(self.eta(record['env_steps']))}",
            ]
        else:
            parts += [f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                      for k, v in record.items() if k not in ("kind", "env_steps", "frames", "updates", "time")]
        line = "  ".join(parts)
        if self.progress is not None:
            self.progress.console.print(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.sink is not None:
            self.sink.close()
