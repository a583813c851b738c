"""Configuration checks with one-line errors, and the values derived from the config once.

Two stages, both before any environment or model is built:
  check_overrides(argv)  unknown preset / model size / other group option, before Hydra composes
  validate(cfg)          value checks on the composed config, then `Settings` with derived values

The YAML under configs/ is the one source of every default: scripts and tests that need settings without a
run compose them the same way (`compose_config`, then `model_size`, `loss_settings`, `optimizer_settings`).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from dreamer.agent import LossSettings, ModelSize
from dreamer.envs import EnvConfigError, check_task
from dreamer.optim import OptimizerSettings
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
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        try:
            cfg = compose(config_name="config", overrides=overrides)
        except Exception as error:
            unknown = re.search(r"Could not override '([^']+)'", str(error))
            if unknown:  # Hydra's hint would be +KEY=..., a key that nothing reads
                raise ConfigError(_unknown_key(unknown.group(1), compose(config_name="config"))) from None
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            raise ConfigError(" ".join(lines[:2]) if lines else type(error).__name__) from None
    _check_sections(cfg)


def _dotted_keys(node, prefix: str = "") -> list[str]:
    if not isinstance(node, DictConfig):
        return [prefix[:-1]]
    return [key for name in node for key in _dotted_keys(node._get_node(name), f"{prefix}{name}.")]


def _unknown_key(key: str, cfg: DictConfig) -> str:
    """One line for a key that `cfg` does not have: the closest keys it does have."""
    import difflib

    close = difflib.get_close_matches(key, _dotted_keys(cfg), n=3, cutoff=0.6)
    return (f"'{key}' is not a setting" + (f"; did you mean {' or '.join(close)}?" if close else "")
            + " (python -m dreamer.train --cfg job lists every setting)")


def _check_sections(cfg: DictConfig) -> None:
    """A top-level key that config.yaml and its groups do not define (`+optimiser.lr=...`) is read by
    nothing: refused, with the closest settings."""
    sections = set(OmegaConf.load(CONFIG_DIR / "config.yaml")) | {p.name for p in CONFIG_DIR.iterdir() if p.is_dir()}
    for name in cfg:
        if name not in sections:
            node = cfg._get_node(name)
            key = f"{name}.{_dotted_keys(node)[0]}" if isinstance(node, DictConfig) and len(node) else name
            known = OmegaConf.masked_copy(cfg, [n for n in cfg if n in sections])
            raise ConfigError(_unknown_key(key, known))


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
    collect: str = "inline"  # run.collect resolved: inline, workers or ray
    fuse_kernels: bool = False  # run.fuse_kernels: the compiled learner's pieces with inductor's combo kernels
    cudnn_benchmark: bool = False  # run.cudnn_benchmark: cuDNN times its convolution algorithms per shape
    state_bf16: bool = False  # run.state_precision=bf16: the learner rounds its recurrent state to bfloat16 each step
    acting_bf16: bool = False  # run.acting_precision=bf16: the acting policy under bfloat16 autocast


def _flag(value, default: bool, name: str) -> bool:
    if value in ("auto", None):
        return default
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{name} must be auto, true or false, got {value!r}")


INTEGERS = ("seed", "batch_size", "batch_length", "run.steps", "run.envs", "run.train_start", "run.log_every",
            "run.eval_every", "run.eval_episodes", "run.eval_envs", "run.save_every", "run.keep_checkpoints",
            "run.chunk", "run.sync_every", "run.inference_threads", "run.ray_envs_per_pump", "replay.size",
            "optimizer.warmup", "loss.imag_length", "model.deter", "model.hidden", "model.stoch", "model.classes",
            "model.depth", "model.units", "model.blocks", "model.enc_layers", "model.dec_layers", "model.head_layers",
            "model.actor_layers", "model.critic_layers", "model.imag_layers", "model.obs_layers", "model.dyn_layers",
            "model.bins", "model.kernel")
NUMBERS = ("run.train_ratio", "run.inference_wait_ms", "run.worker_stall_s", "run.ray_env_cpus",
           "run.ray_env_memory_gb", "optimizer.lr", "optimizer.eps", "optimizer.agc", "optimizer.beta1",
           "optimizer.beta2", "loss.horizon", "loss.lmbda", "loss.entropy",
           "loss.kl_dynamic", "loss.kl_representation", "loss.free_nats", "loss.replay_value", "loss.slow_critic",
           "loss.slow_critic_tau", "loss.return_norm_rate", "model.unimix")

# The allowed range of each number: (key, predicate, the range in words). A period of 0 means never, as
# the `Every` schedules in dreamer/train.py read it.
RANGES = (
    ("seed", lambda v: 0 <= v < 2**31, "in [0, 2^31) (numpy takes seeds below 2^32, env seeds add offsets)"),
    ("batch_size", lambda v: v >= 1, "at least 1"),
    ("batch_length", lambda v: v >= 2, "at least 2 (the RSSM needs a transition)"),
    ("run.steps", lambda v: v >= 1, "at least 1"),
    ("run.envs", lambda v: v >= 1, "at least 1"),
    ("run.train_ratio", lambda v: v > 0, "positive (replayed steps per env step)"),
    ("run.train_start", lambda v: v >= 0, "at least 0 (env steps collected before the first update)"),
    ("run.log_every", lambda v: v >= 0, "at least 0 (env steps between records; 0 = never)"),
    ("run.eval_every", lambda v: v >= 0, "at least 0 (env steps between evaluations; 0 = never)"),
    ("run.eval_episodes", lambda v: v >= 0, "at least 0 (0 = no evaluation)"),
    ("run.eval_envs", lambda v: v >= 1, "at least 1 (envs an evaluation steps at once)"),
    ("run.save_every", lambda v: v >= 0, "at least 0 (env steps between checkpoints; 0 = only at the end)"),
    ("run.keep_checkpoints", lambda v: v >= 1, "at least 1 (the newest checkpoints kept)"),
    ("run.chunk", lambda v: v >= 1, "at least 1"),
    ("run.sync_every", lambda v: v >= 1, "at least 1"),
    ("run.inference_wait_ms", lambda v: v >= 0, "at least 0"),
    ("run.inference_threads", lambda v: v >= 0, "at least 0 (0 = torch's default, one per core)"),
    ("run.worker_stall_s", lambda v: v > 0, "positive"),
    ("run.ray_env_cpus", lambda v: v > 0, "positive (CPUs each Ray env actor asks for; fractions allowed)"),
    ("run.ray_env_memory_gb", lambda v: v >= 0, "at least 0 (0 = no memory reserved)"),
    ("run.ray_envs_per_pump", lambda v: v >= 1, "at least 1 (Ray env workers one pump process serves)"),
    ("replay.size", lambda v: v >= 1, "at least 1"),
    ("optimizer.lr", lambda v: v > 0, "positive"),
    ("optimizer.eps", lambda v: v > 0, "positive"),
    ("optimizer.agc", lambda v: v >= 0, "at least 0 (0 = no gradient clipping)"),
    ("optimizer.warmup", lambda v: v >= 0, "at least 0 (updates of learning-rate warm-up)"),
    ("optimizer.beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optimizer.beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("loss.horizon", lambda v: v >= 1, "at least 1 (discount = 1 - 1 / horizon)"),
    ("loss.imag_length", lambda v: v >= 1, "at least 1"),
    ("loss.lmbda", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("loss.entropy", lambda v: v >= 0, "at least 0"),
    ("loss.kl_dynamic", lambda v: v >= 0, "at least 0"),
    ("loss.kl_representation", lambda v: v >= 0, "at least 0"),
    ("loss.free_nats", lambda v: v >= 0, "at least 0"),
    ("loss.replay_value", lambda v: v >= 0, "at least 0"),
    ("loss.slow_critic", lambda v: v >= 0, "at least 0"),
    ("loss.slow_critic_tau", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("loss.return_norm_rate", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("model.unimix", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("model.bins", lambda v: v >= 2, "at least 2"),
    *((f"model.{key}", lambda v: v >= 1, "at least 1") for key in (
        "deter", "hidden", "stoch", "classes", "depth", "units", "blocks", "enc_layers", "dec_layers",
        "head_layers", "actor_layers", "critic_layers", "imag_layers", "obs_layers", "dyn_layers", "kernel")),
)
CHOICES = {"run.inference": ("auto", "thread", "process"), "run.collect": ("inline", "workers", "ray", "auto"),
           "run.worker_start": ("forkserver", "spawn"),
           "run.precision": ("auto", "bf16", "fp32"), "run.state_precision": ("fp32", "bf16"),
           "run.acting_precision": ("fp32", "bf16"),
           "model.recurrent": ("gru", "block_gru"),
           "replay.storage": ("memory", "disk"), "run.accept_changes": (False, True), "replay.context": (False, True),
           "replay.online": (False, True), "loss.two_hot": ("symexp", "symlog"), "run.ray_pump": ("pipelined", "sweep"),
           "loss.actor_grad": ("reinforce", "backprop"), "loss.continue_target": ("flag", "discounted"),
           "model.cnn_full_res": (False, True)}
WANDB_MODES = ("auto", "online", "offline", "disabled")


# Settings newer than some run folders: an older config.yaml without one reads as this default (its readers
# use the same), so that evaluating or continuing such a run still validates.
ADDED_LATER = {"run.inference_threads": 1, "run.eval_envs": 1, "run.ray_address": None, "run.ray_env_cpus": 1,
               "run.ray_env_memory_gb": 0, "run.ray_envs_per_pump": 32, "run.cudnn_benchmark": "auto",
               "run.ray_pump": "pipelined", "run.state_precision": "fp32", "run.acting_precision": "fp32"}


def setting(cfg: DictConfig, key: str):
    """`cfg`'s value at `key` ("run.eval_envs"), or the ADDED_LATER default where an older run folder's config
    lacks it: the one place those defaults are read."""
    return OmegaConf.select(cfg, key, default=ADDED_LATER[key])


def _check_types(cfg: DictConfig) -> None:
    for key in INTEGERS + NUMBERS:
        value = OmegaConf.select(cfg, key)
        if value is None and key in ADDED_LATER:
            continue
        allowed = (int,) if key in INTEGERS else (int, float)
        if isinstance(value, bool) or not isinstance(value, allowed):
            kind = "an integer" if key in INTEGERS else "a number"
            raise ConfigError(f"{key} must be {kind}, got {value!r}")


def _check_ranges(cfg: DictConfig) -> None:
    for key, allowed, words in RANGES:
        value = setting(cfg, key) if key in ADDED_LATER else OmegaConf.select(cfg, key)
        if not math.isfinite(value) or not allowed(value):  # inf or nan is never a setting
            raise ConfigError(f"{key} must be {words}, got {value}")
    for key, choices in CHOICES.items():
        # A key missing from an older run folder's config.yaml takes its first choice: the value before the
        # setting existed (the default too, but for loss.continue_target, whose default changed with it).
        value = OmegaConf.select(cfg, key, default=choices[0])
        if isinstance(value, bool) != isinstance(choices[0], bool) or value not in choices:
            names = [str(c).lower() if isinstance(c, bool) else c for c in choices]  # as YAML spells them
            raise ConfigError(f"{key} must be {', '.join(names[:-1])} or {names[-1]}, got {value!r}")
    if not isinstance(cfg.run.eval_video, bool):
        raise ConfigError(f"run.eval_video must be true or false, got {cfg.run.eval_video!r}")
    mults = cfg.model.mults
    if not isinstance(mults, ListConfig) or not mults or not all(
            isinstance(m, int) and not isinstance(m, bool) and m >= 1 for m in mults):
        raise ConfigError(f"model.mults must be a list of positive integers (CNN channel multipliers), got {mults}")


def _check_logger(logger: DictConfig) -> None:
    if not logger.get("wandb", False):
        return
    mode = logger.get("mode", "auto")
    if mode not in WANDB_MODES:
        raise ConfigError(f"logger.mode must be {', '.join(WANDB_MODES[:-1])} or {WANDB_MODES[-1]}, got {mode!r}")
    if "init_timeout" not in logger:  # a run folder's config.yaml from before the setting existed
        return
    timeout = logger.init_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ConfigError(f"logger.init_timeout must be a positive number of seconds (how long wandb may take "
                          f"to start online before it falls back to offline), got {timeout!r}")


def _settings(kind, section: str, cfg: DictConfig):
    """A settings dataclass from a config section; a key the dataclass does not know is one line."""
    values = OmegaConf.to_container(cfg[section], resolve=True)
    values.pop("name", None)
    known = set(kind.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{section}.{unknown[0]} is not a setting; the {section} settings are "
                          f"{', '.join(sorted(known))}")
    return kind(**values)


def compose_config(overrides: list[str] | tuple[str, ...] = (), hydra: bool = False) -> DictConfig:
    """The config the training command composes from `overrides` (configs/, through Hydra's compose API);
    `hydra`: with Hydra's own section (the run folder it would make)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra)


def model_size(cfg: DictConfig) -> ModelSize:
    """The network dimensions and layer counts of a composed config (`model:`)."""
    size = _settings(ModelSize, "model", cfg)
    return replace(size, mults=tuple(size.mults))


def updates_per_step(cfg: DictConfig) -> float:
    """Learner updates per env step (agent steps summed over envs): train_ratio replayed steps per env step,
    batch_size x batch_length of them per update."""
    return cfg.run.train_ratio / (cfg.batch_size * cfg.batch_length)


def loss_settings(cfg: DictConfig) -> LossSettings:
    return _settings(LossSettings, "loss", cfg)


def optimizer_settings(cfg: DictConfig) -> OptimizerSettings:
    return _settings(OptimizerSettings, "optimizer", cfg)


@functools.lru_cache(maxsize=None)
def reference_settings(model: str = "size200m") -> tuple[ModelSize, LossSettings, OptimizerSettings]:
    """The reference recipe's model, loss and optimizer settings at a size (`+exp=reference model=MODEL`),
    from the YAML: for benchmarks and tests that build an agent and a learner without a run."""
    cfg = compose_config(["+exp=reference", f"model={model}"])
    return model_size(cfg), loss_settings(cfg), optimizer_settings(cfg)


def _check_ray(address) -> None:
    if address is not None and (not isinstance(address, str) or not address.strip()):
        raise ConfigError(f"run.ray_address must be auto, HOST:PORT of a Ray head or null (a local cluster), "
                          f"got {address!r}")
    if importlib.util.find_spec("ray") is None:
        raise ConfigError("run.collect=ray needs Ray, which is not installed here: pip install -e '.[ray]' "
                          "(ray==2.60.0), or use run.collect=workers")


def validate(cfg: DictConfig) -> Settings:
    _check_sections(cfg)
    _check_types(cfg)
    _check_ranges(cfg)
    _check_logger(cfg.logger)
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
    if cfg.model.deter % cfg.model.blocks:
        raise ConfigError(f"model.deter={cfg.model.deter} must be a multiple of model.blocks={cfg.model.blocks}")
    if cfg.run.collect == "ray":
        _check_ray(setting(cfg, "run.ray_address"))
    try:
        check_task(cfg.env)
    except EnvConfigError as error:
        raise ConfigError(str(error)) from None
    try:
        topology = resolve_topology(cfg.topology, sweep_job_number())
    except ValueError as error:
        raise ConfigError(str(error)) from None
    cuda = topology.learner.type == "cuda"
    return Settings(
        topology=topology,
        # auto: compile on CUDA (30 to 90 s of warm-up on an H200, BENCHMARKS.md), not on CPU.
        compile=_flag(cfg.run.compile, cuda, "run.compile"),
        cudagraph=_flag(cfg.run.cudagraph, cuda, "run.cudagraph") and cuda,
        bf16=cfg.run.precision == "bf16" or (cfg.run.precision == "auto" and cuda),
        size=model_size(cfg),
        loss=loss_settings(cfg),
        optimizer=optimizer_settings(cfg),
        updates_per_step=updates_per_step(cfg),
        # auto: workers on a CUDA learner, where the envs' Python in processes of their own kept the learner
        # busier than the inline source's step thread sharing the trainer's interpreter lock (dmc_proprio:
        # 0.99 against 0.92, BENCHMARKS.md); inline on CPU, where there is no device work to overlap.
        collect=("workers" if cuda else "inline") if cfg.run.collect == "auto" else cfg.run.collect,
        fuse_kernels=_flag(cfg.run.fuse_kernels, False, "run.fuse_kernels"),
        # auto: on CUDA (size200m images: 1.095 x on an H100, BENCHMARKS.md); convolutions only, so vector
        # models are unchanged.
        cudnn_benchmark=_flag(setting(cfg, "run.cudnn_benchmark"), cuda, "run.cudnn_benchmark") and cuda,
        state_bf16=setting(cfg, "run.state_precision") == "bf16",
        acting_bf16=setting(cfg, "run.acting_precision") == "bf16",
    )


def describe(settings: Settings) -> str:
    step = ("compiled, fused kernels" if settings.fuse_kernels else "compiled") if settings.compile else "eager"
    if settings.cudagraph:
        step += " + CUDA graph"
    precision = "bf16" if settings.bf16 else "fp32"
    if settings.state_bf16:
        precision += ", state rounded to bf16 each step"
    if settings.acting_bf16:
        precision += ", acting in bf16"
    return f"learner {step}, {precision}; {settings.collect} collection; {settings.topology.describe()}"


def set_cudnn(settings: Settings) -> None:
    """run.cudnn_benchmark for this process. Here, not in the training entry point: a joblib sweep pickles
    that function by value, and torch's cuDNN module object does not pickle."""
    torch.backends.cudnn.benchmark = settings.cudnn_benchmark


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
