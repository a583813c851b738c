"""What each preset's learner costs per 100K frames: the updates a preset makes per 100K frames (from its
composed config) times a learner step measured by scripts/bench_learner.py at the preset's shapes.

    python scripts/preset_costs.py [--measured FILE.jsonl ...] [--frames 100000] [--presets a,b,...]

Per preset: its model, what the learner reads (a vector, or images C x H x W), batch x length, train_ratio,
frames per agent step (the action repeat, as the reference counts frames), and updates per --frames frames
= frames / repeat x train_ratio / (batch_size x batch_length). Where a JSON line of bench_learner.py (variant
ours, any file given with --measured) has the preset's model, observation kind, image shape, batch and
length, the table adds its ms per update and the learner's minutes per --frames frames. That is the
learner's share only: env stepping, evaluation and start-up come on top wherever the learner waits for
them (a run whose learner is busy all along, as dmc_proprio's is with its worker source, takes about that).
`scripts/reproduce.sh preset-costs` measures the shapes on a GPU and prints this table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dreamer.config import compose_config, group_options, updates_per_step  # noqa: E402
from dreamer.envs import frames_per_step, pixel_shape  # noqa: E402

PRESETS = ("dmc_proprio", "dmc_proprio_paper", "dmc_vision", "dmc_vision_paper", "crafter", "atari100k", "atari",
           "minecraft")


def learner_input(env) -> tuple[str, tuple[int, int, int] | None]:
    """("vector", None) or ("image", (C, H, W)): what the preset's learner reads (images where there are any),
    from the env settings (`dreamer.envs.pixel_shape`, which builds no env: ALE, Crafter or MineRL need not be
    installed)."""
    shape = pixel_shape(env)
    return ("vector", None) if shape is None else ("image", shape)


def preset_row(preset: str, frames: int) -> dict:
    cfg = compose_config([f"+exp={preset}"])
    obs, image = learner_input(cfg.env)
    repeat = frames_per_step(cfg.env)
    return {"preset": preset, "model": cfg.model.name, "obs": obs, "image": image, "batch": cfg.batch_size,
            "length": cfg.batch_length, "train_ratio": cfg.run.train_ratio, "repeat": repeat,
            "updates": frames / repeat * updates_per_step(cfg)}


def measured_steps(paths: list[Path]) -> dict:
    """{(model, obs, image, batch, length): (ms per update, device)} from bench_learner.py's lines (variant
    ours; the last line of a shape wins). Lines written before --image existed are 3 x 64 x 64 images."""
    steps = {}
    for path in paths:
        if not path.is_file():
            sys.exit(f"error: {path} not found: pass bench_learner.py's --out file")
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                sys.exit(f"error: {path}:{number} is not a JSON line: pass bench_learner.py's --out file")
            if row.get("variant") != "ours" or "ms_per_update" not in row:
                continue
            image = tuple(row.get("image", (3, 64, 64))) if row["obs"] == "image" else None
            steps[(row["model"], row["obs"], image, row["batch"], row["length"])] = (row["ms_per_update"],
                                                                                       row.get("device", "?"))
    return steps


def table(rows: list[dict], steps: dict, frames: int) -> str:
    head = (f"| preset | model | learner input | batch x length | train_ratio | frames per agent step | "
            f"updates per {frames:,} frames | ms per update | learner minutes per {frames:,} frames | measured on |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        shape = "vector" if r["obs"] == "vector" else "image " + " x ".join(map(str, r["image"]))
        found = steps.get((r["model"], r["obs"], r["image"], r["batch"], r["length"]))
        ms, minutes, device = ("-", "-", "not measured") if found is None else (
            f"{found[0]:.2f}", f"{r['updates'] * found[0] / 60e3:.1f}", found[1])
        lines.append(f"| {r['preset']} | {r['model']} | {shape} | {r['batch']} x {r['length']} | {r['train_ratio']:g} | "
                     f"{r['repeat']} | {r['updates']:,.0f} | {ms} | {minutes} | {device} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measured", type=Path, nargs="*", default=[], help="bench_learner.py --out files")
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated presets (configs/exp)")
    args = parser.parse_args()
    if args.frames < 1:
        sys.exit(f"error: --frames must be at least 1, got {args.frames}")
    known = group_options("exp")
    presets = [p for p in args.presets.split(",") if p]
    unknown = [p for p in presets if p not in known]
    if unknown:
        sys.exit(f"error: unknown preset(s) {', '.join(unknown)}; available: {', '.join(known)}")
    print(table([preset_row(p, args.frames) for p in presets], measured_steps(args.measured), args.frames))


if __name__ == "__main__":
    main()
