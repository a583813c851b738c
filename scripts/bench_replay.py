"""Replay host cost: sampling a batch and applying its write-back, ours against torchrl's stock pieces.

    python scripts/bench_replay.py                       # Minecraft shapes: 64 streams, 32 x 257, size50m
    python scripts/bench_replay.py --device cuda         # sample includes pinning and the copy to the GPU
    python scripts/bench_replay.py --device cuda --profile replay-profile.txt   # and where the time goes
    python scripts/bench_replay.py --streams 4 --per-stream 64 --batch 4 --length 16 --samples 3   # CI smoke

Both variants are `dreamer.replay.Replay` filled with the same records of the emulated Minecraft env's
layout (random image content) and the model's latent sizes:

  ours   all streams in one table, a batch drawn by the replay and gathered with one row gather per key,
         the latent context left out (each sequence's first context is read on its own).
  stock  torchrl's SliceSampler (window search over the stream column, a second gather of every window
         for its flags) and LazyTensorStorage (every record's context gathered).

One JSON line per variant: sample_ms (median over --samples after two untimed ones; on CUDA until the
batch is on the device), sampled_mb (bytes of the batch), write_back_ms (median, until applied); and a
last line with the ratios stock / ours. Host timings: run it on the machine whose cores matter.
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, SliceSampler, TensorDictReplayBuffer, TensorDictRoundRobinWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_learner import _emit, _size  # noqa: E402  (scripts/ is on the path of a script run)

from dreamer.agent import IMAGE_KEY, EnvLayout, ModelSize  # noqa: E402
from dreamer.config import CONFIG_DIR  # noqa: E402
from dreamer.envs import make_env  # noqa: E402
from dreamer.replay import HANDLE_KEYS, STREAM_KEY, Replay  # noqa: E402


class StockReplay(Replay):
    """The replay on torchrl's own pieces, the reference ours is measured against: each stream a
    `LazyTensorStorage` sampled by torchrl's `SliceSampler` (episode flags untouched), the ensemble's own
    prefetch thread and gathers, every record's context included in a batch, and write-backs through the
    ensemble's `update_if_present`."""

    def __init__(self, *args, prefetch: int | None = None, **kwargs):
        self._visible_to_next: list = []  # the write-backs torchrl's prepared sample observes
        super().__init__(*args, prefetch=prefetch, online=False, **kwargs)

    def _member(self, stream: int) -> TensorDictReplayBuffer:
        return TensorDictReplayBuffer(
            storage=LazyTensorStorage(self.capacity),
            sampler=SliceSampler(slice_len=self.sequence, traj_key=STREAM_KEY, strict_length=True, init_key=None),
            writer=TensorDictRoundRobinWriter(track_generations=True),
        )

    def _check_members(self, members: list) -> None:
        pass  # torchrl's storages keep their own generations

    def _ensemble_prefetch(self, prefetch: int | None) -> int | None:
        return prefetch or None

    def sample(self) -> tuple[TensorDict, TensorDict]:
        prepared = bool(self.buffer._prefetch and len(self.buffer._prefetch_queue))
        observe = self._visible_to_next if prepared else self._pending_writes()
        data = self.buffer.sample().reshape(self.batch_size, self.sequence)  # prepares the next one
        self._visible_to_next = self._pending_writes()
        for write in observe:
            write.result()
        return self._upload(data.exclude(*HANDLE_KEYS, STREAM_KEY))[0], data.select(*HANDLE_KEYS)

    def _apply_patch(self, index, generation, patch):
        return self.buffer.update_if_present(index=index, generation=generation, patch=patch)


def _layout() -> EnvLayout:
    cfg = OmegaConf.load(CONFIG_DIR / "env" / "emulated.yaml")
    cfg.step_latency = 0.0
    probe = make_env(cfg, 0)
    layout = EnvLayout.from_specs(probe.observation_spec, probe.action_spec)
    probe.close()
    return layout


