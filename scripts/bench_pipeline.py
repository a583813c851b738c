"""Collection and training together: env workers, the inference server, replay and the learner, measured.

    python scripts/bench_pipeline.py --device cuda --model size50m --batch 32 --length 256 --envs 64 --latency 0.05
    python scripts/bench_pipeline.py --device cpu --model smoke --batch 4 --length 8 --envs 4 --seconds 5   # CI smoke

One run of the training command's own pieces for `run.collect=workers`, built from its config
(`+exp=emulated` with the options below): `dreamer.pipeline.WorkerSource` (worker processes, the
inference server, the ingest thread), `dreamer.pipeline.Updates` (the owed updates: sample, update,
write-back, weight sync), `dreamer.replay.Replay` and `dreamer.learner.Learner`; in four phases, one
JSON line each:

  collect   (a) collection alone: env steps/s with the learner idle (replay filling). Env steps/s count
            the steps the workers took in the window (a shared counter per worker); received_env_steps_per_s
            counts the steps of the chunks that arrived, which moves in whole chunks (64 steps per
            worker) and is coarse over a short window. worker_step_ms: where a worker's step went, ms
            per env step (policy: the server's round trip; env: the env's own calls; own: the
            collector's work around them; between: the loop outside the step, chunk sending included).
  train     (b) env steps/s while the learner trains at --train-ratio (Updates, as in training);
            (c) learner updates/s and its GPU busy fraction (the learner's own CUDA-event spans around
            its steps, over the phase's wall time); host_fraction: the trainer thread's wall time by
            part (wait = until records arrive, then Updates' sample / update / write_back / sync);
            ingest_fraction: the ingest thread's time reading chunks and adding them to replay.
  inference (e) the server's batched pass during the train phase: p50 / p99 ms over its recent
            batches (host to device and back), mean batch size; inference_alone: the same over the
            collect phase, the learner idle.
  overhead  (d) the learner's update as training runs it (Updates.one) against the same update on a
            batch resident on the device, in blocks of back-to-back updates (the steady state of
            training); collection keeps running in both. overhead: wall time of whole blocks, drained
            at both ends; steady_overhead: the median interval between the ends of consecutive updates
            inside the blocks (a block's start, where the first batch is fetched with the device idle,
            and its final drain are left out: training has neither).

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
from torchrl.trainers.algorithms import DreamerV3UpdateRatio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dreamer.agent import EnvLayout, build_agent  # noqa: E402
from dreamer.config import compose_config, validate  # noqa: E402
from dreamer.envs import make_env  # noqa: E402
from dreamer.inference import percentile  # noqa: E402
from dreamer.learner import Learner  # noqa: E402
from dreamer.pipeline import Updates, WorkerSource  # noqa: E402
from dreamer.replay import Replay  # noqa: E402


def app_config(args):
    """The training command's config for `+exp=emulated` with this benchmark's settings."""
    model = ["+debug=smoke"] if args.model == "smoke" else [f"model={args.model}"]
    device = args.device
    overrides = ["+exp=emulated", *model, f"batch_size={args.batch}", f"batch_length={args.length}",
                 f"run.envs={args.envs}", f"env.step_latency={args.latency}", f"run.train_ratio={args.train_ratio}",
                 f"run.chunk={args.chunk}", f"run.sync_every={args.sync_every}",
                 f"run.inference_wait_ms={args.inference_wait_ms}", f"run.inference={args.inference}",
                 f"replay.size={args.replay}", "run.compile=false" if args.no_compile else "run.compile=auto",
                 f"topology.learner={device}", f"topology.inference={args.inference_device or device}",
                 "run.dir=."]
    return compose_config(overrides)


class Pipeline:
    """The training command's pieces for `run.collect=workers`, built from its config (app_config)."""

    def __init__(self, args):
        self.args = args
        self.cfg = app_config(args)
        self.settings = validate(self.cfg)
        self.device = self.settings.topology.learner
        self.cuda = self.device.type == "cuda"
        probe = make_env(self.cfg.env, 0)
        self.layout = EnvLayout.from_specs(probe.observation_spec, probe.action_spec)
        probe.close()
        self.size = self.settings.size
        torch.manual_seed(0)
        with torch.device(self.device):
            self.agent = build_agent(self.layout, self.size, self.settings.acting_bf16)
        self.learner = Learner(self.agent, self.settings.loss, self.settings.optimizer, self.device,
                               self.settings.compile, self.settings.cudagraph, self.settings.bf16,
                               fuse_kernels=self.settings.fuse_kernels, state_bf16=self.settings.state_bf16)
        self.replay = Replay(args.envs, args.replay, args.batch, args.length, self.device, prefetch=args.prefetch)
        self.steps = 0
        self.wait = 0.0  # the trainer thread's seconds waiting for records
        self.source: WorkerSource | None = None

    def warmup(self) -> float:
        start = time.perf_counter()
        if self.learner.needs_warmup:
            self.learner.warmup(self.learner.synthetic_batch(self.args.batch, self.args.length))
        return time.perf_counter() - start

    def start_collection(self) -> None:
        self.source = WorkerSource(self.cfg, self.agent.policy, self.layout, self.size,
                                   self.settings.topology.inference, self.settings.cudagraph, self.replay,
                                   announce=None)
        self.source.start()
        self.own_process = self.source.inference.process is not None
        self.pool, self.inference, self.ingest = self.source.pool, self.source.inference, self.source.ingest
        self.counters = {"env_steps": 0, "train_steps": 0, "episodes": 0, "owed_updates": 0}
        self.updates = Updates(self.learner, self.replay, DreamerV3UpdateRatio(self.settings.updates_per_step),
                               self.source, self.counters, train_start=0)

    def gather(self, timeout: float) -> int:
        """The records that arrived (the ingest thread added them to replay), as the training loop takes them."""
        clock = time.perf_counter()
        steps = self.source.gather(timeout)[0]
        self.wait += time.perf_counter() - clock
        self.steps += steps
        self.counters["env_steps"] += steps
        return steps

    def update_resident(self, resident) -> tuple:
        """One update on a batch already on the device (no replay), timed by CUDA events (host seconds on
        CPU): the reference of phase (d)."""
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            self.learner.update(resident)
            end.record()
            return begin, end
        start = time.perf_counter()
        self.learner.update(resident)
        return (time.perf_counter() - start,)

    def update_replay(self) -> tuple:
        """One update as training runs it (`Updates.one`: sample, update, write-back, weight sync), its
        end marked by a CUDA event (host time on CPU)."""
        if self.cuda:
            self.updates.one()
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            return None, end
        start = time.perf_counter()
        self.updates.one()
        return (time.perf_counter() - start,)

    @staticmethod
    def seconds(timing: tuple) -> float:
        return timing[0] if len(timing) == 1 else timing[0].elapsed_time(timing[1]) / 1e3

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
        self.replay.close()


