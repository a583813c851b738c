"""The real command, as a subprocess: smoke run, SIGTERM + resume, and every bad input."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dreamer.config import group_options
from tests.conftest import ROOT, run_train

SMOKE = ["+debug=smoke"]


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _checkpoints(run: Path) -> list[Path]:
    return sorted((run / "checkpoints").glob("ckpt-*.pt"))


def test_smoke_run_writes_metrics_config_and_checkpoints(workdir):
    result = run_train(SMOKE + ["run.name=smoke"], workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    run = workdir / "runs" / "smoke"
    records = _records(run)
    train = [r for r in records if r["kind"] == "train"]
    assert train and train[-1]["env_steps"] == 256 and train[-1]["updates"] > 0
    assert all(v == v for r in train for k, v in r.items() if k.startswith("train/loss_"))  # no NaN
    assert any(r["kind"] == "final_eval" for r in records)
    assert (run / "config.yaml").is_file()
    assert [p.name for p in _checkpoints(run)] == ["ckpt-000000000128.pt", "ckpt-000000000256.pt"]
    assert "[final_eval]" in result.stdout and "env steps" in result.stdout


def test_sigterm_saves_and_the_same_command_resumes(workdir):
    args = SMOKE + ["run.name=resume", "run.steps=100000", "run.save_every=100000", "run.eval_every=0"]
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    process = subprocess.Popen([sys.executable, "-m", "dreamer.train", *args], cwd=workdir, env=environment,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = workdir / "runs" / "resume"
    deadline = time.time() + 240
    while time.time() < deadline:  # wait until it is training (a metrics record after the first updates)
        if (run / "metrics.jsonl").exists() and any(r["updates"] > 0 for r in _records(run)):
            break
        time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err[-3000:]
    assert "SIGTERM received; saved at" in out
    saved = _checkpoints(run)
    assert len(saved) == 1
    saved_steps = int(saved[0].stem.split("-")[1])
    assert saved_steps > 0

    result = run_train(args[:-3] + ["run.name=resume", f"run.steps={saved_steps + 128}", "run.eval_every=0"], workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {saved[0]} at {saved_steps:,} env steps" in result.stdout
    records = _records(run)
    resumed = [r for r in records if r["env_steps"] > saved_steps]
    assert resumed and min(r["env_steps"] for r in resumed) > saved_steps
    assert max(r["env_steps"] for r in records) == saved_steps + 128


def test_a_stop_during_the_final_evaluation_records_none_and_the_same_command_runs_it(workdir):
    """SIGINT while the final evaluation's episode runs (2,000 emulated steps of 5 ms): no final_eval record
    (a cut evaluation is not the mean asked for, and a record would mark the run finished); the rerun
    resumes, trains nothing and evaluates."""
    args = ["+exp=emulated", "+debug=smoke", "env.max_episode_steps=2000", "env.step_latency=0.005",
            "run.collect=inline", "run.eval_every=0", "run.name=final"]
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    process = subprocess.Popen([sys.executable, "-m", "dreamer.train", *args], cwd=workdir, env=environment,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in process.stdout:  # the trainer flushes each line
        seen.append(line)
        if line.startswith("dreamer: final evaluation: 1 episode at 256 env steps"):
            time.sleep(1.0)
            process.send_signal(signal.SIGINT)
            break
    out, err = process.communicate(timeout=120)
    out = "".join(seen) + out
    assert process.returncode == 0, err[-3000:]
    assert "dreamer: evaluation stopped by SIGINT after 0 of 1 episodes: not recorded" in out, out[-2000:]
    assert "stopped by SIGINT during its final evaluation (the same command runs it)" in out
    run = workdir / "runs" / "final"
    assert not [r for r in _records(run) if r["kind"].endswith("eval")]

    result = run_train(args, workdir, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finished" in result.stdout and "dreamer: final evaluation: 1 episode at 256 env steps" in result.stdout
    (final,) = [r for r in _records(run) if r["kind"] == "final_eval"]
    assert final["eval/episodes"] == 1 and final["eval/length_mean"] == 2000
    assert max(r["updates"] for r in _records(run)) == final["updates"]  # the rerun trained nothing


def test_an_evaluation_cut_short_by_a_stop_runs_again_when_the_run_resumes(workdir):
    """SIGINT during a scheduled (not final) evaluation: nothing recorded for it; the resumed command runs
    that evaluation first, at the checkpoint's step, before it trains on (a cut evaluation used to be lost:
    the schedule had already passed its step)."""
    args = ["+exp=emulated", "+debug=smoke", "env.max_episode_steps=2000", "env.step_latency=0.005",
            "run.collect=inline", "run.eval_every=128", "run.eval_episodes=1", "run.name=cut"]
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    process = subprocess.Popen([sys.executable, "-m", "dreamer.train", *args], cwd=workdir, env=environment,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen, at = [], None
    for line in process.stdout:
        seen.append(line)
        if match := re.match(r"dreamer: evaluation: 1 episode at ([\d,]+) env steps", line):
            at = match.group(1)
            time.sleep(1.0)
            process.send_signal(signal.SIGINT)
            break
    out, err = process.communicate(timeout=120)
    out = "".join(seen) + out
    assert process.returncode == 0 and at, err[-3000:] + out[-2000:]
    assert "dreamer: evaluation stopped by SIGINT after 0 of 1 episodes: not recorded" in out, out[-2000:]
    run = workdir / "runs" / "cut"
    assert not [r for r in _records(run) if r["kind"].endswith("eval")]
    saved = int(_checkpoints(run)[-1].stem.split("-")[1])
    assert f"{saved:,}" == at  # saved at the step of the cut evaluation

    result = run_train(args, workdir, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "the evaluation that a stop cut short runs again first" in out, out[-2000:]
    assert out.index(f"dreamer: evaluation: 1 episode at {at} env steps") < out.index("final evaluation")
    evals = [r for r in _records(run) if r["kind"] == "eval"]
    assert [r["env_steps"] for r in evals] == [saved] and evals[0]["eval/episodes"] == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["+exp=nope"], "unknown preset 'nope'; available: acrobot, atari, atari100k, crafter"),
        (["model=size3m"], "unknown model size 'size3m'; available: size100m, size12m"),
        (["batch_length=1"], "batch_length must be at least 2"),
        (["batch_size=0"], "batch_size must be at least 1"),
        (["run.train_ratio=0"], "run.train_ratio must be positive"),
        (["replay.size=10"], "replay.size=10 is smaller than one batch of sequences"),
        (["topology.learner=cuda:3"], "device cuda:3 does not exist"),
        (["env.task=NoSuchTask-v0"], "unknown gym task 'NoSuchTask-v0'; available:"),
        (["+exp=minecraft"], "MineRL is not installed here: run inside the Docker image"),
        (["run.threads=0"], "run.threads must be auto or a positive integer"),
        (["batch_size=abc"], "batch_size must be an integer, got 'abc'"),
        (["run.nope=3"], "'run.nope' is not a setting; did you mean run.name"),
        (["+optimiser.lr=1"], "'optimiser.lr' is not a setting; did you mean optimizer.lr"),
        (["env=emulated", "env.step_latency=0", "env.size=[72,72]", "model.mults=[1,2,3,4,4]", "model.cnn_full_res=true"],
         "the image's height and width (72, 72) must be divisible by 16: the CNNs have 4 strided stages"),
    ],
)
def test_bad_input_gets_one_line_and_a_nonzero_exit(workdir, args, message):
    result = run_train(SMOKE + ["run.name=bad"] + args, workdir, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr[-2000:]
    assert not (workdir / "runs" / "bad" / "metrics.jsonl").exists()  # nothing was built or run


def test_corrupt_checkpoint_is_named_and_the_previous_one_offered(workdir):
    args = SMOKE + ["run.name=corrupt", "run.eval_every=0"]
    assert run_train(args, workdir).returncode == 0
    older, newest = _checkpoints(workdir / "runs" / "corrupt")
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, as after a crash mid-copy
    truncated = newest.read_bytes()
    result = run_train(args, workdir, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and newest.name in lines[0] and "corrupt or truncated" in lines[0]
    assert f"run.resume={older}" in lines[0]
    assert newest.read_bytes() == truncated and older.exists()  # no data lost
    # Following the advice resumes from the intact checkpoint.
    result = run_train(args + [f"run.resume={older}", "run.steps=320"], workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "128 env steps" in result.stdout


# Every preset whose environment installs here; Minecraft on its emulated env (MineRL does not install here:
# see the bad-input test above), at the emulated 50 ms per step.
RUNNABLE = [p for p in group_options("exp") if p != "minecraft"] + ["minecraft"]
FAST = {"emulated": ["env.step_latency=0.001"], "minecraft": ["env=emulated"]}


@pytest.mark.parametrize("preset", RUNNABLE)
def test_every_preset_trains_a_few_updates_and_evaluates_short_episodes(workdir, preset):
    args = [f"+exp={preset}", "+debug=smoke", "run.name=p", "run.steps=128", "run.eval_every=0", *FAST.get(preset, [])]
    result = run_train(args, workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    records = _records(workdir / "runs" / "p")
    assert max(r["updates"] for r in records) > 0 and records[-1]["kind"] == "final_eval"
    # The smoke preset ends episodes after 100 agent steps (lengths count agent steps), so that an
    # evaluation takes seconds in every preset.
    assert records[-1]["eval/length_mean"] <= 100
    # Frames as the reference counts them: env steps x the action repeat of the run's env.
    env = yaml.safe_load((workdir / "runs" / "p" / "config.yaml").read_text())["env"]
    repeat = env.get("repeat", 1) if env["suite"] in ("dmc", "atari") else 1
    assert all(r["frames"] == r["env_steps"] * repeat for r in records)


def test_a_failing_env_is_restarted_and_the_run_goes_on(workdir):
    args = ["+exp=emulated", "+debug=smoke", "run.name=flaky", "run.steps=192", "run.eval_every=0",
            "env.step_latency=0.001", "env.fail_every=25", "run.log_every=64"]
    result = run_train(args, workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [r for r in _records(workdir / "runs" / "flaky") if r["kind"] == "train"]
    assert records[-1]["env/restarts"] >= 4  # 2 envs x 96 steps, a fault every 25 steps of each
    assert sum(r.get("episode/fault_truncated", 0) for r in records) >= 2


def test_ten_failures_in_a_row_stop_the_run_with_a_checkpoint(workdir):
    args = ["+exp=emulated", "+debug=smoke", "run.name=broken", "env.step_latency=0.001", "env.fail_every=1"]
    result = run_train(args, workdir)
    assert result.returncode == 3
    lines = result.stderr.strip().splitlines()
    # The emulated preset collects in worker processes: whichever of the two envs gives up first is named.
    assert len(lines) == 1 and re.search(r"emulated env [01] failed 10 times in a row", lines[0])
    assert "injected fault" in lines[0] and "checkpoint saved at" in lines[0]
    assert _checkpoints(workdir / "runs" / "broken")


def test_a_record_written_after_its_counters_were_read_has_the_rates_and_time_of_that_reading(tmp_path):
    """A train record waits for the learner's device values, so it is written later than its counters
    were read, and sometimes two at once: its rates and time are those of the reading."""
    import io

    from rich.console import Console

    from dreamer.metrics import Metrics

    metrics = Metrics(tmp_path, 1000, console=Console(file=io.StringIO()))
    read = metrics.start + 2.0
    metrics.write({}, 100, 50, at=read)
    metrics.write({}, 300, 150, at=read + 4.0)  # written a moment after the first, read 4 s later
    first, second = (json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert first["time"] == pytest.approx(2.0, abs=0.01) and second["time"] == pytest.approx(6.0, abs=0.01)
    assert second["env_steps_per_s"] == pytest.approx(50.0) and second["updates_per_s"] == pytest.approx(25.0)


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_live_line_follows_the_recent_rate_and_the_eta_leaves_the_prefill_out(tmp_path):
    """On a fake terminal and a fake clock: the replay's prefill runs at 500 env steps/s, then training at
    10. The live line's rate follows the last 30 s; the ETA reads --:-- during the prefill and then uses
    the training rate alone (from the start it said 00:10 at step 501 of a run with 5:30 left)."""
    import io

    from rich.console import Console

    from dreamer.metrics import Metrics

    clock = _Clock()
    metrics = Metrics(tmp_path, 10_000, console=Console(file=io.StringIO(), force_terminal=True, width=200),
                      clock=clock, window=30.0)
    try:
        for i in range(1, 21):  # prefill: 1,000 env steps in 2 s, no update
            clock.now += 0.1
            metrics.tick(50 * i, 0)
        assert metrics.eta(1000) == float("inf") and metrics.fps == pytest.approx(500.0)
        for i in range(1, 601):  # training: 10 env steps and 10 updates per second for 60 s
            clock.now += 0.1
            metrics.tick(1000 + i, i)
        assert metrics.fps == pytest.approx(10.0, rel=0.02) and metrics.ups == pytest.approx(10.0, rel=0.02)
        assert metrics.eta(1600) == pytest.approx((10_000 - 1600) / 10.0, rel=0.02)
        for i in range(1, 401):  # slower: 5 env steps/s for 40 s; the line follows within its window
            clock.now += 0.2
            metrics.tick(1600 + i, 600 + i)
        assert metrics.fps == pytest.approx(5.0, rel=0.05)
    finally:
        metrics.close()


def test_records_keep_their_brackets_on_a_terminal_and_a_run_ends_with_its_summary(tmp_path):
    """rich reads "[eval]" as markup unless told not to; the summary block is read from the run folder."""
    import io

    from rich.console import Console

    from dreamer.metrics import Metrics, run_summary

    out = io.StringIO()
    clock = _Clock()
    metrics = Metrics(tmp_path, 200, console=Console(file=out, force_terminal=True, width=200), clock=clock)
    clock.now += 10.0
    metrics.write({"episode/return": 3.5}, 100, 25, at=clock.now)
    clock.now += 10.0
    metrics.write({"eval/return_mean": 12.25, "eval/return_min": 10.0, "eval/return_max": 14.5, "eval/episodes": 4},
                  200, 50, kind="final_eval")
    metrics.close()
    assert "[final_eval]" in out.getvalue()
    (tmp_path / "overrides.yaml").write_text("- +exp=cartpole\n- seed=3\n")
    text = run_summary(tmp_path, 200, "finished")
    assert f"run {tmp_path.name} finished: 200 of 200 env steps, 50 updates, 00:20 of wall-clock" in text
    assert "final evaluation: return 12.25 mean, 10.00 min, 14.50 max over 4 episodes" in text
    assert "training return (the last record's episodes): 3.50" in text
    assert "command: python -m dreamer.train +exp=cartpole seed=3" in text and f"folder: {tmp_path}" in text


def test_start_up_says_what_runs_in_three_plain_lines(workdir):
    """Before the progress line: the run folder, learner, collection and topology; the replay's memory; the
    preset, env, envs, observations, actions, model and parameter count. Nothing else (no logging lines)."""
    result = run_train(["+exp=emulated", *SMOKE, "run.steps=64", "run.eval_every=0", "env.step_latency=0",
                        "run.collect=inline"], workdir)
    assert result.returncode == 0, result.stderr[-2000:]
    head = result.stdout[: result.stdout.index("[train]")].splitlines()
    assert len(head) == 3 and all(line.startswith("dreamer: ") for line in head), head
    folder, replay, what = head
    assert f"run folder {workdir / 'runs' / 'emulated-diamond-smoke-seed0'};" in folder
    assert all(part in folder for part in ("learner eager, fp32", "inline collection", "topology cpu"))
    assert re.fullmatch(r"dreamer: replay of 4,096 records x [\d,]+ bytes = [\d.]+ MB in host memory", replay), replay
    assert re.fullmatch(r"dreamer: preset emulated: emulated diamond, 2 envs: image 3 x 64 x 64 and a vector of \d+; "
                        r"25 discrete actions; model smoke, [\d,]+ parameters", what), what
    assert result.stderr == "", result.stderr[-2000:]


@pytest.mark.slow
def test_the_embedded_default_learns_cartpole(workdir):
    """`python -m dreamer.train` as a new user runs it (about 6 minutes on 2 cores): the final evaluation
    must be far above the random policy's 23.2 (scripts/random_return.py, 100 episodes; README). Measured
    finals: 220.2 and 165.0; a learner that does not learn stays near 20 to 30."""
    result = run_train([], workdir, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    (final,) = [r for r in _records(workdir / "runs" / "gym-CartPole-v1-tiny-seed0") if r["kind"] == "final_eval"]
    assert final["eval/episodes"] == 5 and final["eval/return_mean"] >= 60, final