def _chunk(layout: EnvLayout, size: ModelSize, count: int, generator: torch.Generator) -> TensorDict:
    nxt = {"reward": torch.zeros(count, 1), "done": torch.zeros(count, 1, dtype=torch.bool),
           "terminated": torch.zeros(count, 1, dtype=torch.bool)}
    for key, width in zip(layout.vector_keys, layout.vector_sizes):
        nxt[key] = torch.randn(count, width, generator=generator)
    if layout.image_shape is not None:
        nxt[IMAGE_KEY] = torch.randint(0, 256, (count, *layout.image_shape), dtype=torch.uint8, generator=generator)
    is_init = torch.zeros(count, 1, dtype=torch.bool)
    return TensorDict({"state": torch.randn(count, size.latent, generator=generator),
                       "belief": torch.randn(count, size.deter, generator=generator),
                       "action": torch.zeros(count, layout.action_dim), "is_init": is_init, "next": nxt}, [count])


def _nbytes(batch: TensorDict) -> int:
    return sum(v.numel() * v.element_size() for v in batch.values(include_nested=True, leaves_only=True))


def measure(args, layout: EnvLayout, size: ModelSize, stock: bool) -> dict:
    device = torch.device(args.device)
    replay = (StockReplay if stock else Replay)(args.streams, args.streams * args.capacity, args.batch, args.length,
                                                device, seed=0)
    generator = torch.Generator().manual_seed(0)
    for stream in range(args.streams):
        for _ in range(args.per_stream // 64):
            replay.add_chunk(stream, _chunk(layout, size, 64, generator))
    samples, write_backs, sampled = [], [], 0
    profiler = cProfile.Profile() if args.profile else None
    for i in range(args.samples + 2):
        if profiler is not None and i >= 2:
            profiler.enable()
        start = time.perf_counter()
        batch, handles = replay.sample()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        took = time.perf_counter() - start
        if profiler is not None:
            profiler.disable()
        # The distinct bytes the batch holds (an expanded context counts once per sequence).
        sampled = _nbytes(batch.exclude("state", "belief")) + sum(
            batch.get(k)[:, 0].numel() * 4 for k in ("state", "belief")) * (args.length + 1 if stock else 1)
        state = torch.randn(args.batch, args.length + 1, size.latent, device=device)
        belief = torch.randn(args.batch, args.length + 1, size.deter, device=device)
        start = time.perf_counter()
        replay.write_back(handles, state[:, :-1], belief[:, :-1], wait=True)
        if i >= 2:
            samples.append(took)
            write_backs.append(time.perf_counter() - start)
    replay.close()
    if profiler is not None:  # where the trainer thread's sampling time goes (the prefetch thread not included)
        with open(args.profile, "a") as f:
            f.write(f"== {'stock' if stock else 'ours'}: {args.samples} samples on {args.device}\n")
            pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(25)
            pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(15)
    return {"variant": "stock" if stock else "ours", "device": args.device, "streams": args.streams,
            "records": args.streams * args.per_stream, "batch": args.batch, "length": args.length,
            "model": args.model, "sample_ms": round(statistics.median(samples) * 1e3, 1),
            "sampled_mb": round(sampled / 2**20, 1), "write_back_ms": round(statistics.median(write_backs) * 1e3, 1),
            "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="size50m")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--capacity", type=int, default=6250, help="records per stream")
    parser.add_argument("--per-stream", type=int, default=768, help="records written per stream (multiple of 64)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--variant", default="ours,stock")
    parser.add_argument("--out", help="also append the JSON lines to this file")
    parser.add_argument("--profile", help="append each variant's cProfile of the timed samples to this file")
    args = parser.parse_args()
    logging.getLogger("torchrl").setLevel(logging.WARNING)  # one line per stream's storage otherwise
    if args.per_stream < 64 or args.per_stream % 64 or args.per_stream < args.length + 1:
        parser.error("--per-stream must be a multiple of 64 and hold one window of --length + 1 records")
    layout, size = _layout(), _size(args.model)
    results = {}
    for variant in args.variant.split(","):
        if variant not in ("ours", "stock"):
            parser.error(f"unknown variant {variant!r}: use ours, stock or both")
        results[variant] = measure(args, layout, size, stock=variant == "stock")
        _emit(results[variant], args.out)
    if len(results) == 2:
        ours, stock = results["ours"], results["stock"]
        _emit({"ratio": "stock / ours", "sample": round(stock["sample_ms"] / ours["sample_ms"], 2),
               "sampled_bytes": round(stock["sampled_mb"] / ours["sampled_mb"], 2),
               "write_back": round(stock["write_back_ms"] / ours["write_back_ms"], 2)}, args.out)


if __name__ == "__main__":
    main()
