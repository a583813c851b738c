"""Every preset composes (with and without +debug=smoke), through Hydra's API and the real command."""

from __future__ import annotations

import math
import re

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from dreamer.config import CONFIG_DIR, INTEGERS, RANGES, ConfigError, check_overrides, group_options, validate
from tests.conftest import run_train

PRESETS = group_options("exp")
SIZES = group_options("model")


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def test_the_reference_sizes_are_all_there():
    # The reference's seven sizes, plus `tiny`, the embedded default's CPU model.
    assert SIZES == sorted(["size1m", "size12m", "size25m", "size50m", "size100m", "size200m", "size400m", "tiny"])
    expected = {  # deter, hidden, classes, depth, units (REFERENCE.md)
        "size1m": (512, 64, 4, 4, 64),
        "size12m": (2048, 256, 16, 16, 256),
        "size25m": (3072, 384, 24, 24, 384),
        "size50m": (4096, 512, 32, 32, 512),
        "size100m": (6144, 768, 48, 48, 768),
        "size200m": (8192, 1024, 64, 64, 1024),
        "size400m": (12288, 1536, 96, 96, 1536),
    }
    for name, dims in expected.items():
        model = yaml.safe_load((CONFIG_DIR / "model" / f"{name}.yaml").read_text())
        assert (model["deter"], model["hidden"], model["classes"], model["depth"], model["units"]) == dims
        assert model["stoch"] == 32 and model["blocks"] == 8 and model["name"] == name


@pytest.mark.parametrize("smoke", [False, True])
@pytest.mark.parametrize("preset", [None, *PRESETS])
def test_preset_composes_and_validates(preset, smoke):
    overrides = ([f"+exp={preset}"] if preset else []) + (["+debug=smoke"] if smoke else [])
    cfg = _compose(overrides)
    # run.dir is Hydra's output folder, known only inside a job; every other value must resolve.
    with open_dict(cfg):
        del cfg.run["dir"]
    OmegaConf.to_container(cfg, resolve=True)
    if cfg.env.suite == "minecraft":  # MineRL cannot be installed here: validation says so in one line
        with pytest.raises(ConfigError, match="MineRL is not installed here"):
            validate(cfg)
        with open_dict(cfg):
            cfg.env.suite = "emulated"
    settings = validate(cfg)
    assert settings.updates_per_step > 0
    if smoke:
        assert cfg.run.steps <= 1000 and cfg.model.deter <= 64


@pytest.mark.parametrize("size", SIZES)
def test_every_size_composes(size):
    cfg = _compose([f"model={size}"])
    assert cfg.model.name == size


@pytest.mark.parametrize("preset", PRESETS)
def test_cfg_job_prints_the_composed_config(preset, workdir):
    result = run_train([f"+exp={preset}", "--cfg", "job"], workdir, timeout=120)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["batch_size"] >= 1 and "env" in printed and "model" in printed
    assert "${" not in printed["run"]["name"]  # the run folder's name, resolved


def test_unknown_options_are_rejected_with_the_list():
    with pytest.raises(ConfigError, match="unknown preset 'nope'; available: "):
        check_overrides(["+exp=nope"])
    with pytest.raises(ConfigError, match="unknown model size 'size3m'; available: size100m"):
        check_overrides(["model=size3m"])
    check_overrides(["+exp=pendulum", "model=size12m,size25m", "env.task=CartPole-v1", "seed=3"])


def _smoke_cfg():
    cfg = _compose(["+debug=smoke"])
    with open_dict(cfg):
        del cfg.run["dir"]
    return cfg


def _rejected(key: str, allowed) -> object:
    """A value of the key's type that its range rejects."""
    candidates = [-1, 0, 1, 2**31] if key in INTEGERS else [-1.0, 0.0, 1.0, 1.5, math.inf, math.nan]
    return next(value for value in candidates if not (math.isfinite(value) and allowed(value)))


@pytest.mark.parametrize("key, allowed, words", RANGES, ids=[key for key, _, _ in RANGES])
def test_every_range_is_one_line_naming_the_key(key, allowed, words):
    cfg = _smoke_cfg()
    value = _rejected(key, allowed)
    OmegaConf.update(cfg, key, value)
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    message = str(error.value)
    assert message.startswith(f"{key} must be {words}, got ") and "\n" not in message


@pytest.mark.parametrize("key", ["run.log_every", "run.eval_every", "run.save_every", "run.eval_episodes",
                                 "run.train_start", "optimizer.agc", "optimizer.warmup"])
def test_zero_stays_valid_where_it_means_never_or_none(key):
    cfg = _smoke_cfg()
    OmegaConf.update(cfg, key, 0)
    validate(cfg)