def phase_collect(p: Pipeline, seconds: float) -> dict:
    """(a) until replay can be sampled and at least `seconds`; the rate over the last `seconds`."""
    while not p.replay.ready(every=True):
        p.gather(1.0)
    p.source.stats()  # the step-time figures below start here
    start, steps, stepped = time.perf_counter(), 0, sum(p.pool.stepped)
    while time.perf_counter() - start < seconds:
        steps += p.gather(0.5)
    wall, stepped = time.perf_counter() - start, sum(p.pool.stepped) - stepped
    return {"phase": "collect", "env_steps_per_s": round(stepped / wall, 1),
            "received_env_steps_per_s": round(steps / wall, 1), "seconds": round(wall, 1),
            "replay_records": len(p.replay), **_step_times(p)}


def _step_times(p: Pipeline) -> dict:
    """Where a worker's step went over the phase (WorkerPool.timing): ms per env step."""
    times = p.source.times.since(*p.pool.timing())
    return {"worker_step_ms": {key.split("/")[1]: round(value, 2) for key, value in times.items()}}


def phase_train(p: Pipeline, seconds: float) -> dict:
    """(b), (c): the updates the ratio owes (Updates, as the training loop runs them)."""
    updates_before, p.wait = p.learner.updates, 0.0
    p.updates.seconds = dict.fromkeys(p.updates.seconds, 0.0)
    p.learner.busy_seconds()
    p.source.stats()
    read, added = p.pool.read_seconds, p.ingest.add_seconds
    start, stepped = time.perf_counter(), sum(p.pool.stepped)
    syncs = p.inference.sync.applied
    while time.perf_counter() - start < seconds:
        arrived = p.gather(0.0 if p.counters["owed_updates"] else 0.5)
        p.updates.owe(arrived)
        p.updates.run(stop=lambda: time.perf_counter() - start >= seconds)
    if p.cuda:
        torch.cuda.synchronize()
    wall, stepped = time.perf_counter() - start, sum(p.pool.stepped) - stepped
    updates = p.learner.updates - updates_before
    host = {"wait": p.wait, **p.updates.seconds}
    return {"phase": "train", "env_steps_per_s": round(stepped / wall, 1),
            "updates": updates, "updates_per_s": round(updates / wall, 2),
            "learner_busy": round(p.learner.busy_seconds() / wall, 3),
            "owed_at_end": p.counters["owed_updates"], "weight_syncs": p.inference.sync.applied - syncs,
            "seconds": round(wall, 1),
            # where the trainer thread's wall time went (the rest: the loop itself)
            "host_fraction": {part: round(value / wall, 3) for part, value in host.items()},
            # the ingest thread's time reading chunks and adding them to replay
            "ingest_fraction": {"receive": round((p.pool.read_seconds - read) / wall, 3),
                                "add_chunks": round((p.ingest.add_seconds - added) / wall, 3)},
            "lost_contexts": p.replay.lost_contexts, **_step_times(p)}


