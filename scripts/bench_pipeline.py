"""Collection and training together: env workers, the inference server, replay and the learner, measured.

    python scripts/bench_pipeline.py --device cuda --model size50m --batch 32 --length 256 --envs 64 --latency 0.05
    python scripts/bench_pipeline.py --device cpu --model smoke --batch 4 --length 8 --envs 4 --seconds 5   # CI smoke

One run, the pieces `python -m dreamer.train run.collect=workers` uses (emulated Minecraft env with
`--latency` s per step, `dreamer.collect.WorkerPool`, `dreamer.inference.Inference`, `dreamer.replay.Replay`,
`dreamer.learner.Learner`), in four phases, one JSON line each:

  collect   (a) collection alone: env steps/s with the learner idle (replay filling). Env steps/s count
            the steps the workers took in the window (a shared counter per worker); received_env_steps_per_s
            counts the steps of the chunks that arrived, which moves in whole chunks (64 steps per
            worker) and is coarse over a short window.
  train     (b) env steps/s while the learner trains at --train-ratio (updates owed by the ratio, as in
            training); (c) learner updates/s and its GPU busy fraction (CUDA-event time around each
            learner step, summed, over the phase's wall time); weight syncs every --sync-every updates;
            host_fraction: the trainer thread's wall time by part (wait = idle until a worker chunk
            arrives, receive = reading and unpickling chunks, add_chunks, sample, update = the learner's
            host call, write_back = submission); with --ingest thread (the default, as in training) the
            chunks are read and added in the ingest thread, whose time is ingest_fraction.
  inference (e) the server's batched pass during the train phase: p50 / p99 ms over its recent
            batches (host to device and back), mean batch size; inference_alone: the same over the
            collect phase, the learner idle.
  overhead  (d) the learner's update time with replay sampling and the write-back submitted, against the
            same update on a batch resident on the device, in blocks of back-to-back updates (the steady
            state of training); collection keeps running in both. overhead: wall time of whole blocks,
            drained at both ends; steady_overhead: the median interval between the ends of consecutive
            updates inside the blocks (a block's start, where the first batch is fetched with the device
            idle, and its final drain are left out: training has neither).

With `--rounds N` the collect and train phases alternate N times (one line per phase, with its round);
(b)/(a) is then over all rounds, so that a drift of the collection rate over the run (the machine's other
load, replay growing) weighs on both sides alike. A last line holds the ratios (b)/(a) and (d). Learner
warm-up (compile, capture) comes first and is reported, not timed in any phase.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dreamer.agent import EnvLayout, LossSettings, ModelSize, build_agent  # noqa: E402
from dreamer.collect import Ingest, WorkerPool  # noqa: E402
from dreamer.config import CONFIG_DIR  # noqa: E402
from dreamer.envs import make_env  # noqa: E402
from dreamer.inference import Inference, percentile  # noqa: E402
from dreamer.learner import Learner, OptimizerSettings  # noqa: E402
from dreamer.replay import Replay  # noqa: E402


def _size(name: str) -> ModelSize:
    path = CONFIG_DIR / "model" / f"{name}.yaml"
    if not path.exists():  # the smoke preset's tiny model
        model = yaml.safe_load((CONFIG_DIR / "debug" / "smoke.yaml").read_text())["model"]
    else:
        model = yaml.safe_load(path.read_text())
    model.pop("name", None)
    return ModelSize(**model)


class Pipeline:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        env_cfg = OmegaConf.load(CONFIG_DIR / "env" / "emulated.yaml")
        env_cfg.step_latency = args.latency
        self.env_cfg = OmegaConf.to_container(env_cfg, resolve=True)
        probe = make_env(env_cfg, 0)
        self.layout = EnvLayout.from_specs(probe.observation_spec, probe.action_spec)
        probe.close()
        self.size = _size(args.model)
        torch.manual_seed(0)
        with torch.device(self.device):
            self.agent = build_agent(self.layout, self.size, LossSettings())
        self.learner = Learner(self.agent, OptimizerSettings(), self.device, compile=self.cuda and not args.no_compile,
                               cudagraph=self.cuda, bf16=self.cuda)
        self.replay = Replay(args.envs, args.replay, args.batch, args.length, self.device, prefetch=args.prefetch)
        self.steps = 0
        self.host = dict.fromkeys(HOST_PARTS, 0.0)  # the trainer thread's host seconds, by part
        self.ingest: Ingest | None = None

    def warmup(self) -> float:
        start = time.perf_counter()
        if self.learner.needs_warmup:
            self.learner.warmup(self.learner.synthetic_batch(self.args.batch, self.args.length))
        return time.perf_counter() - start

    def start_collection(self) -> None:
        args = self.args
        device = torch.device(args.inference_device or args.device)
        self.own_process = args.inference == "process" or (args.inference == "auto" and device.type == "cuda")
        self.inference = Inference(self.agent.policy, self.layout, self.size, args.envs, device,
                                   cudagraph=self.cuda, batch_wait=args.inference_wait_ms / 1000,
                                   process=self.own_process).start()

        def restarted(stream: int) -> None:
            self.inference.forget_slot(stream)
            self.replay.end_stream(stream)

        self.pool = WorkerPool(self.env_cfg, 0, self.layout, self.size, self.inference.clients, args.chunk,
                               "emulated", on_restart=restarted).start()
        if args.ingest == "thread":
            self.ingest = Ingest(self.pool, self.replay, alive=lambda: self.inference.alive,
                                 max_pending=args.envs * args.chunk).start()

    def gather(self, timeout: float) -> int:
        if self.ingest is not None:  # the chunks go to replay in the ingest thread, as in training
            clock = time.perf_counter()
            steps = self.ingest.take(timeout)[0]
            self.host["wait"] += time.perf_counter() - clock
            self.steps += steps
            return steps
        steps, clock, read = 0, time.perf_counter(), self.pool.read_seconds
        chunks = self.pool.receive(timeout)
        received = time.perf_counter()
        for chunk in chunks:
            self.replay.add_chunk(chunk.stream, chunk.records)
            steps += chunk.records.shape[0]
        self.host["add_chunks"] += time.perf_counter() - received
        read = self.pool.read_seconds - read
        self.host["receive"] += read
        self.host["wait"] += received - clock - read
        self.steps += steps
        return steps

    def update(self, resident=None, timed: bool = False):
        """One update, on a resident batch or on a replay sample with the write-back submitted.

        timed: also returns the update's own duration, as CUDA events recorded around the learner's
        step alone (sampling and the write-back's host work stay outside), or host seconds on CPU.
        The trainer thread's host seconds in sampling, the update call and the write-back submission
        are added to `self.host`.
        """
        clock = time.perf_counter()
        if resident is None:
            batch, handles = self.replay.sample()
            batch = batch[:, :-1]
        else:
            batch = resident
        now = time.perf_counter()
        self.host["sample"] += now - clock
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        start = time.perf_counter()
        out = self.learner.update(batch)
        if self.cuda:
            end.record()
            timing = (begin, end)
        else:
            timing = (time.perf_counter() - start,)
        clock = time.perf_counter()
        self.host["update"] += clock - start
        if resident is None:
            context = out.get("replay_context")
            self.replay.write_back(handles, context.get("state"), context.get("belief"), wait=False)
        self.host["write_back"] += time.perf_counter() - clock
        return timing if timed else None

    @staticmethod
    def seconds(timing: tuple) -> float:
        return timing[0] if len(timing) == 1 else timing[0].elapsed_time(timing[1]) / 1e3

    def close(self) -> None:
        if self.ingest is not None:
            self.ingest.close()
        self.pool.close()
        self.inference.close()
        self.replay.close()


HOST_PARTS = ("wait", "receive", "add_chunks", "sample", "update", "write_back")


def phase_collect(p: Pipeline, seconds: float) -> dict:
    """(a) until replay can be sampled and at least `seconds`; the rate over the last `seconds`."""
    while not p.replay.ready(every=True):
        p.gather(1.0)
    start, steps, stepped = time.perf_counter(), 0, sum(p.pool.stepped)
    while time.perf_counter() - start < seconds:
        steps += p.gather(0.5)
    wall, stepped = time.perf_counter() - start, sum(p.pool.stepped) - stepped
    return {"phase": "collect", "env_steps_per_s": round(stepped / wall, 1),
            "received_env_steps_per_s": round(steps / wall, 1), "seconds": round(wall, 1),
            "replay_records": len(p.replay)}


def phase_train(p: Pipeline, seconds: float) -> dict:
    """(b), (c): updates owed at train_ratio / (batch x length) per env step, as the training loop does."""
    args = p.args
    per_step = args.train_ratio / (args.batch * args.length)
    owed, steps, timings, syncs = 0.0, 0, [], 0
    p.host = dict.fromkeys(HOST_PARTS, 0.0)
    read, added = p.pool.read_seconds, p.ingest.add_seconds if p.ingest else 0.0
    start, stepped = time.perf_counter(), sum(p.pool.stepped)
    while time.perf_counter() - start < seconds:
        arrived = p.gather(0.0 if owed >= 1 else 0.5)
        steps += arrived
        owed += arrived * per_step
        while owed >= 1 and time.perf_counter() - start < seconds:
            owed -= 1
            timings.append(p.update(timed=True))
            if p.learner.updates % args.sync_every == 0:
                syncs += bool(p.inference.sync())
    if p.cuda:
        torch.cuda.synchronize()
    wall, stepped = time.perf_counter() - start, sum(p.pool.stepped) - stepped
    busy = sum(p.seconds(t) for t in timings)
    return {"phase": "train", "env_steps_per_s": round(stepped / wall, 1),
            "received_env_steps_per_s": round(steps / wall, 1), "updates": len(timings),
            "updates_per_s": round(len(timings) / wall, 2), "learner_busy": round(busy / wall, 3),
            "owed_at_end": round(owed, 1), "weight_syncs": syncs, "seconds": round(wall, 1),
            # where the trainer thread's wall time went (the rest: weight syncs and the loop itself)
            "host_fraction": {part: round(value / wall, 3) for part, value in p.host.items()},
            # --ingest thread: the ingest thread's time reading chunks and adding them to replay
            **({"ingest_fraction": {"receive": round((p.pool.read_seconds - read) / wall, 3),
                                    "add_chunks": round((p.ingest.add_seconds - added) / wall, 3)}}
               if p.ingest else {}),
            "lost_contexts": p.replay.lost_contexts}


def phase_overhead(p: Pipeline, updates: int, block: int = 5) -> dict:
    """(d) update time with sampling + write-back vs a resident batch: blocks of `block` back-to-back
    updates (the steady state of training: the next sample and the last write-back's copies overlap the
    learner's work), the device drained at each block's ends only; alternating blocks, medians of the
    per-update time of a block."""
    resident = p.replay.sample()[0][:, :-1].to(p.device)
    with_replay, alone = [], []
    steady = {True: [], False: []}  # end-to-end intervals between consecutive updates of a block
    host = dict.fromkeys(("sample", "update", "write_back"), 0.0)  # trainer thread, blocks with replay
    for index in range(2 * max(1, updates // block)):
        target = with_replay if index % 2 == 0 else alone
        p.gather(0.0)  # collection keeps running
        if p.cuda:
            torch.cuda.synchronize()
        before = dict(p.host)
        start = time.perf_counter()
        ends = []
        for _ in range(block):
            timing = p.update(None if target is with_replay else resident, timed=True)
            ends.append(timing[1] if p.cuda else time.perf_counter())
        if p.cuda:
            torch.cuda.synchronize()
        target.append((time.perf_counter() - start) / block)
        steady[target is with_replay] += [
            (ends[i - 1].elapsed_time(ends[i]) / 1e3 if p.cuda else ends[i] - ends[i - 1]) for i in range(1, block)]
        if target is with_replay:
            for part in host:
                host[part] += p.host[part] - before[part]
    a, b = statistics.median(with_replay), statistics.median(alone)
    sa, sb = statistics.median(steady[True]), statistics.median(steady[False])
    per_update = block * len(with_replay)
    return {"phase": "overhead", "ms_with_replay": round(a * 1e3, 2), "ms_resident": round(b * 1e3, 2),
            "overhead": round(a / b - 1, 4),
            # the same blocks, without their ends: the median interval between the ends of consecutive
            # updates (a gap the learner waits for its batch shows here; a block's start and drain do not)
            "steady_ms_with_replay": round(sa * 1e3, 2), "steady_ms_resident": round(sb * 1e3, 2),
            "steady_overhead": round(sa / sb - 1, 4), "updates": block * (len(with_replay) + len(alone)),
            # the trainer thread's host ms per update with replay: sample() includes waiting for the prefetch
            "host_ms_per_update": {part: round(value / per_update * 1e3, 2) for part, value in host.items()}}


def phase_inference(p: Pipeline) -> dict:
    stats, forward = p.inference.snapshot()
    return {"phase": "inference", "p50_ms": round(percentile(forward, 0.5), 3),
            "p99_ms": round(percentile(forward, 0.99), 3), "batches": len(forward),
            "mean_batch": round(stats["avg_batch_size"], 1), "device": str(p.inference.device)}


def _py_spy(path: str) -> subprocess.Popen:
    """py-spy recording this process (all threads, idle ones included) into `path`, as collapsed stacks."""
    command = ["py-spy", "record", "--pid", str(os.getpid()), "--threads", "--idle", "--rate", "100",
               "--format", "raw", "--output", path]
    try:
        spy = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except FileNotFoundError:
        sys.exit("--py-spy needs the py-spy command on PATH: pip install py-spy")
    time.sleep(2.0)  # attached before the phase starts
    return spy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--inference-device", help="default: --device (learner and server share it)")
    parser.add_argument("--model", default="size50m")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--envs", type=int, default=64)
    parser.add_argument("--latency", type=float, default=0.05, help="emulated seconds per env step")
    parser.add_argument("--train-ratio", type=float, default=16)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--inference-wait-ms", type=float, default=2.0)
    parser.add_argument("--inference", choices=["auto", "thread", "process"], default="auto",
                        help="the server in its own process or a thread of this one (auto: as run.inference)")
    parser.add_argument("--serving-graph", choices=["ours", "torchrl"], default="ours",
                        help="the server's CUDA graph: ours (replayed on the serving stream alone) or torchrl's "
                             "(tensordict's CudaGraphModule: a device-wide synchronize before every replay)")
    parser.add_argument("--ingest", choices=["thread", "inline"], default="thread",
                        help="worker chunks into replay: in an ingest thread, as training does, or inline in "
                             "the trainer thread between updates")
    parser.add_argument("--threads", type=int, default=0,
                        help="the trainer process's torch intra-op threads (0: torch's default, one per core; "
                             "run.threads); env workers use one each")
    parser.add_argument("--replay", type=int, default=400_000, help="replay capacity (records)")
    parser.add_argument("--prefetch", type=int, help="replay samples prepared ahead (default: 1 on CUDA, 0 on CPU)")
    parser.add_argument("--py-spy", metavar="FILE",
                        help="record every thread's stacks during phase (d) with py-spy (collapsed stacks)")
    parser.add_argument("--seconds", type=float, default=30, help="length of the collect and train phases")
    parser.add_argument("--rounds", type=int, default=1,
                        help="collect and train phases alternate this many times; (b)/(a) is over all of them")
    parser.add_argument("--overhead-updates", type=int, default=30)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--out", help="also append the JSON lines to this file")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    # `kill -USR1 <pid>` (or `timeout -s USR1`) prints every thread's stack: where a stuck phase waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    def emit(record: dict) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.serving_graph == "torchrl":
        from torchrl.modules.inference_server import InferenceServer

        from dreamer import inference
        inference._StreamServer.prepare_cudagraph = InferenceServer.prepare_cudagraph
    p = Pipeline(args)
    config = {"model": args.model, "batch": args.batch, "length": args.length, "envs": args.envs,
              "latency": args.latency, "train_ratio": args.train_ratio, "device": args.device,
              "inference": args.inference, "serving_graph": args.serving_graph, "ingest": args.ingest,
              "threads": torch.get_num_threads(),
              "gpu": torch.cuda.get_device_name(p.device) if p.cuda else "cpu",
              "ceiling_env_steps_per_s": round(args.envs / args.latency, 1) if args.latency else None}
    emit({"phase": "warmup", **config, "warmup_seconds": round(p.warmup(), 1)})

    def watched(phase, *phase_args):
        """A phase that runs far past its length prints every thread's stack (a device hang shows there)."""
        faulthandler.dump_traceback_later(3 * args.seconds + 120)
        try:
            return phase(*phase_args)
        finally:
            faulthandler.cancel_dump_traceback_later()

    p.start_collection()
    service = "process" if p.own_process else "thread"
    try:
        collected, trained = [], []
        for round_ in range(args.rounds):  # collect, train, collect, train, ...: a drift hits both alike
            a = watched(phase_collect, p, args.seconds)
            collected.append(a["env_steps_per_s"])
            emit({**a, "round": round_} if args.rounds > 1 else a)
            if round_ == args.rounds - 1:  # the passes of the collect phase: the server beside an idle learner
                emit({**phase_inference(p), "phase": "inference_alone", "service": service})
            b = watched(phase_train, p, args.seconds)
            trained.append(b["env_steps_per_s"])
            emit({**b, "round": round_} if args.rounds > 1 else b)
        # The passes of the last train phase: the server beside a learner that trains at the ratio.
        emit({**phase_inference(p), "service": service})
        spy = _py_spy(args.py_spy) if args.py_spy else None
        try:
            d = watched(phase_overhead, p, args.overhead_updates)
        finally:
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                spy.wait(timeout=60)
        emit(d)
        # (b)/(a) over all rounds (phases of equal length: the ratio of the summed rates)
        ratio = round(sum(trained) / sum(collected), 4) if sum(collected) else None
        by_round = [round(t / c, 4) if c else None for t, c in zip(trained, collected)]
        emit({"phase": "ratios", "train_over_collect": ratio,
              **({"train_over_collect_by_round": by_round} if args.rounds > 1 else {}),
              "write_back_and_sampling_overhead": d["overhead"],
              "steady_write_back_and_sampling_overhead": d["steady_overhead"], "worker_restarts": p.pool.restarts})
    finally:
        p.close()


if __name__ == "__main__":
    main()
