"""Learner step speed: our compiled, CUDA-graph step against torchrl's DreamerV3OptimizationStepper.

    python scripts/bench_learner.py --device cuda --model size1m --batch 16 --length 64 --obs vector
    python scripts/bench_learner.py --device cuda --model size50m --batch 32 --length 256 --obs image --variant ours

Every variant runs in its own process (a fresh compiler cache, its own peak memory) under a time limit
(`--limit`, warm-up and measurement together) and, unless `--warm-cache`, with empty compiler caches;
one that runs out is reported with the time it ran. `--parallel` starts torchrl's variants side by side
after the others (their minutes of compiling are CPU work) and says whether two timed phases overlapped.
One JSON line per variant: updates_per_second, ms_per_update (median of --updates timed updates after
warm-up), warmup_seconds, kernels_per_update and gpu_busy (torch.profiler over --profile updates),
peak_memory_gib; ours also reports the FLOPs of one update and the fraction of the bf16 peak. The last
line is the ratio ours / torchrl (torchrl's faster configuration that warmed up).

Variants: ours (compile + CUDA graph on CUDA; eager on CPU), ours_cl (ours with the image CNNs in
channels-last memory format), ours_autotune (ours with inductor's Triton matmul templates, chosen by timing
against cuBLAS, so that a matmul's bias, tap and casts fuse into its kernel: fewer launches, longer
warm-up), ours_fuse (ours with `run.fuse_kernels`: inductor's combo kernels, independent kernels of a
compiled graph, e.g. the norms of one scan step, side by side in one launch), ours_graph (CUDA graph, no
compile), ours_copt (ours with LaProp's step compiled too: a probe of whether inductor fuses the
optimizer's list operations, adaptive clipping's per-tensor multiply included, into fewer kernels and memory
passes), torchrl_step (whole-step compile + CUDA graph), torchrl_scan (compiled RSSM scan + CUDA graph);
on CPU torchrl runs eagerly (torchrl_eager).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensordict import TensorDict  # noqa: E402
from torchrl.data import Bounded, Composite, OneHot, Unbounded  # noqa: E402

from dreamer.agent import EnvLayout, ModelSize, build_agent, torchrl_loss  # noqa: E402
from dreamer.config import reference_settings  # noqa: E402
from dreamer.learner import Learner  # noqa: E402

BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0}  # dense bf16 tensor-core peak (SXM)


def _layout(obs: str, obs_dim: int, actions: int, image: tuple[int, int, int] = (3, 64, 64)) -> EnvLayout:
    if obs == "image":
        spec = Composite(pixels=Bounded(0, 255, image, dtype=torch.uint8))
    else:
        spec = Composite(observation=Unbounded(obs_dim))
    return EnvLayout.from_specs(spec, OneHot(actions))


def _size(name: str, full_res: bool = False) -> ModelSize:
    """A model size of configs/; `full_res`: model.cnn_full_res with a multiplier 1 first (the stride-1 stage)."""
    size = reference_settings(name)[0]
    return replace(size, cnn_full_res=True, mults=(1, *size.mults)) if full_res else size


def _batch(layout: EnvLayout, size: ModelSize, batch: int, length: int, device) -> TensorDict:
    """A replay-like batch: episodes start at random places, sparse rewards, a few terminations."""
    g = torch.Generator().manual_seed(0)
    nxt = {"reward": (torch.rand(batch, length, 1, generator=g) < 0.1).float(),
           "terminated": torch.rand(batch, length, 1, generator=g) < 0.005}
    nxt["done"] = nxt["terminated"].clone()
    if layout.vector_keys:
        nxt["observation"] = torch.randn(batch, length, layout.vector_dim, generator=g)
    if layout.image_shape:
        nxt["pixels"] = torch.randint(0, 256, (batch, length, *layout.image_shape), dtype=torch.uint8, generator=g)
    is_init = torch.zeros(batch, length, 1, dtype=torch.bool)
    is_init[:, 0] = True
    is_init[1:, 1:] |= nxt["done"][1:, :-1]
    action = torch.nn.functional.one_hot(torch.randint(0, layout.action_dim, (batch, length), generator=g),
                                         layout.action_dim).float()
    td = TensorDict({"state": torch.zeros(batch, length, size.latent), "belief": torch.zeros(batch, length, size.deter),
                     "action": action, "is_init": is_init, "next": nxt}, [batch, length])
    return td.to(device)


def _profile(update, count: int, cuda: bool, table: str | None = None) -> dict:
    """Kernels per update and the fraction of wall time some kernel ran (union of kernel intervals);
    `table`: also write every kernel name with its launches and microseconds per update (TSV)."""
    if not cuda:
        return {}
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(count):
            update()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    intervals = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, -1.0
    for lo, hi in intervals:
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    span = (intervals[-1][1] - intervals[0][0]) if intervals else 1.0
    by_name: dict[str, list] = {}
    for e in kernels:
        entry = by_name.setdefault(e.name[:70], [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.end - e.time_range.start
    if table:
        full: dict[str, list] = {}
        for e in kernels:
            entry = full.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.time_range.end - e.time_range.start
        rows = sorted(full.items(), key=lambda kv: -kv[1][1])
        Path(table).parent.mkdir(parents=True, exist_ok=True)
        Path(table).write_text("launches_per_update\tus_per_update\tkernel\n" + "".join(
            f"{n / count:.1f}\t{us / count:.1f}\t{name}\n" for name, (n, us) in rows))
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]
    breakdown = [[name, round(n / count, 1), round(us / 1e3 / count, 3)] for name, (n, us) in top]
    return {"top_kernels_by_time": breakdown, "kernels_per_update": round(len(kernels) / count),
            "gpu_busy": round(busy / span, 3),
            "kernel_ms_per_update": round(sum(hi - lo for lo, hi in intervals) / 1e3 / count, 2),
            "profiled_wall_ms_per_update": round(wall * 1e3 / count, 2)}


def _flops(learner: Learner, batch) -> float:
    """FLOPs of one update (forward and backward; matmuls and convolutions), counted on an eager pass."""
    from torch.utils.flop_counter import FlopCounterMode

    with learner.undone(), FlopCounterMode(display=False) as counter:
        total, _, _, _, scan = learner._losses(learner._inputs(batch))
        learner._gradients(total, scan)
    return float(counter.get_total_flops())


def run_single(args) -> dict:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    torch.manual_seed(0)
    layout = _layout(args.obs, args.obs_dim, args.actions, args.image)
    size = _size(args.model, args.cnn_full_res)
    _, loss_settings, optimizer_settings = reference_settings(args.model)
    with torch.device(device):
        agent = build_agent(layout, size)
    batch = _batch(layout, size, args.batch, args.length, device)
    result = {"variant": args.single, "model": args.model, "obs": args.obs,
              **({"image": list(args.image), "cnn_full_res": args.cnn_full_res} if args.obs == "image" else {}),
              "batch": args.batch,
              "length": args.length, "cudnn_benchmark": args.cudnn_benchmark,
              "device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "parameters": agent.networks.parameter_count()}
    if args.single == "ours_autotune":
        import torch._inductor.config as inductor

        inductor.max_autotune_gemm = True  # Triton GEMM templates beside cuBLAS, with epilogue fusion
    if args.single.startswith("ours"):
        compile = cuda and args.single in ("ours", "ours_cl", "ours_autotune", "ours_fuse", "ours_copt")
        learner = Learner(agent, loss_settings, optimizer_settings, device, compile=compile, cudagraph=cuda, bf16=cuda,
                          channels_last=args.single == "ours_cl", fuse_kernels=args.single == "ours_fuse",
                          progress=lambda line: print(f"warm-up: {line}", file=sys.stderr, flush=True))
        if args.single == "ours_copt":  # compiled at the warm-up's first update, inside the captured step
            learner.optimizer.step = torch.compile(learner.optimizer.step, dynamic=False)
        if args.flops:
            result["gflop_per_update"] = round(_flops(learner, batch) / 1e9, 1)
        start = time.perf_counter()
        learner.warmup(batch)
        result["warmup_seconds"] = round(time.perf_counter() - start, 1)
        result["compile_seconds"] = {name: round(piece.compile_seconds, 1) for name, piece in (
            ("embed", learner._embed), ("cell", learner._cell), ("imagine", learner._imagine),
            ("tail", learner._tail)) if piece.compile_seconds is not None}

        def update():
            learner.update(batch)
    else:
        from torchrl.trainers.algorithms import DreamerV3OptimizationStepper, DreamerV3Optimizer
        from torchrl.modules.models.model_based import RSSMRolloutV3

        settings = optimizer_settings
        with torch.device(device):
            loss, slow_critic = torchrl_loss(agent, loss_settings)
        optimizer = DreamerV3Optimizer(loss.parameters(), lr=settings.lr, agc=settings.agc, eps=settings.eps,
                                       warmup_steps=settings.warmup)
        if args.single == "torchrl_scan":
            for module in loss.modules():
                if isinstance(module, RSSMRolloutV3):
                    module.compile_rollout("scan", unroll=8)
        stepper = DreamerV3OptimizationStepper(
            loss, optimizer, slow_critic, compile_train_step=args.single == "torchrl_step",
            cudagraph=cuda and args.single != "torchrl_eager", mixed_precision=cuda)
        start = time.perf_counter()
        if args.single != "torchrl_eager":
            stepper.warmup(batch)
        result["warmup_seconds"] = round(time.perf_counter() - start, 1)

        def update():
            stepper.step(None, batch)
    measured_from = time.time()  # wall clock: --parallel checks that no two measurements overlapped
    for _ in range(3):  # first replays: allocator and caches
        update()
    times = []
    for _ in range(args.updates):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            update()
            end.record()
            times.append((begin, end))
        else:
            t0 = time.perf_counter()
            update()
            times.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize()
        times = [b.elapsed_time(e) / 1e3 for b, e in times]
    median = statistics.median(times)
    result.update({"ms_per_update": round(median * 1e3, 2), "updates_per_second": round(1 / median, 2)})
    table = f"{args.kernel_tables}/kernels-{args.model}-{args.single}.tsv" if args.kernel_tables else None
    result.update(_profile(update, args.profile, cuda, table))
    result["measured_span"] = [round(measured_from, 2), round(time.time(), 2)]
    if args.single.startswith("ours"):
        metrics = learner.drain()
        result["losses_finite"] = bool(metrics) and all(v == v and abs(v) != float("inf") for v in metrics.values())
    if cuda:
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        if "gflop_per_update" in result:
            achieved = result["gflop_per_update"] * result["updates_per_second"] / 1e3
            peak = next((v for k, v in BF16_PEAK_TFLOPS.items() if k in result["device"]), None)
            result["tflops"] = round(achieved, 1)
            if peak:
                result["fraction_of_bf16_peak"] = round(achieved / peak, 3)
    return result


def _image_shape(text: str) -> tuple[int, int, int]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected C,H,W (three positive integers, e.g. 1,96,96), got {text!r}")
    return shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="size1m")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--obs", choices=["vector", "image"], default="vector")
    parser.add_argument("--obs-dim", type=int, default=24)
    parser.add_argument("--actions", type=int, default=6)
    parser.add_argument("--image", type=_image_shape, default=(3, 64, 64), metavar="C,H,W",
                        help="the image observation's shape with --obs image (default 3,64,64; Atari: 1,96,96)")
    parser.add_argument("--cnn-full-res", action="store_true",
                        help="with --obs image: model.cnn_full_res, the model's multipliers after a 1 (size12m: "
                             "1,2,3,4,4, the reference's CNNs at 2411f7d)")
    parser.add_argument("--variant", default="both",
                        help="ours | ours_cl | ours_autotune | ours_fuse | ours_copt | ours_graph | torchrl | torchrl_step | "
                             "torchrl_scan | both (default) | all, or a comma-separated list of variants")
    parser.add_argument("--warm-cache", action="store_true",
                        help="reuse the compiler caches (default: each variant compiles from an empty cache)")
    parser.add_argument("--updates", type=int, default=30, help="timed updates (median)")
    parser.add_argument("--profile", type=int, default=5, help="profiled updates")
    parser.add_argument("--kernel-tables", metavar="DIR",
                        help="write each variant's profiled kernels (name, launches and us per update) to DIR")
    parser.add_argument("--limit", type=float, default=540, help="seconds per variant, warm-up included")
    parser.add_argument("--train-ratio", type=float, default=16, help="for the implied env steps/s")
    parser.add_argument("--no-flops", dest="flops", action="store_false")
    parser.add_argument("--cudnn-benchmark", action="store_true",
                        help="let cuDNN time its convolution algorithms during warm-up (every variant)")
    parser.add_argument("--parallel", action="store_true",
                        help="run torchrl's variants side by side, after the others (each keeps its --limit)")
    parser.add_argument("--out", help="also append the JSON lines to this file")
    parser.add_argument("--single", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.single:
        print(json.dumps(run_single(args)), flush=True)
        return
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("error: --device cuda but no CUDA device is visible; use --device cpu")
    torchrl = ["torchrl_step", "torchrl_scan"] if cuda else ["torchrl_eager"]
    ours = ["ours", "ours_cl", "ours_autotune", "ours_fuse", "ours_copt", "ours_graph"] if cuda else ["ours"]
    groups = {"ours": ["ours"], "torchrl": torchrl, "both": ["ours"] + torchrl, "all": ours + torchrl}
    variants = [v for name in args.variant.split(",") for v in groups.get(name, [name])]
    # Ctrl-C or a SIGTERM (an outer `timeout`) stops the variants still running, in their own sessions.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"bench_learner: terminated; stopped {len(_RUNNING)} variant(s)"))
    try:
        _run_variants(args, variants, torchrl)
    finally:
        for process in list(_RUNNING):
            _stop(process)


def _run_variants(args, variants: list[str], torchrl: list[str]) -> None:
    results = []
    side_by_side = [v for v in variants if v in torchrl] if args.parallel else []
    for variant in [v for v in variants if v not in side_by_side]:
        results.append(_finish(variant, _launch(variant, args), args))
        _emit(results[-1], args.out)
    running = [(variant, _launch(variant, args)) for variant in side_by_side]
    finished = [_finish(variant, launched, args) for variant, launched in running]
    spans = {r["variant"]: r["measured_span"] for r in finished if "measured_span" in r}
    for result in finished:
        if result["variant"] in spans:  # timed phases that shared the GPU would not be comparable
            mine = spans[result["variant"]]
            result["overlapped_with"] = [v for v, span in spans.items()
                                         if v != result["variant"] and span[0] < mine[1] and mine[0] < span[1]]
        results.append(result)
        _emit(result, args.out)
    ok = {r["variant"]: r for r in results if "updates_per_second" in r}
    baseline = max((ok[v] for v in torchrl if v in ok), key=lambda r: r["updates_per_second"], default=None)
    for name in ("ours", "ours_cl", "ours_autotune", "ours_fuse", "ours_copt", "ours_graph"):
        if name in ok and baseline:
            _emit({"ratio": f"{name}/torchrl", "baseline": baseline["variant"],
                   "speedup": round(ok[name]["updates_per_second"] / baseline["updates_per_second"], 2)}, args.out)


def _launch(variant: str, args) -> tuple:
    """Starts one variant in a process of its own (output to files, so side-by-side runs never block on a
    full pipe), with empty compiler caches unless --warm-cache."""
    command = [sys.executable, __file__, *sys.argv[1:], "--single", variant]
    env = {**os.environ, "EXCLUDE_TD_FROM_PYTREE": "1"}
    cache = tempfile.TemporaryDirectory(prefix=f"bench-{variant}-")
    if not args.warm_cache:  # a cold compile, as on a fresh machine
        env.update(TORCHINDUCTOR_CACHE_DIR=f"{cache.name}/inductor", TRITON_CACHE_DIR=f"{cache.name}/triton")
    with open(f"{cache.name}/stdout", "w") as stdout, open(f"{cache.name}/stderr", "w") as stderr:
        # A session of its own: a variant that runs out of time is stopped with the compiler's worker
        # processes it started, which would otherwise go on compiling beside the next variant.
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True, env=env, start_new_session=True)
    _RUNNING.add(process)
    return process, cache, time.perf_counter()


_RUNNING: set[subprocess.Popen] = set()


def _stop(process: subprocess.Popen) -> None:
    """Kills a variant's whole process group (it, and the compile workers it started)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
    _RUNNING.discard(process)