def phase_overhead(p: Pipeline, updates: int, block: int = 5) -> dict:
    """(d) update time as training runs it (sampling, write-back, weight sync) vs a resident batch: blocks
    of `block` back-to-back updates (the steady state of training: the next sample and the last
    write-back's copies overlap the learner's work), the device drained at each block's ends only;
    alternating blocks, medians of the per-update time of a block."""
    resident = p.replay.sample()[0][:, :-1].to(p.device)
    with_replay, alone = [], []
    steady = {True: [], False: []}  # end-to-end intervals between consecutive updates of a block
    for index in range(2 * max(1, updates // block)):
        replayed = index % 2 == 0
        p.gather(0.0)  # collection keeps running
        if p.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        ends = []
        for _ in range(block):
            timing = p.update_replay() if replayed else p.update_resident(resident)
            ends.append(timing[1] if p.cuda else time.perf_counter())
        if p.cuda:
            torch.cuda.synchronize()
        (with_replay if replayed else alone).append((time.perf_counter() - start) / block)
        steady[replayed] += [
            (ends[i - 1].elapsed_time(ends[i]) / 1e3 if p.cuda else ends[i] - ends[i - 1]) for i in range(1, block)]
    a, b = statistics.median(with_replay), statistics.median(alone)
    sa, sb = statistics.median(steady[True]), statistics.median(steady[False])
    return {"phase": "overhead", "ms_with_replay": round(a * 1e3, 2), "ms_resident": round(b * 1e3, 2),
            "overhead": round(a / b - 1, 4),
            # the same blocks, without their ends: the median interval between the ends of consecutive
            # updates (a gap the learner waits for its batch shows here; a block's start and drain do not)
            "steady_ms_with_replay": round(sa * 1e3, 2), "steady_ms_resident": round(sb * 1e3, 2),
            "steady_overhead": round(sa / sb - 1, 4), "updates": block * (len(with_replay) + len(alone))}


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
    parser.add_argument("--inference-wait-ms", type=float, default=0.0, help="run.inference_wait_ms")
    parser.add_argument("--inference", choices=["auto", "thread", "process"], default="auto",
                        help="the server in its own process or a thread of this one (auto: as run.inference)")
    parser.add_argument("--threads", type=int, default=0,
                        help="the trainer process's torch intra-op threads (0: torch's default, one per core; "
                             "run.threads); env workers use one each")
    parser.add_argument("--switch-interval-ms", type=float,
                        help="the trainer process's interpreter switch interval (sys.setswitchinterval; Python's "
                             "default is 5 ms): how long a thread that wants the GIL may wait for another")
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
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    p = Pipeline(args)
    config = {"model": args.model, "batch": args.batch, "length": args.length, "envs": args.envs,
              "latency": args.latency, "train_ratio": args.train_ratio, "device": args.device,
              "inference": args.inference, "switch_interval_ms": sys.getswitchinterval() * 1000,
              "inference_wait_ms": args.inference_wait_ms,
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
