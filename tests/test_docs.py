"""docs/GUIDE.md stays true: every file it names exists, every function it names is there, its Python
example runs on a real (tiny) run folder, and the preset skeleton it shows composes."""

from __future__ import annotations

import re
import subprocess
import sys

import yaml

from tests.conftest import ROOT, run_train

GUIDE = (ROOT / "docs" / "GUIDE.md").read_text()


def test_every_path_the_guide_names_exists():
    named = set(re.findall(r"`((?:dreamer|scripts|configs|tests|docs)/[\w./-]+)`", GUIDE))
    named -= {"dreamer/envs/mysuite.py", "configs/env/mysuite.yaml", "tests/test_env_mysuite.py"}  # the example's
    assert len(named) > 10
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, missing


def test_the_functions_the_guide_names_exist():
    from dreamer import envs, metrics

    assert callable(envs.make_env) and callable(envs.frames_per_step) and isinstance(envs.SUITES, dict)
    assert issubclass(envs.EnvConfigError, ValueError)
    for name in ("read_records", "elapsed", "training_rates"):
        assert callable(getattr(metrics, name)), name
    assert "test_the_suite_presets_are_the_reference_recipe" in (ROOT / "tests" / "test_config.py").read_text()


def test_the_metrics_example_runs_on_a_run_folder(workdir):
    assert run_train(["+debug=smoke", "run.name=g", "run.eval_every=0", "run.steps=256"], workdir).returncode == 0
    (example,) = re.findall(r"```python\n(.*?)```", GUIDE, re.S)
    run = workdir / "runs" / "g"
    code = example.replace('"runs/dmc_proprio-walker_walk-size1m-seed0"', repr(str(run)))
    assert code != example
    code += "\nprint(len(records), round(wall[-1], 3), env_rate > 0, update_rate > 0, len(returns))\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    count, _, env_ok, update_ok, _ = done.stdout.split()
    assert int(count) >= 3 and env_ok == update_ok == "True"


def test_the_preset_skeleton_composes(tmp_path):
    from hydra import compose, initialize_config_dir

    from dreamer.config import CONFIG_DIR

    (skeleton,) = re.findall(r"```yaml\n(.*?)```", GUIDE, re.S)
    assert skeleton.startswith("# @package _global_")
    preset = yaml.safe_load(skeleton)
    assert preset["run"]["name"].startswith("mypreset-")
    # Composed as Hydra would: a copy of the configs with the skeleton as configs/exp/mypreset.yaml.
    import shutil

    configs = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, configs)
    (configs / "exp" / "mypreset.yaml").write_text(skeleton)
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+exp=mypreset"])
    assert (cfg.env.suite, cfg.env.task, cfg.model.name, cfg.run.train_ratio) == ("dmc", "cheetah_run", "size12m", 512)
    assert cfg.optimizer.lr == 4.0e-5  # from the reference recipe it starts from
