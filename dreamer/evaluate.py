"""Evaluation episodes with the policy's mode (no exploration noise).

As a command:  python -m dreamer.evaluate RUN_DIR [--episodes N] [--envs E] [--checkpoint PATH] [--no-video]
loads the run's config.yaml and its newest checkpoint, runs N episodes on E envs at once (default: the
run's run.eval_envs; each env plays its share of the N), and writes RUN_DIR/eval/eval-<env steps>.json
(returns, lengths, checkpoint) and, for image environments, RUN_DIR/eval/eval-<env steps>.mp4 (the first
env's episodes' frames, in order) and eval-<env steps>-openloop.mp4 (real frames beside the world model's
open-loop predictions of its first episode).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from dreamer.collect import Collector, Episode, shares


def summarize(finished: list[Episode]) -> dict[str, float]:
    if not finished:  # stopped before an episode ended
        return {"eval/episodes": 0}
    scores = [e.score for e in finished]
    return {
        "eval/return_mean": statistics.fmean(scores),
        "eval/return_min": min(scores),
        "eval/return_max": max(scores),
        "eval/length_mean": statistics.fmean(e.length for e in finished),
        "eval/episodes": len(finished),
    }


def evaluate(collector: Collector, episodes: int, stop: Callable[[], bool] | None = None) -> dict[str, float]:
    """Runs `episodes` episodes on the evaluation envs (fewer if `stop()` turns true); the metrics record."""
    return summarize(collector.run_episodes(episodes, stop))


def make_evaluator(cfg, env, envs: int, seed: int, policy, layout, size, device) -> Collector:
    """The collector an evaluation steps: `env` (already built, seeded `seed`) and envs - 1 more of the run's
    env config, each seeded apart (make_env's index); acting deterministically."""
    from dreamer.envs import make_env

    return Collector([env] + [make_env(cfg.env, seed, i) for i in range(1, envs)],
                     lambda i: make_env(cfg.env, seed, i), policy, layout, size, device, explore=False,
                     suite=cfg.env.suite)


def run_with_frames(collector: Collector, episodes: int, stop: Callable[[], bool] | None = None
                    ) -> tuple[list[Episode], list[torch.Tensor], list]:
    """Like Collector.run_episodes, also returning the image frames [C, H, W] (if any) of the first env's
    episodes and the replay records of its first episode."""
    frames, first = [], []
    own = shares(episodes, len(collector.envs))[0]
    ended = 0  # of the first env's episodes

    def keep(record, finished: list[Episode]) -> None:
        nonlocal ended
        if ended < own:
            if ("next", "pixels") in record.keys(True):
                frames.append(record.get(("next", "pixels"))[0])
            if not ended:
                first.append(record[0])
        ended += sum(episode.env == 0 for episode in finished)

    return collector.run_episodes(episodes, stop, keep), frames, first


@torch.no_grad()
def open_loop(networks, records: list, context: int = 5, horizon: int = 45) -> list[torch.Tensor]:
    """Real frames beside the world model's open-loop predictions: the posterior sees `context` steps,
    then the prior alone rolls forward with the episode's real actions for up to `horizon` steps.

    Record t holds the carry before o[t] and the action a[t-1] that led to it (see dreamer.agent), so the
    prediction of o[t] is decode(prior(z[t-1], h[t-1], a[t-1])).
    """
    steps = min(len(records), context + horizon)
    if networks.image_decoder is None or steps <= context:
        return []
    sequence = torch.stack(records[:steps]).unsqueeze(0)
    device = next(networks.world_model.parameters()).device
    seen = networks.world_model(sequence[:, :context].to(device))
    state, belief = seen.get(("next", "state"))[:, -1], seen.get(("next", "belief"))[:, -1]
    frames = []
    for t in range(context, steps):
        _, state, belief = networks.prior(state, belief, sequence.get("action")[:, t].to(device))
        predicted = (networks.image_decoder(state, belief)[0].clamp(0, 1) * 255).to(torch.uint8).cpu()
        real = sequence.get(("next", "pixels"))[0, t]
        frames.append(torch.cat([real, predicted], dim=-1))  # side by side: [C, H, 2W]
    return frames


def missing_video_support() -> str | None:
    """None when MP4s can be written; else what is missing and how to install it, in one line."""
    import importlib.util

    missing = [name for name in ("imageio", "imageio_ffmpeg") if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (f"{' and '.join(name.replace('_', '-') for name in missing)} not installed: evaluation videos are "
            f"off (pip install -e '.[media]' for them, or run.eval_video=false to say so)")


def write_video(path: Path, frames: list[torch.Tensor], fps: int = 30) -> None:
    import imageio.v2 as imageio

    with imageio.get_writer(path, fps=fps, codec="libx264", macro_block_size=1) as writer:
        for frame in frames:
            image = frame.permute(1, 2, 0).numpy()
            writer.append_data(image.repeat(3, -1) if image.shape[-1] == 1 else image)


def write_videos(networks, frames: list, first: list, out: Path, stem: str) -> dict[str, Path]:
    """The episodes' MP4 and, when the world model decodes images, the open-loop MP4; {metric name: path}."""
    if not frames:
        return {}
    out.mkdir(parents=True, exist_ok=True)
    videos = {"eval/video": out / f"{stem}.mp4"}
    write_video(videos["eval/video"], frames)
    predictions = open_loop(networks, first)
    if predictions:
        videos["eval/openloop"] = out / f"{stem}-openloop.mp4"
        write_video(videos["eval/openloop"], predictions, fps=10)
    return videos


def load_weights(agent, loss, state: dict, path: Path, config: Path) -> None:
    """Loads a checkpoint's learner weights into `agent`, built from `config` (`loss`: its loss settings, to
    read the learner's first state format through torchrl's loss); CheckpointError (one line) names the
    first parameter whose name or shape differs, which means the two come from different runs or the config
    was edited after training."""
    from dreamer.agent import torchrl_loss
    from dreamer.checkpoint import CheckpointError
    from dreamer.learner import Learner

    learner = state.get("learner") if isinstance(state.get("learner"), dict) else {}
    version = learner.get("format", 1)
    if version not in (1, Learner.FORMAT):
        raise CheckpointError(f"checkpoint {path} holds learner state format {version}, which this dreamer does not "
                              "read; evaluate it with the dreamer that wrote it")
    weights = learner.get("networks" if version == Learner.FORMAT else "loss")
    if not isinstance(weights, dict):
        raise CheckpointError(f"checkpoint {path} holds no learner weights")
    module = agent.networks.trained
    if version == 1:  # torchrl's DreamerV3Loss state dict, on the agent's own parameters
        with torch.device(next(module.parameters()).device):
            module = torchrl_loss(agent, loss)[0]
    own = module.state_dict()
    for name, tensor in own.items():
        theirs = weights.get(name)
        if theirs is None:
            difference = f"{name} is missing from the checkpoint"
        elif tuple(theirs.shape) != tuple(tensor.shape):
            difference = f"{name} is {tuple(theirs.shape)} in the checkpoint, {tuple(tensor.shape)} from the config"
        else:
            continue
        break
    else:
        extra = sorted(set(weights) - set(own))
        if not extra:
            module.load_state_dict(weights)
            return
        difference = f"{extra[0]} is in the checkpoint, not in the model the config builds"
    raise CheckpointError(f"checkpoint {path} does not match {config} ({difference}); evaluate a checkpoint with "
                          "the config.yaml of the run that wrote it")


EVAL_SEED = 2_000_000  # added to the run's seed: the evaluation's env draws none of training's episodes


class RunError(Exception):
    """A run folder, its config or its checkpoint that cannot be loaded; the message is one line."""


def load_run(run_dir: Path, checkpoint_path: Path | None, seed_offset: int, device: str | None = None):
    """A run folder's agent with the weights of `checkpoint_path` (default: its newest checkpoint), built on
    `device` (default: the run's learner device), and an env of its config seeded `seed + seed_offset`.

    Returns (cfg, settings, state, path, env, layout, agent); RunError says what is wrong and what to do.
    """
    from omegaconf import OmegaConf

    from dreamer import checkpoint
    from dreamer.agent import EnvLayout, build_agent
    from dreamer.config import ConfigError, validate
    from dreamer.envs import make_env

    config = run_dir / "config.yaml"
    if not config.is_file():
        raise RunError(f"{run_dir} is not a run folder (no config.yaml); pass the folder a training run wrote")
    path = checkpoint_path or next(reversed(checkpoint.list_checkpoints(run_dir)), None)
    if path is None:
        raise RunError(f"{run_dir} has no checkpoint yet (none in {checkpoint.folder(run_dir)}); "
                       "train longer or pass --checkpoint PATH")
    try:
        state = checkpoint.load(path)
        try:
            cfg = OmegaConf.load(config)
        except Exception as error:  # a YAML syntax error: the file was edited by hand
            raise ConfigError(f"{config} is not readable YAML ({str(error).splitlines()[0]})") from None
        settings = validate(cfg)
    except (checkpoint.CheckpointError, ConfigError) as error:
        raise RunError(str(error)) from None
    env = make_env(cfg.env, cfg.seed + seed_offset)
    layout = EnvLayout.from_specs(env.observation_spec, env.action_spec)
    with torch.device(device or settings.topology.learner):
        agent = build_agent(layout, settings.size, settings.acting_bf16)
    try:
        load_weights(agent, settings.loss, state, path, config)
    except checkpoint.CheckpointError as error:
        env.close()
        raise RunError(str(error)) from None
    return cfg, settings, state, path, env, layout, agent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dreamer.evaluate", description=__doc__.splitlines()[2])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--episodes", type=int, default=5)
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: the run's newest checkpoint")
    parser.add_argument("--no-video", action="store_true")
    parser.add_argument("--envs", type=int, default=None,
                        help="envs stepped at once, each playing its share of the episodes (default: the run's "
                             "run.eval_envs; the video shows the first env's episodes)")
    args = parser.parse_args(argv)
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    if args.episodes < 1:
        print(f"error: --episodes must be at least 1, got {args.episodes}", file=sys.stderr)
        return 2
    if args.envs is not None and args.envs < 1:
        print(f"error: --envs must be at least 1, got {args.envs}", file=sys.stderr)
        return 2
    run_dir = args.run_dir
    try:
        loaded = load_run(run_dir, args.checkpoint, EVAL_SEED)
    except RunError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from dreamer.config import setting

    torch.set_num_threads(1)
    cfg, settings, state, path, env, layout, agent = loaded
    device = settings.topology.learner
    envs = min(args.envs or int(setting(cfg, "run.eval_envs")), args.episodes)
    collector = make_evaluator(cfg, env, envs, cfg.seed + EVAL_SEED, agent.policy, layout, settings.size, device)
    finished, frames, first = run_with_frames(collector, args.episodes)
    collector.close()
    out = run_dir / "eval"
    out.mkdir(exist_ok=True)
    stem = f"eval-{state['step']:012d}"
    result = {**summarize(finished), "checkpoint": str(path), "env_steps": state["step"],
              "returns": [e.score for e in finished], "lengths": [e.length for e in finished]}
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.episodes} episodes from {path.name}: mean return {result['eval/return_mean']:.2f} "
          f"(min {result['eval/return_min']:.2f}, max {result['eval/return_max']:.2f}) -> {out / stem}.json")
    if frames and not args.no_video:
        videos = write_videos(agent.networks, frames, first, out, stem)
        print(f"video of {len(frames)} frames -> {videos['eval/video']}")
        if "eval/openloop" in videos:
            print(f"open-loop predictions (real | predicted) -> {videos['eval/openloop']}")
    elif not frames:
        print("no video: this environment has no image observation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