@pytest.mark.parametrize("key, value, words", [
    ("model.mults", [2, 0], "model.mults must be a list of positive integers"),
    ("run.eval_video", "yes", "run.eval_video must be true or false"),
    ("run.collect", "threads", "run.collect must be inline, workers, ray or auto, got 'threads'"),
    ("run.inference_threads", -1, "run.inference_threads must be at least 0 (0 = torch's default"),
    ("run.inference_threads", 1.5, "run.inference_threads must be an integer, got 1.5"),
    ("run.eval_envs", 0, "run.eval_envs must be at least 1 (envs an evaluation steps at once)"),
    ("loss.entropy_scale", 1.0, "loss.entropy_scale is not a setting; the loss settings are actor_grad, continue_target, entropy, "),
    ("optimizer.momentum", 0.9, "optimizer.momentum is not a setting"),
    ("loss.actor_grad", "dynamics", "loss.actor_grad must be reinforce or backprop, got 'dynamics'"),
    ("run.state_precision", "bfloat16", "run.state_precision must be fp32 or bf16, got 'bfloat16'"),
    ("model.cnn_full_res", "yes", "model.cnn_full_res must be false or true, got 'yes'"),
    ("run.acting_precision", "half", "run.acting_precision must be fp32 or bf16, got 'half'"),
    ("run.fuse_kernels", "yes", "run.fuse_kernels must be auto, true or false, got 'yes'"),
    ("run.cudnn_benchmark", "fast", "run.cudnn_benchmark must be auto, true or false, got 'fast'"),
])
def test_other_bad_values_are_one_line(key, value, words):
    cfg = _smoke_cfg()
    with open_dict(cfg):
        OmegaConf.update(cfg, key, value)
    with pytest.raises(ConfigError, match=re.escape(words)):
        validate(cfg)


def test_the_wandb_logger_settings_are_checked():
    cfg = _compose(["+debug=smoke", "logger=wandb"])
    with open_dict(cfg):
        del cfg.run["dir"]
    assert cfg.logger.init_timeout > 0
    validate(cfg)
    for key, value, words in [("logger.init_timeout", 0, "logger.init_timeout must be a positive number"),
                              ("logger.init_timeout", "soon", "logger.init_timeout must be a positive number"),
                              ("logger.mode", "sometimes", "logger.mode must be auto, online, offline or disabled")]:
        bad = cfg.copy()
        OmegaConf.update(bad, key, value)
        with pytest.raises(ConfigError, match=words):
            validate(bad)
    # A run folder's config.yaml from before init_timeout existed still validates (dreamer.evaluate reads it).
    with open_dict(cfg):
        del cfg.logger["init_timeout"]
    validate(cfg)
    # So does one from before run.inference_threads existed, and one from before run.eval_envs.
    with open_dict(cfg):
        del cfg.run["inference_threads"]
    validate(cfg)
    with open_dict(cfg):
        del cfg.run["eval_envs"]
    validate(cfg)


# The reference recipe per preset (../shared/REFERENCE.md, reference-scores/README.md): model, batch size x
# length, train_ratio, envs, action repeat (None: the suite has none).
REFERENCE_RECIPE = {
    "dmc_proprio": ("size1m", 16, 64, 1024, 16, 1),
    "dmc_vision": ("size200m", 16, 64, 256, 16, 1),
    # The recipe behind the reference's published DMC curves (its configs at 2411f7d, which added them).
    "dmc_proprio_paper": ("size12m", 16, 64, 512, 16, 2),
    "dmc_vision_paper": ("size12m", 16, 64, 512, 16, 2),
    "crafter": ("size200m", 16, 64, 512, 1, None),
    "atari100k": ("size200m", 16, 64, 256, 1, 4),
    "atari": ("size200m", 16, 64, 32, 16, 4),
}


@pytest.mark.parametrize("preset", sorted(REFERENCE_RECIPE))
def test_the_suite_presets_are_the_reference_recipe(preset):
    cfg = _compose([f"+exp={preset}"])
    model, batch, length, ratio, envs, repeat = REFERENCE_RECIPE[preset]
    assert (cfg.model.name, cfg.batch_size, cfg.batch_length, cfg.run.train_ratio, cfg.run.envs) == \
        (model, batch, length, ratio, envs)
    assert cfg.env.get("repeat") == repeat
    assert (cfg.optimizer.lr, cfg.optimizer.warmup) == (4.0e-5, 1000)
    assert cfg.replay.online  # fresh windows first, uniform otherwise
    assert cfg.loss.two_hot == "symexp"  # the reference's reward and value heads (symexp_twohot)
    # A smaller model is one override away (README: what each preset costs).
    assert _compose([f"+exp={preset}", "model=size12m"]).model.name == "size12m"


