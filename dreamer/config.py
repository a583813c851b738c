"""Configuration checks with one-line errors, and the values derived from the config once.

Two stages, both before any environment or model is built:
  check_overrides(argv)  unknown preset / model size / other group option, before Hydra composes
  validate(cfg)          value checks on the composed config, then `Settings` with derived values
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from dreamer.agent import LossSettings, ModelSize
from dreamer.envs import EnvConfigError, check_task
from dreamer.learner import OptimizerSettings
from dreamer.topology import Topology, resolve_topology, sweep_job_number

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
_GROUP_NAMES = {"exp": "preset", "model": "model size", "env": "env suite", "topology": "topology",
                "logger": "logger", "debug": "debug preset"}


class ConfigError(ValueError):
    """A bad setting; the message is one line saying what is wrong and what to do."""


def group_options(group: str, config_dir: Path = CONFIG_DIR) -> list[str]:
    return sorted(p.stem for p in (config_dir / group).glob("*.yaml"))


def check_overrides(argv: list[str], config_dir: Path = CONFIG_DIR) -> None:
    """Rejects `[+]group=option` overrides whose option has no YAML file, listing the available ones."""
    for arg in argv:
        match = re.fullmatch(r"[+~]{0,2}([A-Za-z_]\w*)=(.*)", arg)
        if not match or not (config_dir / match.group(1)).is_dir():
            continue
        group, value = match.groups()
        values = value.split(",") if "," in value and not value.startswith(("[", "${")) else [value]
        for option in values:
            option = option.strip()
            if option in ("", "null") or option.startswith(("${", "choice(", "range(", "glob(")):
                continue
            if not (config_dir / group / f"{option}.yaml").is_file():
                options = group_options(group, config_dir)
                name = _GROUP_NAMES.get(group, group)
                raise ConfigError(f"unknown {name} '{option}'; available: {', '.join(options)}")


def check_composes(argv: list[str], config_dir: Path = CONFIG_DIR) -> None:
    """Composes the config as Hydra will (first value of each sweep), so that an unknown key or a bad
    value fails in one line before any job starts."""
    from hydra import compose, initialize_config_dir

    overrides = []
    for arg in argv:
        if arg.startswith("-") or "=" not in arg or arg.lstrip("+~").startswith("hydra"):
            continue
        key, value = arg.split("=", 1)
        if "," in value and not value.startswith(("[", "{", "${", "'", '"')):
            value = value.split(",")[0]  # a sweep: its first job's value
        overrides.append(f"{key}={value}")
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            compose(config_name="config", overrides=overrides)
    except Exception as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise ConfigError(" ".join(lines[:2]) if lines else type(error).__name__) from None


@dataclass(frozen=True)
class Settings:
    """Typed values the builders take; derived once from the config."""

    topology: Topology
    compile: bool
    cudagraph: bool
    bf16: bool
    size: ModelSize
    loss: LossSettings
    optimizer: OptimizerSettings
    updates_per_step: float  # train_ratio / (batch_size * batch_length)


def _flag(value, default: bool, name: str) -> bool:
    if value in ("auto", None):
        return default
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{name} must be auto, true or false, got {value!r}")


INTEGERS = ("seed", "batch_size", "batch_length", "run.steps", "run.envs", "run.train_start", "run.log_every",
            "run.eval_every", "run.eval_episodes", "run.save_every", "run.keep_checkpoints", "run.chunk",
            "run.sync_every", "replay.size", "optimizer.warmup", "loss.imag_length")
NUMBERS = ("run.train_ratio", "run.inference_wait_ms", "run.worker_stall_s", "optimizer.lr", "optimizer.eps", "optimizer.agc",
           "loss.horizon", "loss.lmbda")


def _check_types(cfg: DictConfig) -> None:
    for key in INTEGERS + NUMBERS:
        value = OmegaConf.select(cfg, key)
        allowed = (int,) if key in INTEGERS else (int, float)
        if isinstance(value, bool) or not isinstance(value, allowed):
            kind = "an integer" if key in INTEGERS else "a number"
            raise ConfigError(f"{key} must be {kind}, got {value!r}")


def validate(cfg: DictConfig) -> Settings:
    _check_types(cfg)
    if cfg.batch_size < 1:
        raise ConfigError(f"batch_size must be at least 1, got {cfg.batch_size}")
    if cfg.batch_length < 2:
        raise ConfigError(f"batch_length must be at least 2 (the RSSM needs a transition), got {cfg.batch_length}")
    if cfg.run.train_ratio <= 0:
        raise ConfigError(f"run.train_ratio must be positive (replayed steps per env step), got {cfg.run.train_ratio}")
    if cfg.run.envs < 1:
        raise ConfigError(f"run.envs must be at least 1, got {cfg.run.envs}")
    if cfg.run.inference not in ("auto", "thread", "process"):
        raise ConfigError(f"run.inference must be auto, thread or process, got {cfg.run.inference!r}")
    if cfg.run.collect not in ("inline", "workers"):
        raise ConfigError(f"run.collect must be inline or workers, got {cfg.run.collect!r}")
    if cfg.run.chunk < 1 or cfg.run.sync_every < 1 or cfg.run.inference_wait_ms < 0 or cfg.run.worker_stall_s <= 0:
        raise ConfigError(
            f"run.chunk and run.sync_every must be at least 1, run.inference_wait_ms at least 0 and "
            f"run.worker_stall_s positive, got {cfg.run.chunk}, {cfg.run.sync_every}, "
            f"{cfg.run.inference_wait_ms} and {cfg.run.worker_stall_s}"
        )
    if cfg.run.steps < 1:
        raise ConfigError(f"run.steps must be at least 1, got {cfg.run.steps}")
    sequence = cfg.batch_length + 1
    if cfg.replay.size < cfg.batch_size * sequence:
        raise ConfigError(
            f"replay.size={cfg.replay.size} is smaller than one batch of sequences "
            f"(batch_size x (batch_length + 1) = {cfg.batch_size * sequence}); raise replay.size"
        )
    if cfg.replay.size // cfg.run.envs < sequence:
        raise ConfigError(
            f"replay.size={cfg.replay.size} split over run.envs={cfg.run.envs} streams holds less than one "
            f"sequence of batch_length + 1 = {sequence} per stream; raise replay.size or lower run.envs"
        )
    for key in ("deter", "hidden", "stoch", "classes", "depth", "units", "blocks"):
        if cfg.model[key] < 1:
            raise ConfigError(f"model.{key} must be positive, got {cfg.model[key]}")
    if cfg.model.deter % cfg.model.blocks:
        raise ConfigError(f"model.deter={cfg.model.deter} must be a multiple of model.blocks={cfg.model.blocks}")
    try:
        check_task(cfg.env)
    except EnvConfigError as error:
        raise ConfigError(str(error)) from None
    try:
        topology = resolve_topology(cfg.topology, sweep_job_number())
    except ValueError as error:
        raise ConfigError(str(error)) from None
    cuda = topology.learner.type == "cuda"
    if cfg.run.precision not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"run.precision must be auto, bf16 or fp32, got {cfg.run.precision!r}")
    model = OmegaConf.to_container(cfg.model, resolve=True)
    model.pop("name", None)
    model["mults"] = tuple(model["mults"])
    return Settings(
        topology=topology,
        # auto: compile on CUDA (30 to 90 s of warm-up on an H200, BENCHMARKS.md), not on CPU.
        compile=_flag(cfg.run.compile, cuda, "run.compile"),
        cudagraph=_flag(cfg.run.cudagraph, cuda, "run.cudagraph") and cuda,
        bf16=cfg.run.precision == "bf16" or (cfg.run.precision == "auto" and cuda),
        size=ModelSize(**model),
        loss=LossSettings(**OmegaConf.to_container(cfg.loss, resolve=True)),
        optimizer=OptimizerSettings(**OmegaConf.to_container(cfg.optimizer, resolve=True)),
        updates_per_step=cfg.run.train_ratio / (cfg.batch_size * cfg.batch_length),
    )


def describe(settings: Settings) -> str:
    step = "compiled" if settings.compile else "eager"
    if settings.cudagraph:
        step += " + CUDA graph"
    precision = "bf16" if settings.bf16 else "fp32"
    return f"learner {step}, {precision}; {settings.topology.describe()}"


def set_threads(threads, learner: torch.device) -> None:
    """run.threads: auto = one intra-op thread for a CPU learner, torch's default otherwise.

    The CPU models here are small: on 2 cores one thread ran the embedded default's update in 0.21 s,
    two threads in 0.34 s (they contend with the env loop and replay threads).
    """
    if threads == "auto":
        if learner.type == "cpu":
            torch.set_num_threads(1)
    elif isinstance(threads, int) and threads > 0:
        torch.set_num_threads(threads)
    else:
        raise ConfigError(f"run.threads must be auto or a positive integer, got {threads!r}")
