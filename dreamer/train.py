"""`python -m dreamer.train [+exp=NAME] [key=value ...]`: train DreamerV3; rerun the same command to resume."""

from __future__ import annotations

import logging
import os
import random
import sys
import time
import traceback
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torchrl.trainers.algorithms import DreamerV3UpdateRatio

from dreamer import checkpoint
from dreamer.agent import EnvLayout, build_agent, image_size_problem
from dreamer.collect import CollectionError
from dreamer.config import (ConfigError, check_composes, check_overrides, compose_config, describe, set_cudnn,
                            set_threads, validate)
from dreamer.envs import frames_per_step, make_env
from dreamer.evaluate import (evaluate, make_evaluator, missing_video_support, run_with_frames, summarize,
                              write_videos)
from dreamer.inference import request_spec
from dreamer.learner import Learner
from dreamer.metrics import Metrics, read_records, run_summary, summarize_episodes
from dreamer.pipeline import Updates, make_source
from dreamer.replay import Replay, available_memory, record_bytes

EVAL_SEED_OFFSET = 1_000_000  # evaluation envs never share a seed with training envs


class Every:
    """Named schedule predicate: true each time `step` crosses a multiple of `period` (0 = never)."""

    def __init__(self, period: int, step: int = 0):
        self.period, self.last = period, (step // period if period else 0)

    def __call__(self, step: int) -> bool:
        if not self.period or step // self.period == self.last:
            return False
        self.last = step // self.period
        return True


@hydra.main(config_path="../configs", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    if line := _sweep_line():
        print(line, flush=True)
    try:
        train(cfg)
    except (ConfigError, checkpoint.CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except RunError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(3)


class RunError(RuntimeError):
    """The run cannot go on after it started (a checkpoint has been saved); one line for the user."""


def warm_up(learner: Learner, batch) -> float:
    """`learner.warmup(batch)`; a compiled step that fails there (a compiler error, such as inductor's stride
    check) ends the run with its traceback and one line saying how to train without compiling."""
    try:
        return learner.warmup(batch)
    except Exception as error:
        if not learner.compile:
            raise
        traceback.print_exc()
        lines = str(error).strip().splitlines()
        raise RunError(f"the compiled learner step failed in its warm-up ({type(error).__name__}: "
                       f"{lines[0] if lines else 'no message'}); run.compile=false trains without compiling "
                       f"(slower steps); the traceback above says where it failed") from None


def train(cfg: DictConfig) -> None:
    run_dir = Path(cfg.run.dir)
    # Hydra creates the run folder before this runs: a start that fails leaves no empty folder behind.
    fresh_folder = run_dir.is_dir() and not any(run_dir.iterdir())
    try:
        _train(cfg, run_dir)
    except (ConfigError, checkpoint.CheckpointError):
        if fresh_folder and run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()
        raise


def make_replay(cfg: DictConfig, layout: EnvLayout, settings, run_dir: Path) -> Replay:
    """The replay of `replay.size` records, after checking that it fits where it is kept (one line with
    what would fit if it does not); prints what it takes."""
    storage = cfg.replay.storage  # memory or disk (checked by validate)
    per_record = record_bytes(request_spec(layout, settings.size))
    capacity = cfg.replay.size // cfg.run.envs
    records = capacity * cfg.run.envs
    need = per_record * records
    directory = run_dir / "replay-mmap" if storage == "disk" else None
    if directory is not None:
        probe = run_dir
        have, where = os.statvfs(probe).f_bavail * os.statvfs(probe).f_frsize, f"disk space in {probe}"
    else:
        have, where = available_memory(), "host memory"
    if need > 0.9 * have:  # the rest of the run needs memory too
        fits = int(0.9 * have // per_record)
        hint = "" if storage == "disk" else ", or keep it on disk with replay.storage=disk"
        raise ConfigError(
            f"replay.size={cfg.replay.size:,} needs {need / 1e9:,.1f} GB of {where} ({per_record:,} bytes per "
            f"record) and {have / 1e9:,.1f} GB are available; lower replay.size to at most {fits:,}{hint}")
    amount = f"{need / 1e9:,.2f} GB" if need >= 1e9 else f"{need / 1e6:,.1f} MB"
    print(f"dreamer: replay of {records:,} records x {per_record:,} bytes = {amount} in "
          f"{'memory-mapped files' if directory else 'host memory'}", flush=True)
    return Replay(cfg.run.envs, cfg.replay.size, cfg.batch_size, cfg.batch_length, settings.topology.learner,
                  seed=cfg.seed, directory=directory, online=cfg.replay.online)


def _sweep_line() -> str | None:
    """For a sweep's first job: where the sweep's jobs go and how a rerun resumes them (a sweep folder named
    by the time would otherwise be a new one at each rerun)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN or hydra_cfg.job.get("num", 0) != 0:
        return None
    folder = hydra_cfg.sweep.dir
    return (f"dreamer: sweep folder {folder} (a run folder per job); the same command with "
            f"hydra.sweep.dir={folder} resumes its jobs")


def _preset() -> str | None:
    """The +exp preset of this run (None: the embedded default, or not started by Hydra)."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.choices.get("exp") if HydraConfig.initialized() else None


def _overrides() -> list[str] | None:
    """The command line's overrides (for scripts/summarize.py), when Hydra started this run."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None


def _finished(run_dir: Path, counters: dict, steps: int, eval_episodes: int) -> str | None:
    """The closing summary of a run that has already done everything asked of it; None if work is left."""
    if counters["env_steps"] < steps:
        return None
    if eval_episodes and not any(r["kind"] == "final_eval" for r in read_records(run_dir)):
        return None  # stopped during its final evaluation: run it
    return run_summary(run_dir, steps, "already finished (raise run.steps to train further)")


def _train(cfg: DictConfig, run_dir: Path) -> None:
    settings = validate(cfg)  # every check that needs no environment or model
    set_threads(cfg.run.threads, settings.topology.learner)
    config = OmegaConf.to_container(cfg, resolve=True)
    accepted = checkpoint.check_same_experiment(run_dir, config, bool(cfg.run.accept_changes))
    resumed = checkpoint.resume_state(run_dir, str(cfg.run.resume))
    if resumed and (line := _finished(run_dir, resumed[1]["counters"], cfg.run.steps, cfg.run.eval_episodes)):
        print(line, flush=True)
        return
    print(f"dreamer: run folder {run_dir}; {describe(settings)}", flush=True)
    device = settings.topology.learner
    torch.manual_seed(cfg.seed), np.random.seed(cfg.seed), random.seed(cfg.seed)

    eval_env = make_env(cfg.env, cfg.seed + EVAL_SEED_OFFSET)
    layout = EnvLayout.from_specs(eval_env.observation_spec, eval_env.action_spec)
    if settings.loss.actor_grad == "backprop" and layout.discrete:
        raise ConfigError(f"loss.actor_grad=backprop differentiates continuous actions, and {cfg.env.suite} "
                          f"{cfg.env.task}'s are discrete: use loss.actor_grad=reinforce")
    if settings.loss.actor_grad == "backprop" and settings.loss.two_hot == "symexp":
        print("dreamer: note: loss.actor_grad=backprop differentiates the reward head's and the critic's readings; "
              "through the symexp two-hot these are sums of terms up to 4.9e8 that cancel, and near initialization "
              "their gradient is mostly rounding: loss.two_hot=symlog (the earlier agent's heads) is its pairing",
              flush=True)
    if layout.image_shape is not None and (problem := image_size_problem(layout.image_shape, settings.size)):
        raise ConfigError(problem)
    replay = make_replay(cfg, layout, settings, run_dir)  # checks its memory first: before the model is built
    set_cudnn(settings)  # before the warm-up's first convolutions
    with torch.device(device):  # every parameter and buffer is created where it is used
        agent = build_agent(layout, settings.size, settings.acting_bf16)
    learner = Learner(agent, settings.loss, settings.optimizer, device, settings.compile, settings.cudagraph,
                      settings.bf16, progress=lambda line: print(f"dreamer: warm-up: {line}", flush=True),
                      fuse_kernels=settings.fuse_kernels, state_bf16=settings.state_bf16)
    checkpointer = checkpoint.Checkpointer(run_dir, cfg.run.keep_checkpoints, replay,
                                           progress=lambda line: print(f"dreamer: {line}", flush=True))
    # run.eval_envs at once (no more than an evaluation's episodes), seeded apart from each other
    evaluator = make_evaluator(cfg, eval_env, min(cfg.run.eval_envs, max(cfg.run.eval_episodes, 1)),
                               cfg.seed + EVAL_SEED_OFFSET, agent.policy, layout, settings.size, device)
    ratio = DreamerV3UpdateRatio(settings.updates_per_step)
    # train_steps and owed_updates: see dreamer.pipeline.Updates.
    # eval_owed: a stop cut the scheduled evaluation short; the resumed command runs it first.
    counters = {"env_steps": 0, "train_steps": 0, "episodes": 0, "owed_updates": 0, "eval_owed": 0}
    if resumed:
        path, state = resumed
        try:
            learner.load_state_dict(state["learner"])
        except (ValueError, KeyError, RuntimeError) as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise checkpoint.CheckpointError(
                f"{path} does not fit this run's model ({reason[:300]}); resume it with the settings it was "
                "trained with, or start another run.name") from None
        ratio.load_state_dict(state["ratio"])
        counters.update(state["counters"])
        checkpoint.set_rng_state(state["rng"])
        replay.generator.set_state(state["replay_rng"])
        restored = checkpointer.restore(state.get("replay"), path)
    # After the resumed weights are in: an inline source on CUDA acts with a copy of them.
    source = make_source(cfg, agent.policy, layout, settings.size, settings.topology, settings.cudagraph, replay,
                         settings.collect)
    # The start has succeeded: from here on the run folder is written.
    if accepted:
        print(f"dreamer: continuing {run_dir} with changed settings: {'; '.join(accepted)}", flush=True)
    checkpoint.write_config(run_dir, OmegaConf.to_yaml(cfg, resolve=True), _overrides())
    checkpoint.remove_leftovers(run_dir)
    if resumed:
        dropped = checkpoint.trim_metrics(run_dir, counters["env_steps"])
        print(f"dreamer: resumed from {path} at {counters['env_steps']:,} env steps with {restored:,} replay "
              f"records, {learner.updates:,} updates"
              + (f" ({dropped} metrics records newer than the checkpoint dropped)" if dropped else ""), flush=True)
    elif (run_dir / "metrics.jsonl").is_file():  # a run that never saved a checkpoint: its records are set aside
        (run_dir / "metrics.jsonl").rename(run_dir / f"metrics.{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    preset = _preset()
    print(f"dreamer: {f'preset {preset}: ' if preset else ''}{cfg.env.suite} {cfg.env.task}, {cfg.run.envs} envs: "
          f"{layout.describe()}; model "
          f"{cfg.model.name}{' (CNNs from full resolution)' if settings.size.cnn_full_res and layout.image_shape else ''}, "
          f"{agent.networks.parameter_count():,} parameters", flush=True)

    with_videos = bool(cfg.run.eval_video and layout.image_shape is not None and cfg.run.eval_episodes)
    if with_videos and (missing := missing_video_support()):  # found now, not at the first evaluation
        print(f"dreamer: warning: {missing}", flush=True)
        with_videos = False

    def stopped() -> bool:  # a SIGINT / SIGTERM also ends an evaluation early
        return bool(stop)

    def run_eval(kind: str) -> bool:
        """One evaluation of run.eval_episodes episodes, recorded; False (nothing recorded) when a stop
        cut it short: a partial mean is not the measure asked for, and the same command runs it again (a
        scheduled one first thing on resuming, at the checkpoint's step; a final one after the loop)."""
        source.settle()  # no step of the inline source runs beside the evaluation's
        episodes = cfg.run.eval_episodes
        print(f"dreamer: {'final ' if kind == 'final_eval' else ''}evaluation: {episodes} episode"
              f"{'s' if episodes > 1 else ''} at {counters['env_steps']:,} env steps...", flush=True)
        if with_videos:
            finished, frames, first = run_with_frames(evaluator, episodes, stopped)
            record = summarize(finished)
        else:
            record = evaluate(evaluator, episodes, stopped)
        if record["eval/episodes"] < episodes:
            print(f"dreamer: evaluation stopped by {stop.requested} after {record['eval/episodes']} of {episodes} "
                  "episodes: not recorded", flush=True)
            return False
        videos = write_videos(agent.networks, frames, first, run_dir / "eval",
                              f"{kind}-{counters['env_steps']:012d}") if with_videos else {}
        metrics.write(record, counters["env_steps"], learner.updates, kind=kind)
        metrics.media(videos, counters["env_steps"])
        return True

    def save(wait: bool = True) -> None:
        """A checkpoint now; `wait=False` lets it commit in the background while training goes on."""
        try:
            checkpointer.save(counters["env_steps"], {
                "learner": learner.state_dict(), "ratio": ratio.state_dict(), "counters": dict(counters),
                "rng": checkpoint.rng_state(), "replay_rng": replay.generator.get_state()}, wait=wait)
        except checkpoint.SaveError as error:
            raise RunError(str(error)) from None

    should_log = Every(cfg.run.log_every, counters["env_steps"])
    should_eval = Every(cfg.run.eval_every, counters["env_steps"])
    should_save = Every(cfg.run.save_every, counters["env_steps"])
    metrics = Metrics(run_dir, cfg.run.steps, counters["env_steps"], learner.updates,
                      wandb=OmegaConf.to_container(cfg.logger) if cfg.logger.wandb else None,
                      name=cfg.run.name, config=OmegaConf.to_container(cfg, resolve=True),
                      frames_per_step=frames_per_step(cfg.env))
    checkpointer.reserve(learner.state_dict())
    if learner.needs_warmup:  # compile and capture before collecting, on a batch of the replay's shapes
        print("dreamer: warming up the learner step (compile / CUDA graph capture)...", flush=True)
        seconds = warm_up(learner, learner.synthetic_batch(cfg.batch_size, cfg.batch_length))
        print(f"dreamer: learner warm-up took {seconds:.1f} s", flush=True)
        metrics.write({"warmup_seconds": seconds}, counters["env_steps"], learner.updates, kind="warmup")
    try:
        source.start()  # worker processes and their inference server start after the warm-up
    except CollectionError as error:
        raise RunError(str(error)) from None
    updates = Updates(learner, replay, ratio, source, counters, cfg.run.train_start, bool(cfg.replay.context))

    def step() -> None:
        """One pass of the loop: collect, owed updates, records, evaluation, checkpoint."""
        nonlocal logged_at
        steps, episodes = source.gather()
        counters["env_steps"] += steps
        counters["episodes"] += len(episodes)
        window.extend(episodes)
        for episode in episodes:
            metrics.episode(episode.score)
        updates.owe(steps)
        updates.run(stop=lambda: bool(stop))  # a stop keeps the rest owed, in the checkpoint

        metrics.tick(counters["env_steps"], learner.updates)
        if should_log(counters["env_steps"]):
            now = time.monotonic()
            record = {**summarize_episodes(window), "env/restarts": source.restarts,
                      # the learner device's time in updates since the last record (updates still
                      # queued on the device count in the next one)
                      "learner/busy": learner.busy_seconds() / max(now - logged_at, 1e-9), **source.stats()}
            logged_at = now
            pending.append((learner.read_metrics(), record, counters["env_steps"], learner.updates,
                            metrics.clock()))
            window.clear()
        while pending and pending[0][0].ready():  # device metrics arrive without stalling the loop
            write_pending()
        # The last scheduled evaluation is the final one, after the loop.
        if should_eval(counters["env_steps"]) and cfg.run.eval_episodes and counters["env_steps"] < cfg.run.steps:
            counters["eval_owed"] = int(not run_eval("eval"))
        if should_save(counters["env_steps"]):
            save(wait=False)

    window: list = []  # episodes ended since the last metrics record
    logged_at = time.monotonic()
    learner.busy_seconds()  # the warm-up's updates are not training
    pending: list = []  # metrics records waiting for the learner's device values

    def write_pending() -> None:
        read, record, env_steps, updates, at = pending.pop(0)
        metrics.write({**read.result(), **record}, env_steps, updates, at=at)

    try:
        with checkpoint.GracefulStop() as stop:
            if counters["eval_owed"] and cfg.run.eval_episodes and counters["env_steps"] < cfg.run.steps:
                print("dreamer: the evaluation that a stop cut short runs again first", flush=True)
                counters["eval_owed"] = int(not run_eval("eval"))
            while counters["env_steps"] < cfg.run.steps and not stop:
                try:
                    step()
                except CollectionError as error:  # an env, a worker or the inference server gave up
                    save()
                    raise RunError(f"{error} (checkpoint saved at {counters['env_steps']:,} env steps)") from None

            while pending:
                write_pending()
            save()
            if stop:
                print(f"dreamer: {stop.requested} received; saved at {counters['env_steps']:,} env steps", flush=True)
                ending = f"stopped by {stop.requested} (the same command continues it)"
            elif cfg.run.eval_episodes and not run_eval("final_eval"):
                ending = f"stopped by {stop.requested} during its final evaluation (the same command runs it)"
            else:
                ending = "finished"
    finally:  # also when the run stops with an error: no worker process or server thread outlives it
        for part in (source, metrics, checkpointer, replay, evaluator):
            part.close()
    print(run_summary(run_dir, cfg.run.steps, ending), flush=True)


def check_run_folder(argv: list[str]) -> None:
    """The run folder must be a folder this process can write (Hydra creates it before the run starts,
    and fails there with a traceback otherwise). Sweeps make new folders of their own: not checked."""
    if any(arg in ("-m", "--multirun") for arg in argv):
        return
    overrides = [arg for arg in argv if not arg.startswith("-") and "=" in arg]
    cfg = compose_config(overrides, hydra=True)
    folders = {Path(cfg.hydra.run.dir)}
    if "hydra:" not in str(OmegaConf.to_container(cfg.run)["dir"]):  # run.dir set apart from Hydra's folder
        folders.add(Path(str(cfg.run.dir)))
    for path in folders:
        existing = path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if existing == path and not path.is_dir():
            raise ConfigError(f"the run folder {path} is a file; move it away or choose another run.name")
        if not existing.is_dir():
            raise ConfigError(f"the run folder {path} cannot be created: {existing} is a file; choose another run.name")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"the run folder {path} cannot be written ({existing} is read-only); make it writable "
                              "or set run.name / hydra.run.dir to a writable place")


def cli() -> None:
    for name in ("torchrl", "absl", "OpenGL"):  # absl: dm_control's start-up INFO lines; OpenGL: PyOpenGL's
        logging.getLogger(name).setLevel(logging.WARNING)
    if ("--cfg" in sys.argv or "-c" in sys.argv) and "--resolve" not in sys.argv:
        sys.argv.append("--resolve")  # --cfg job prints run.name as the run folder will be named
    try:
        check_overrides(sys.argv[1:])
        check_composes(sys.argv[1:])
        check_run_folder(sys.argv[1:])
        main()
    except (ConfigError, checkpoint.CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
