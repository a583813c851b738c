"""The start-up of the worker source, by `run.worker_start`: how long until every env worker steps, and the
memory the workers hold together once they do.

    python scripts/bench_startup.py [--envs 8] [--settle 10] [--methods spawn,forkserver] [OVERRIDE ...]

For each method, one training run of the application (`python -m dreamer.train`, the worker source, with the
overrides given; default: the emulated Minecraft env at 1 ms per step, smoke model, server thread) in a
temporary folder: the seconds from the pool's start to its line "all N env workers stepping", read from the
run's output (the fork server's own imports start at the source's creation, before the learner's warm-up,
and count only as far as they still run when the pool starts), then, after `--settle` seconds, the summed
proportional set size (PSS: shared pages counted once over the processes that share them) and resident size
of the workers, the fork server included. The run is stopped with SIGTERM (it saves and exits). One JSON
line per method, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ["+exp=emulated", "+debug=smoke", "env.step_latency=0.001", "run.inference=thread", "run.chunk=16",
           "run.steps=1000000"]


def _children() -> dict[int, int]:
    """{pid: parent pid} of every process."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return parents


def _descendants(root: int) -> list[int]:
    parents, found, frontier = _children(), [], [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found.append(pid)
                frontier.append(pid)
    return found


def _memory(pid: int) -> tuple[int, int] | None:
    """(PSS, RSS) in kB."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    return (int(re.search(r"^Pss:\s+(\d+)", text, re.M).group(1)),
            int(re.search(r"^Rss:\s+(\d+)", text, re.M).group(1)))


def measure(method: str, envs: int, settle: float, overrides: list[str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "dreamer.train", *overrides, "run.collect=workers", f"run.envs={envs}",
                   f"run.worker_start={method}", f"hydra.run.dir={folder}/run"]
        path = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
        trainer = subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env={**os.environ, "PYTHONPATH": path})
        seconds, output, deadline = None, [], time.monotonic() + timeout
        try:
            for line in trainer.stdout:
                output.append(line)
                found = re.search(r"all \d+ env workers stepping ([\d.]+) s after their start", line)
                if found:
                    seconds = float(found.group(1))
                    break
                if time.monotonic() > deadline:
                    break
            if seconds is None:
                raise SystemExit(f"error: the {method} run's workers did not all step within {timeout:.0f} s; "
                                 f"its output ends:\n{''.join(output[-20:])}")
            time.sleep(settle)
            workers = []
            for pid in _descendants(trainer.pid):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if "forkserver" in cmdline or "spawn_main" in cmdline:
                    workers.append(pid)
            sizes = [m for m in map(_memory, workers) if m is not None]
        finally:
            trainer.send_signal(signal.SIGTERM)
            try:
                trainer.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                trainer.kill()
                trainer.wait()
    return {"method": method, "envs": envs, "all_stepping_s": seconds, "processes": len(sizes),
            "pss_mb": round(sum(p for p, _ in sizes) / 1024, 1), "rss_mb": round(sum(r for _, r in sizes) / 1024, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after the start before memory is read")
    parser.add_argument("--methods", default="spawn,forkserver")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("overrides", nargs="*", help=f"training overrides (default: {' '.join(DEFAULT)})")
    args = parser.parse_args()
    methods = args.methods.split(",")
    if args.envs < 1 or not set(methods) <= {"spawn", "forkserver"}:
        print("error: --envs must be at least 1 and --methods a list of spawn, forkserver", file=sys.stderr)
        return 2
    results = [measure(method, args.envs, args.settle, args.overrides or DEFAULT, args.timeout) for method in methods]
    for result in results:
        print(json.dumps(result), flush=True)
    if len(results) == 2:
        first, second = results
        print(f"{second['method']} against {first['method']}: start-up "
              f"{first['all_stepping_s'] / max(second['all_stepping_s'], 1e-3):.1f} x faster, "
              f"workers' PSS {second['pss_mb'] / max(first['pss_mb'], 1e-3):.2f} x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