def _finish(variant: str, launched: tuple, args) -> dict:
    """Waits for a launched variant up to --limit from its start: its JSON line, or what stopped it."""
    process, cache, start = launched
    with cache:
        try:
            process.wait(timeout=max(0.0, args.limit - (time.perf_counter() - start)))
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        _stop(process)  # also the compile workers of a variant that finished
        stdout = Path(cache.name, "stdout").read_text()
        stderr = Path(cache.name, "stderr").read_text()
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if timed_out:
        result = {"variant": variant, "error": f"did not finish warm-up and measurement within {args.limit:.0f} s"}
        reached = [line for line in stderr.splitlines() if line.startswith("warm-up: ")]
        if reached:  # where the time went: the compiled pieces and the capture that finished
            result["warmup_progress"] = [line[len("warm-up: "):] for line in reached]
    elif process.returncode or not lines:
        output = (stderr or stdout).strip().splitlines()
        result = {"variant": variant, "error": f"exit {process.returncode}: {' | '.join(output[-3:])}"}
        # the failure's traceback, which the JSON line's last lines seldom hold (inductor's errors end in hints)
        print(f"{variant} failed; the last 60 lines of its output:", *output[-60:], sep="\n", file=sys.stderr)
    else:
        result = json.loads(lines[-1])
    result["seconds"] = round(time.perf_counter() - start, 1)
    if "updates_per_second" in result:
        result["env_steps_per_second_at_train_ratio"] = round(
            result["updates_per_second"] * args.batch * args.length / args.train_ratio)
    return result


def _emit(record: dict, out: str | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
