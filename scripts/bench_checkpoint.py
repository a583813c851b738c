"""The cost of a checkpoint with its replay, at the Minecraft preset's scale.

    python scripts/bench_checkpoint.py --dir /path/on/the/run/disk            # 1e6 records, 64 streams, size200m
    python scripts/bench_checkpoint.py --dir /tmp/c --records 2048 --streams 4 --increment 256 --model size1m   # CI smoke

Fills `dreamer.replay.Replay` with `--records` records of the emulated Minecraft env's layout (the real
MineRL specs: 64 x 64 image, inventory vectors, 25 actions) and `--model`'s latent context in bf16, builds
that model's learner on `--device` for a state of the real size, then:

  first        a checkpoint of the whole replay (every record new), through `dreamer.checkpoint.Checkpointer`
  increment    `--increment` new records per stream-sum, then a second checkpoint: only they are written
  restore      a new Replay refilled from the second checkpoint

One JSON line each: save_call_ms (how long the training loop's thread is held by the save call: the
learner state's copies are enqueued, the rest is the writer thread's), commit_s (until the checkpoint
file is renamed into place: everything durable), written_gb, max_lock_ms (the longest any stream's
inserts and write-backs waited while the writer copied that stream's new records), then the disk
used by the checkpoint folder; for restore: load_s and records. The learner's update time to compare
save_call_ms with is in BENCHMARKS.md (size200m, 32 x 256).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_replay import _layout  # noqa: E402

from dreamer import checkpoint  # noqa: E402
from dreamer.agent import IMAGE_KEY, build_agent  # noqa: E402
from dreamer.learner import Learner  # noqa: E402
from dreamer.config import reference_settings  # noqa: E402
from dreamer.replay import Replay, record_bytes  # noqa: E402
from dreamer.inference import request_spec  # noqa: E402


class TimedReplay(Replay):
    """The replay, timing how long each stream's lock is held for a checkpoint's copy of its records."""

    max_lock_s = 0.0

    def snapshot(self, stream, since):
        start = time.perf_counter()
        out = super().snapshot(stream, since)
        self.max_lock_s = max(self.max_lock_s, time.perf_counter() - start)
        return out


def _records(layout, size, count: int, value: int) -> TensorDict:
    """`count` records with every field set to a constant (content does not change the cost: nothing is
    compressed)."""
    nxt = {"reward": torch.full((count, 1), float(value)), "done": torch.zeros(count, 1, dtype=torch.bool),
           "terminated": torch.zeros(count, 1, dtype=torch.bool)}
    for key, width in zip(layout.vector_keys, layout.vector_sizes):
        nxt[key] = torch.full((count, width), float(value))
    if layout.image_shape is not None:
        nxt[IMAGE_KEY] = torch.full((count, *layout.image_shape), value % 256, dtype=torch.uint8)
    return TensorDict({"state": torch.full((count, size.latent), float(value), dtype=torch.bfloat16),
                       "belief": torch.full((count, size.deter), float(value), dtype=torch.bfloat16),
                       "action": torch.zeros(count, layout.action_dim),
                       "is_init": torch.zeros(count, 1, dtype=torch.bool), "next": nxt}, [count])


def _fill(replay: Replay, layout, size, per_stream: int, value: int, chunk: int = 2048) -> None:
    for stream in range(replay.streams):
        left = per_stream
        while left:
            count = min(chunk, left)
            replay.add_chunk(stream, _records(layout, size, count, value))
            left -= count


def _disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="a folder on the disk the run would use (emptied)")
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--increment", type=int, default=100_000, help="records added before the second checkpoint")
    parser.add_argument("--model", default="size200m")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    (size, loss, optimizer), layout = reference_settings(args.model), _layout()
    device = torch.device(args.device)
    per_record = record_bytes(request_spec(layout, size))
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    with torch.device(device):
        agent = build_agent(layout, size)
    learner = Learner(agent, loss, optimizer, device, False, False, device.type == "cuda")
    state_bytes = sum(t.numel() * t.element_size() for t in _tensors(learner.state_dict()))
    _emit({"what": "setup", "records": args.records, "streams": args.streams, "model": args.model,
           "bytes_per_record": per_record, "replay_gb": per_record * args.records / 1e9,
           "learner_state_gb": state_bytes / 1e9, "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None})

    replay = TimedReplay(args.streams, args.records, 16, 64, device, prefetch=0)
    started = time.perf_counter()
    _fill(replay, layout, size, args.records // args.streams, 1)
    _emit({"what": "fill", "seconds": time.perf_counter() - started, "records": len(replay)})
    saver = checkpoint.Checkpointer(args.dir, keep=1, replay=replay)
    start = time.perf_counter()
    saver.reserve(learner.state_dict())  # as the training command does at start-up
    _emit({"what": "reserve", "seconds": time.perf_counter() - start})

    def save(step: int, what: str) -> None:
        replay.max_lock_s = 0.0
        start = time.perf_counter()
        future = saver.save(step, {"learner": learner.state_dict(), "counters": {"env_steps": step}})
        called = time.perf_counter() - start
        future.result()
        _emit({"what": what, "save_call_ms": called * 1e3, "commit_s": time.perf_counter() - start,
               "written_gb": saver.last_bytes / 1e9, "max_lock_ms": replay.max_lock_s * 1e3,
               "disk_gb": _disk(checkpoint.folder(args.dir)) / 1e9})

    save(args.records, "first")
    _fill(replay, layout, size, args.increment // args.streams, 2)
    save(args.records + args.increment, "increment")
    saver.close()

    path = checkpoint.list_checkpoints(args.dir)[-1]
    restored = Replay(args.streams, args.records, 16, 64, device, prefetch=0)
    start = time.perf_counter()
    state = checkpoint.load(path)
    count = checkpoint.Checkpointer(args.dir, keep=1, replay=restored).restore(state["replay"], path)
    _emit({"what": "restore", "load_s": time.perf_counter() - start, "records": count,
           "equal_to_saved": count == len(replay)})
    replay.close()
    restored.close()
    shutil.rmtree(args.dir, ignore_errors=True)


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)


if __name__ == "__main__":
    main()