def test_frames_are_env_steps_times_the_action_repeat():
    from dreamer.envs import frames_per_step

    assert frames_per_step(_compose(["+exp=dmc_proprio"]).env) == 1
    assert frames_per_step(_compose(["+exp=dmc_proprio", "env.repeat=2"]).env) == 2
    assert frames_per_step(_compose(["+exp=dmc_proprio_paper"]).env) == 2
    assert frames_per_step(_compose(["+exp=atari100k"]).env) == 4
    assert frames_per_step(_compose(["+exp=crafter"]).env) == 1
    assert frames_per_step(_compose([]).env) == 1


@pytest.mark.parametrize("gpus, chosen, resolved", [
    (0, "auto", "inline"), (1, "auto", "workers"), (1, "inline", "inline"), (0, "workers", "workers"),
    (1, "ray", "ray")])
def test_run_collect_auto_is_workers_on_a_cuda_learner_and_inline_on_cpu(monkeypatch, gpus, chosen, resolved):
    """dmc_proprio collects with `auto`; the GPU count is what the topology sees (no GPU is used here)."""
    import dreamer.topology
    from dreamer.config import describe, validate

    monkeypatch.setattr(dreamer.topology, "visible_gpus", lambda: gpus)
    cfg = _compose(["+exp=dmc_proprio", f"run.collect={chosen}"])
    with open_dict(cfg):
        del cfg.run["dir"]
    assert _compose(["+exp=dmc_proprio"]).run.collect == "auto"
    settings = validate(cfg)
    assert settings.collect == resolved and f"{resolved} collection" in describe(settings)


@pytest.mark.parametrize("gpus, chosen, resolved", [
    (0, "auto", False), (1, "auto", True), (1, "false", False), (0, "true", False)])
def test_cudnn_benchmark_is_on_with_a_cuda_learner_unless_turned_off(monkeypatch, gpus, chosen, resolved):
    """cuDNN's algorithm search (run.cudnn_benchmark) follows the learner's device; the GPU count is what the
    topology sees (no GPU is used here)."""
    import dreamer.topology

    monkeypatch.setattr(dreamer.topology, "visible_gpus", lambda: gpus)
    cfg = _compose(["+exp=dmc_vision", "model=size12m", f"run.cudnn_benchmark={chosen}"])
    with open_dict(cfg):
        del cfg.run["dir"]
    assert validate(cfg).cudnn_benchmark is resolved


@pytest.mark.parametrize("override", ["optimiser.lr=1e-3", "+optimiser.lr=1e-3", "run.stepz=5"])
def test_a_misspelt_key_is_refused_with_the_closest_settings_and_never_added(override):
    """Hydra would hint `+optimiser.lr=...`, which adds a key that nothing reads; `+` does not get it past."""
    from dreamer.config import check_composes

    with pytest.raises(ConfigError) as error:
        check_composes([override])
    key = override.lstrip("+").split("=")[0]
    closest = {"optimiser.lr": "optimizer.lr", "run.stepz": "run.steps"}[key]
    assert str(error.value).startswith(f"'{key}' is not a setting; did you mean {closest}")
    assert "+" not in str(error.value)


def test_help_is_the_apps_own_text_with_its_presets_and_sizes(workdir):
    result = run_train(["--help"], workdir, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    text = result.stdout
    assert text.startswith("dreamer: DreamerV3 training.") and "python -m dreamer.evaluate" in text
    assert "dmc_proprio" in text and "size200m" in text and "--cfg job" in text
    assert "Powered by Hydra" not in text  # Hydra's own help stays behind --hydra-help


def test_ray_collection_checks_its_address_and_that_ray_is_installed(monkeypatch):
    import importlib.util

    cfg = _smoke_cfg()
    OmegaConf.update(cfg, "run.collect", "ray")
    OmegaConf.update(cfg, "run.ray_address", 5)
    with pytest.raises(ConfigError, match=re.escape("run.ray_address must be auto, HOST:PORT of a Ray head or null")):
        validate(cfg)
    OmegaConf.update(cfg, "run.ray_address", "auto")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError, match=re.escape("run.collect=ray needs Ray, which is not installed here")):
        validate(cfg)


def test_an_older_run_folder_reads_each_later_setting_as_the_configs_default():
    """ADDED_LATER stands in for settings an older config.yaml lacks: each must be the default config's value,
    or an older run resumed would quietly run differently from a new one."""
    from dreamer.config import ADDED_LATER, setting

    cfg = _compose([])
    for key, value in ADDED_LATER.items():
        assert OmegaConf.select(cfg, key) == value, key
    with open_dict(cfg):
        cfg.run.pop("ray_pump")
    assert setting(cfg, "run.ray_pump") == ADDED_LATER["run.ray_pump"]
