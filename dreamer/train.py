"""`python -m dreamer.train [+exp=NAME] [key=value ...]`: train DreamerV3; rerun the same command to resume."""

from __future__ import annotations

import logging
import random
import sys
import time
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torchrl.trainers.algorithms import DreamerV3UpdateRatio

from dreamer import checkpoint
from dreamer.agent import EnvLayout, build_agent
from dreamer.collect import CollectionError, Collector, Ingest, start_workers
from dreamer.config import ConfigError, check_composes, check_overrides, describe, set_threads, validate
from dreamer.envs import make_env
from dreamer.evaluate import evaluate, run_with_frames, summarize, write_videos
from dreamer.learner import Learner
from dreamer.metrics import Metrics, summarize_episodes
from dreamer.replay import Replay

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


def train(cfg: DictConfig) -> None:
    settings = validate(cfg)  # every check that needs no environment or model
    set_threads(cfg.run.threads, settings.topology.learner)
    run_dir = Path(cfg.run.dir)
    resumed = checkpoint.resume_state(run_dir, str(cfg.run.resume))
    checkpoint.write_config(run_dir, OmegaConf.to_yaml(cfg, resolve=True))
    print(f"dreamer: run folder {run_dir}; {describe(settings)}", flush=True)
    device = settings.topology.learner
    torch.manual_seed(cfg.seed), np.random.seed(cfg.seed), random.seed(cfg.seed)

    eval_env = make_env(cfg.env, cfg.seed + EVAL_SEED_OFFSET)
    layout = EnvLayout.from_specs(eval_env.observation_spec, eval_env.action_spec)
    with torch.device(device):  # every parameter and buffer is created where it is used
        agent = build_agent(layout, settings.size, settings.loss)
    learner = Learner(agent, settings.optimizer, device, settings.compile, settings.cudagraph, settings.bf16,
                      progress=lambda line: print(f"dreamer: warm-up: {line}", flush=True))
    replay = Replay(cfg.run.envs, cfg.replay.size, cfg.batch_size, cfg.batch_length, device, seed=cfg.seed)
    evaluator = Collector([eval_env], lambda i: make_env(cfg.env, cfg.seed + EVAL_SEED_OFFSET), agent.policy,
                          layout, settings.size, device, explore=False, suite=cfg.env.suite)
    workers = cfg.run.collect == "workers"
    collector = None if workers else Collector(
        [make_env(cfg.env, cfg.seed, i) for i in range(cfg.run.envs)], lambda i: make_env(cfg.env, cfg.seed, i),
        agent.policy, layout, settings.size, device, suite=cfg.env.suite)
    inference = pool = ingest = None  # the workers' inference server and processes start after the warm-up
    ratio = DreamerV3UpdateRatio(settings.updates_per_step)
    # train_steps counts env steps collected while replay is ready, so refilling replay after a
    # resume does not pile up a burst of owed updates.
    counters = {"env_steps": 0, "train_steps": 0, "episodes": 0, "owed_updates": 0}
    if resumed:
        path, state = resumed
        try:
            learner.load_state_dict(state["learner"])
        except (ValueError, KeyError, RuntimeError) as error:
            raise checkpoint.CheckpointError(f"{path} does not fit this run: {error}") from None
        ratio.load_state_dict(state["ratio"])
        counters.update(state["counters"])
        checkpoint.set_rng_state(state["rng"])
        replay.generator.set_state(state["replay_rng"])
        print(f"dreamer: resumed from {path} at {counters['env_steps']:,} env steps, "
              f"{learner.updates:,} updates", flush=True)
    print(f"dreamer: {layout}; {agent.networks.parameter_count():,} parameters", flush=True)

    def stopped() -> bool:  # a SIGINT / SIGTERM also ends an evaluation early
        return bool(stop)

    def run_eval(kind: str) -> None:
        if cfg.run.eval_video and layout.image_shape is not None:
            finished, frames, first = run_with_frames(evaluator, cfg.run.eval_episodes, stopped)
            record = summarize(finished)
            videos = write_videos(agent.networks, frames, first, run_dir / "eval",
                                  f"{kind}-{counters['env_steps']:012d}") if finished else {}
        else:
            record, videos = evaluate(evaluator, cfg.run.eval_episodes, stopped), {}
        metrics.write(record, counters["env_steps"], learner.updates, kind=kind)
        metrics.media(videos, counters["env_steps"])

    def save() -> None:
        checkpoint.save(run_dir, counters["env_steps"], {
            "learner": learner.state_dict(), "ratio": ratio.state_dict(), "counters": dict(counters),
            "rng": checkpoint.rng_state(), "replay_rng": replay.generator.get_state()}, cfg.run.keep_checkpoints)

    should_log = Every(cfg.run.log_every, counters["env_steps"])
    should_eval = Every(cfg.run.eval_every, counters["env_steps"])
    should_save = Every(cfg.run.save_every, counters["env_steps"])
    metrics = Metrics(run_dir, cfg.run.steps, counters["env_steps"], learner.updates,
                      wandb=OmegaConf.to_container(cfg.logger) if cfg.logger.wandb else None,
                      name=cfg.run.name, config=OmegaConf.to_container(cfg, resolve=True))
    if learner.needs_warmup:  # compile and capture before collecting, on a batch of the replay's shapes
        print("dreamer: warming up the learner step (compile / CUDA graph capture)...", flush=True)
        seconds = learner.warmup(learner.synthetic_batch(cfg.batch_size, cfg.batch_length))
        print(f"dreamer: learner warm-up took {seconds:.1f} s", flush=True)
        metrics.write({"warmup_seconds": seconds}, counters["env_steps"], learner.updates, kind="warmup")
    if workers:
        try:
            inference, pool = start_workers(cfg, agent.policy, layout, settings.size, settings.topology.inference,
                                            settings.cudagraph, replay)
        except CollectionError as error:
            raise RunError(str(error)) from None
        # At most a chunk per worker ahead of the loop (backpressure: see Ingest).
        ingest = Ingest(pool, replay, alive=lambda: inference.alive,
                        max_pending=cfg.run.envs * cfg.run.chunk).start()
    should_sync = Every(cfg.run.sync_every, learner.updates)

    def gather() -> tuple[int, list]:
        """The next records into replay: (env steps added, episodes ended)."""
        if not workers:
            records, episodes = collector.step()
            replay.add(records)
            return cfg.run.envs, episodes
        if not inference.alive:  # checked here too: before the loop's next weight sync meets a dead server
            raise CollectionError("the inference server stopped")
        return ingest.take(timeout=1.0)  # the chunks are added to replay by the ingest thread

    window: list = []  # episodes ended since the last metrics record
    logged_at = time.monotonic()
    learner.busy_seconds()  # the warm-up's updates are not training
    pending: list = []  # metrics records waiting for the learner's device values

    def write_pending() -> None:
        read, record, env_steps, updates = pending.pop(0)
        metrics.write({**read.result(), **record}, env_steps, updates)

    try:
        with checkpoint.GracefulStop() as stop:
            while counters["env_steps"] < cfg.run.steps and not stop:
                try:
                    steps, episodes = gather()
                except CollectionError as error:
                    save()
                    raise RunError(f"{error} (checkpoint saved at {counters['env_steps']:,} env steps)") from None
                counters["env_steps"] += steps
                counters["episodes"] += len(episodes)
                window += episodes
                for episode in episodes:
                    metrics.episode(episode.score)

                if replay.ready() and counters["env_steps"] >= cfg.run.train_start:
                    counters["train_steps"] += steps
                    counters["owed_updates"] += ratio(counters["train_steps"])
                    while counters["owed_updates"] and not stop:  # a stop keeps the rest owed, in the checkpoint
                        counters["owed_updates"] -= 1
                        batch, handles = replay.sample()
                        batch = learner.update(batch[:, :-1])
                        if cfg.replay.context:
                            context = batch.get("replay_context")
                            replay.write_back(handles, context.get("state"), context.get("belief"))
                        if workers and should_sync(learner.updates):  # never waits for the server
                            inference.sync()

                metrics.tick(counters["env_steps"])
                if should_log(counters["env_steps"]):
                    now = time.monotonic()
                    record = {**summarize_episodes(window), "env/restarts": (pool or collector).restarts,
                              # the learner device's time in updates since the last record (updates still
                              # queued on the device count in the next one)
                              "learner/busy": learner.busy_seconds() / max(now - logged_at, 1e-9),
                              **(inference.stats() if workers else {})}
                    logged_at = now
                    pending.append((learner.read_metrics(), record, counters["env_steps"], learner.updates))
                    window.clear()
                while pending and pending[0][0].ready():  # device metrics arrive without stalling the loop
                    write_pending()
                # The last scheduled evaluation is the final one, after the loop.
                if should_eval(counters["env_steps"]) and cfg.run.eval_episodes and counters["env_steps"] < cfg.run.steps:
                    run_eval("eval")
                if should_save(counters["env_steps"]):
                    save()

            while pending:
                write_pending()
            save()
            if stop:
                print(f"dreamer: {stop.requested} received; saved at {counters['env_steps']:,} env steps", flush=True)
            elif cfg.run.eval_episodes:
                run_eval("final_eval")
    finally:  # also when the run stops with an error: no worker process or server thread outlives it
        for part in (ingest, pool, inference, metrics, replay, collector, evaluator):
            if part is not None:
                part.close()


def cli() -> None:
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    try:
        check_overrides(sys.argv[1:])
        check_composes(sys.argv[1:])
        main()
    except (ConfigError, checkpoint.CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
