"""Bad inputs through the real commands: one `error: ` line naming the key, exit code 2, nothing written;
a wandb server that never answers: the run goes on offline with one warning line."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, run_train

pytestmark = pytest.mark.faults

SMOKE = ["+debug=smoke", "run.name=bad"]


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("override, words", [
    ("run.save_every=-1", "run.save_every must be at least 0"),
    ("run.eval_every=-1", "run.eval_every must be at least 0"),
    ("run.log_every=-1", "run.log_every must be at least 0"),
    ("run.eval_episodes=-1", "run.eval_episodes must be at least 0"),
    ("run.keep_checkpoints=0", "run.keep_checkpoints must be at least 1"),
    ("run.train_start=-5", "run.train_start must be at least 0"),
    ("replay.size=4096.5", "replay.size must be an integer, got 4096.5"),
    ("optimizer.lr=0", "optimizer.lr must be positive"),
    ("optimizer.lr=-1e-4", "optimizer.lr must be positive"),
    ("loss.lmbda=1.5", "loss.lmbda must be in [0, 1]"),
    ("loss.horizon=nan", "loss.horizon must be at least 1"),
    ("seed=-1", "seed must be in [0, 2^31)"),
    ("model.recurrent=lstm", "model.recurrent must be gru or block_gru, got 'lstm'"),
    ("+loss.entropy_scale=1", "loss.entropy_scale is not a setting"),
    ("topology.learner=tpu", "topology.learner='tpu' is not a device; use auto, cpu, cuda or cuda:N"),
    ("topology.inference=cuda:x", "topology.inference='cuda:x' is not a device; use auto, cpu, cuda or cuda:N"),
    ("topology.render=[cpu,tpu:1]", "topology.render[1]='tpu:1' is not a device"),
    ("logger=wandb logger.init_timeout=0", "logger.init_timeout must be a positive number"),
    ("logger=wandb logger.mode=sometimes", "logger.mode must be auto, online, offline or disabled"),
])
def test_a_bad_value_is_one_line_exit_2_and_nothing_written(workdir, override, words):
    result = run_train(SMOKE + override.split(), workdir, timeout=120)
    line = _one_error_line(result)
    assert words in line, line
    run = workdir / "runs" / "bad"
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    assert not (run / "config.yaml").exists() and not (run / "wandb").exists()


def test_zero_still_means_never_where_the_config_says_so(workdir):
    result = run_train(SMOKE + ["run.eval_every=0", "run.eval_episodes=0", "run.save_every=0", "run.steps=64"],
                       workdir, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    run = workdir / "runs" / "bad"
    assert len(list((run / "checkpoints").glob("ckpt-*.pt"))) == 1  # the final one only
    assert all('"kind": "eval"' not in line for line in (run / "metrics.jsonl").read_text().splitlines())


def _evaluate(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "dreamer.evaluate", *args], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=300)


def _train_tiny(workdir: Path, name: str, *overrides: str) -> Path:
    args = ["+debug=smoke", f"run.name={name}", "run.steps=64", "run.eval_every=0", "run.eval_episodes=0", *overrides]
    result = run_train(args, workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir / "runs" / name


def test_evaluate_names_a_checkpoint_and_a_config_that_do_not_match(workdir):
    run = _train_tiny(workdir, "a")
    (checkpoint,) = sorted((run / "checkpoints").glob("ckpt-*.pt"))
    edited = workdir / "runs" / "edited"
    shutil.copytree(run, edited)
    assert _evaluate(["runs/a", "--episodes", "1"], workdir).returncode == 0

    # config.yaml edited to another model size after training
    config = yaml.safe_load((edited / "config.yaml").read_text())
    config["model"]["deter"] *= 2
    (edited / "config.yaml").write_text(yaml.safe_dump(config))
    line = _one_error_line(_evaluate(["runs/edited"], workdir))
    assert "runs/edited/checkpoints/ckpt-" in line and "runs/edited/config.yaml" in line, line
    assert "does not match" in line and "in the checkpoint" in line, line

    # a checkpoint copied in from another run with other dimensions
    other = _train_tiny(workdir, "other", "model.units=32")
    line = _one_error_line(_evaluate(["runs/a", "--checkpoint", str(next((other / "checkpoints").glob("ckpt-*.pt")))],
                                     workdir))
    assert "runs/other/checkpoints/ckpt-" in line and "runs/a/config.yaml" in line and "does not match" in line, line

    # a corrupt checkpoint: one line naming it; the file is left as it was
    corrupt = workdir / "corrupt.pt"
    corrupt.write_bytes(checkpoint.read_bytes()[:1000])
    line = _one_error_line(_evaluate(["runs/a", "--checkpoint", str(corrupt)], workdir))
    assert str(corrupt) in line and "corrupt" in line, line
    assert corrupt.stat().st_size == 1000
    assert not (edited / "eval").exists()


@pytest.fixture
def silent_server():
    """A local address that accepts connections and never answers: a wandb server that hangs."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    accepted: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", accepted
    done.set()
    thread.join()
    for connection in accepted:
        connection.close()
    server.close()


def test_a_wandb_server_that_never_answers_does_not_stop_training(workdir, silent_server):
    url, accepted = silent_server
    environment = {
        "WANDB_MODE": None, "WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567", "WANDB_BASE_URL": url,
        "HOME": str(workdir), "NETRC": str(workdir / "none"),
        # only the local server is ever contacted: no proxy, no machine probes, no git
        "HTTP_PROXY": None, "HTTPS_PROXY": None, "http_proxy": None, "https_proxy": None, "ALL_PROXY": None,
        "NO_PROXY": "127.0.0.1", "WANDB__DISABLE_STATS": "true", "WANDB__DISABLE_MACHINE_INFO": "true",
        "WANDB_DISABLE_GIT": "true",
    }
    args = ["+debug=smoke", "run.name=wo", "logger=wandb", "logger.mode=online", "run.eval_every=0",
            "run.eval_episodes=0"]
    run = workdir / "runs" / "wo"
    ids = []
    for steps in (64, 128):  # the second run resumes the first
        result = run_train(args + [f"run.steps={steps}"], workdir, timeout=240, env=environment)
        assert result.returncode == 0, result.stderr[-3000:]
        lines = [line for line in result.stderr.splitlines() if "wandb" in line.lower()]
        assert len(lines) == 1 and lines[0].startswith("warning: wandb did not start online"), result.stderr[-3000:]
        offline = sorted((run / "wandb").glob("offline-run-*"))[-1]
        assert f"wandb sync {offline}" in lines[0]
        assert any(p.suffix == ".wandb" and p.stat().st_size > 0 for p in offline.iterdir())
        ids.append((run / "wandb_id.txt").read_text().strip())
        assert offline.name.endswith(ids[-1])
    assert ids[0] == ids[1] and len(sorted((run / "wandb").glob("offline-run-*"))) == 2
    assert accepted  # wandb did try the (local) server before going offline
