"""The learning set driver (scripts/learn.py) and the learning report (scripts/learning_report.py), on a real
set of two tiny DeepMind Control runs (the smoke preset: a small model and short budgets, on the CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 400


def _learn(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/learn.py", "--dir", str(folder), "--preset", "dmc_proprio", "--tasks",
         "cartpole_balance", "--seeds", "0,1", "--steps", str(STEPS), "--parallel", "2", "--seconds", "900",
         "--min-start", "10", "+debug=smoke", "run.log_every=100", "run.eval_every=200", "run.compile=false",
         "logger.wandb=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="module")
def learned(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("learn")
    done = _learn(folder)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 of 2 runs finished" in done.stdout, done.stdout
    return folder


def test_the_driver_runs_each_task_and_seed_in_its_folder_and_a_rerun_starts_nothing(learned):
    for seed in (0, 1):
        folder = learned / f"cartpole_balance-seed{seed}"
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert records[-1]["kind"] == "final_eval" and records[-1]["env_steps"] >= STEPS
        assert len((folder / "commit").read_text().split()) == 1
    again = _learn(learned)
    assert again.returncode == 0 and "2 of 2 runs finished; 0 to go" in again.stdout
    assert "starts" not in again.stdout and "resumes" not in again.stdout


def test_the_report_gives_each_seed_the_reference_and_a_plot(learned, tmp_path):
    from dreamer.reference import load

    out = tmp_path / "LEARNING.md"
    made = subprocess.run([sys.executable, "scripts/learning_report.py", str(learned), "--out", str(out),
                           "--frames", "200,400"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    text = out.read_text()
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| dmc cartpole_balance")]
    assert [row[1] for row in rows] == ["0", "1"]
    # The training return at each point, from seed 0's own records: interpolated between them, the last
    # one's value past it, and "-" before the first (no episode had ended: nothing is invented).
    records = [json.loads(line) for line in (learned / "cartpole_balance-seed0" / "metrics.jsonl").read_text().splitlines()]
    points = sorted((r["frames"], r["episode/return"]) for r in records if "episode/return" in r)
    for cell, point in zip(rows[0][2:4], (200, 400)):
        expected = np.interp(point, [f for f, _ in points], [v for _, v in points])
        assert cell == ("-" if point < points[0][0] else f"{expected:,.0f}"), (point, points)
    assert any(cell != "-" for cell in rows[0][2:4])
    reference = load("dmc_proprio", "dmc_cartpole_balance")
    mean, low, high = reference.at(200)
    assert f"{mean:.0f} ({low:.0f}-{high:.0f})" in text
    assert (tmp_path / "learning" / "dmc-cartpole_balance-proprio.png").stat().st_size > 10_000
    assert "![dmc-cartpole_balance-proprio](learning/dmc-cartpole_balance-proprio.png)" in text


def test_the_report_refuses_a_folder_without_runs_in_one_line(tmp_path):
    made = subprocess.run([sys.executable, "scripts/learning_report.py", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 2 and made.stderr.count("\n") == 1 and "holds none" in made.stderr


def _report_on_edited_records(learned, tmp_path, edit, frames: str) -> list[str]:
    """learning_report.py on a copy of the learned cartpole run whose records `edit` rewrote (a list of
    records in, a list out); the cells of the run's row."""
    import shutil

    folder = tmp_path / "runs" / "cartpole_balance-seed0"
    shutil.copytree(learned / "cartpole_balance-seed0", folder, ignore=shutil.ignore_patterns("checkpoints"))
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in edit(records)))
    out = tmp_path / "LEARNING.md"
    made = subprocess.run([sys.executable, "scripts/learning_report.py", str(folder.parent), "--out", str(out),
                           "--frames", frames], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    return next(line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| dmc cartpole_balance"))


def test_the_report_takes_a_run_that_has_not_evaluated_yet(learned, tmp_path):
    """A run stopped before its first evaluation (a set cut short): its eval cells are "-", its training
    returns are reported."""
    def drop_evaluations(records):
        kept = [r for r in records if r["kind"] not in ("eval", "final_eval")]
        assert len(kept) < len(records)
        return kept

    row = _report_on_edited_records(learned, tmp_path, drop_evaluations, "200,400")
    assert row[3] != "-" and row[4:6] == ["-", "-"]  # the training return at 400 frames; no evaluation


def test_the_report_carries_no_evaluation_past_the_last_one(learned, tmp_path):
    """A run stopped during its final evaluation (nothing recorded for it): the 400-frame eval cell is "-",
    not the 200-frame evaluation's value."""
    def drop_final_evaluation(records):
        kept = [r for r in records if r["kind"] != "final_eval"]
        assert [r["frames"] for r in kept if r["kind"] == "eval"] == [200] and len(kept) == len(records) - 1
        return kept

    row = _report_on_edited_records(learned, tmp_path, drop_final_evaluation, "200,400")
    assert row[4] != "-" and row[5] == "-"


def test_the_report_carries_a_return_forward_no_further_than_its_records_lay_apart(learned, tmp_path):
    """A run whose episodes stopped ending while it went on (resumed commands shorter than an episode):
    its last training return is reported at points as far past it as its returns lay apart, not further."""
    def returns_until_200(records):
        train = [r for r in records if r["kind"] == "train"]
        assert [r["frames"] for r in train] == [100, 200, 300, 400]
        for record, value in zip(train, (10.0, 20.0, None, None)):  # returns 100 frames apart, none after 200
            record.pop("episode/return", None)
            if value is not None:
                record["episode/return"] = value
        return records

    row = _report_on_edited_records(learned, tmp_path, returns_until_200, "150,300,400")
    assert row[2:5] == ["15", "20", "-"]  # interpolated; 100 past the last (as far as they lay apart); 200 past


def test_the_diagnosis_compares_the_models_beliefs_with_an_episode(learned, tmp_path):
    """scripts/diagnose_learning.py on a real run's checkpoint: one sampled episode, the open-loop and
    imagined rewards beside the real ones, the actor's spread; a folder without a checkpoint is one line."""
    out = tmp_path / "d.json"
    done = subprocess.run([sys.executable, "scripts/diagnose_learning.py", str(learned / "cartpole_balance-seed0"),
                           "--episodes", "1", "--horizon", "5", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    (episode,) = result["episodes"]
    assert episode["steps"] == 101  # the reset's record and 100 agent steps (the smoke preset's episodes)
    assert len(episode["open_loop_reward_abs_error_by_step"]) == 5
    assert abs(episode["real_reward_per_step"] * 5 - episode["real_reward_sum"]) < 1e-4
    assert abs(episode["episode_reward_per_step"] * 100 - episode["return"]) < 1e-3  # r[1..100]: the return
    assert "reward head on the posterior" in done.stdout
    assert 0 < episode["actor_std_mean"] <= 1.0 and result["return_scale"] >= 1.0
    assert "value_mean" not in episode  # 100-step episodes: no state is 700 steps from its end
    assert "imagination against reality" in done.stdout
    assert "values: no state 700 steps before" in done.stdout and "nan" not in done.stdout
    assert "values, every state: critic" in done.stdout and episode["real_return_filled_mean"] > 0
    empty = tmp_path / "run"
    empty.mkdir()
    (empty / "config.yaml").write_text("seed: 0\n")
    refused = subprocess.run([sys.executable, "scripts/diagnose_learning.py", str(empty)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "no checkpoint" in refused.stderr


def test_variants_run_each_seed_once_per_variant_and_the_report_keeps_them_apart(tmp_path):
    """An A/B on one seed: each variant's overrides reach its run, the folders and the report's groups are
    the variants'; a malformed --variant is one line."""
    import yaml

    folder = tmp_path / "ab"
    done = subprocess.run(
        [sys.executable, "scripts/learn.py", "--dir", str(folder), "--preset", "dmc_proprio", "--tasks",
         "cartpole_balance", "--seeds", "0", "--steps", "400", "--parallel", "2", "--seconds", "600",
         "--min-start", "10", "--variant", "low:loss.entropy=1e-4", "--variant", "high:loss.entropy=1e-2 seed=0",
         "+debug=smoke", "run.log_every=100", "run.eval_every=0", "run.compile=false", "logger.wandb=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cartpole_balance seed 0 [low]: finished" in done.stdout and "2 of 2 runs finished" in done.stdout
    for name, entropy in (("low", 1e-4), ("high", 1e-2)):
        run = folder / f"cartpole_balance-seed0-{name}"
        assert (run / "variant").read_text().strip() == name
        assert yaml.safe_load((run / "config.yaml").read_text())["loss"]["entropy"] == entropy
    out = tmp_path / "LEARNING.md"
    made = subprocess.run([sys.executable, "scripts/learning_report.py", str(folder), "--out", str(out),
                           "--frames", "200"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    text = out.read_text()
    assert "| **dmc cartpole_balance proprio high** | mean of 1 |" in text
    assert "| **dmc cartpole_balance proprio low** | mean of 1 |" in text
    summary = [line for line in text.splitlines() if "tasks meet the bar" in line]  # each variant counted apart
    assert [line.split(" frames")[0] for line in summary] == ["- variant high, at 0.2K", "- variant low, at 0.2K"]
    bad = subprocess.run([sys.executable, "scripts/learn.py", "--dir", str(folder), "--preset", "dmc_proprio",
                          "--tasks", "cartpole_balance", "--steps", "200", "--variant", "no overrides"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--variant must be NAME:OVERRIDES" in bad.stderr.strip().splitlines()[-1]


def test_frames_become_agent_steps_by_the_action_repeat_of_each_run(tmp_path):
    """`--frames` counts as the reference's curves do (agent steps x repeat): the paper recipe's repeat 2
    halves a run's agent steps, a variant's `env.repeat=1` keeps them. The runs' command is `true` here
    (exits at once): what is checked is the run.steps each run is given, which learn.py prints."""
    done = subprocess.run(
        [sys.executable, "scripts/learn.py", "--dir", str(tmp_path / "set"), "--preset", "dmc_proprio_paper",
         "--tasks", "walker_walk", "--seeds", "0", "--frames", "100001", "--min-start", "0", "--seconds", "60",
         "--variant", "paper:seed=0", "--variant", "repeat1:env.repeat=1", "--python", "true"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "walker_walk seed 0 [paper]: starts (run.steps=50,001 agent steps)" in done.stdout
    assert "walker_walk seed 0 [repeat1]: starts (run.steps=100,001 agent steps)" in done.stdout
    bad = subprocess.run(
        [sys.executable, "scripts/learn.py", "--dir", str(tmp_path / "set"), "--preset", "dmc_proprio_paper",
         "--tasks", "walker_walk", "--frames", "100", "--python", "true", "env.repeat=two"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "the runs' config does not compose" in bad.stderr.strip().splitlines()[-1]


def test_a_learning_set_goes_on_elsewhere_from_its_archived_records(tmp_path):
    """`reproduce.sh learn-smoke` with LEARN_ARCHIVE: the archive holds each run's records and no checkpoint;
    unpacked into a fresh folder, the same command finds the run finished and starts nothing (a set spread
    over GPU machines that keep no disk between leases)."""
    import tarfile

    env = {**os.environ, "PYTHON": sys.executable, "LEARN_SEEDS": "0", "MPS": "0"}
    first, archive = tmp_path / "first", tmp_path / "records.tgz"
    done = subprocess.run(["bash", "scripts/reproduce.sh", "learn-smoke"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**env, "OUT": str(first), "LEARN_ARCHIVE": str(archive)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"records of 1 runs in {archive}" in done.stdout
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        assert "learn-smoke/cartpole_balance-seed0/metrics.jsonl" in names
        assert "learn-smoke/cartpole_balance-seed0/config.yaml" in names
        assert not [n for n in names if "checkpoint" in n], names
        second = tmp_path / "second"
        tar.extractall(second, filter="data")
    again = subprocess.run(["bash", "scripts/reproduce.sh", "learn-smoke"], cwd=ROOT, capture_output=True, text=True,
                           timeout=300, env={**env, "OUT": str(second)})
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "1 of 1 runs finished; 0 to go" in again.stdout
    assert "starts" not in again.stdout and "resumes" not in again.stdout


def test_the_diagnosis_fills_a_time_limited_return_at_the_episodes_reward_rate():
    """A steady reward r: every state's filled return is r / (1 - gamma), the value a critic that bootstraps
    over the time limit should learn, wherever the episode ends; the cut one is short of it by gamma^n."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import torch
    from diagnose_learning import discounted_returns

    gamma = 1 - 1 / 333
    rewards = torch.full((501,), 0.4)
    rewards[0] = 0.0  # the reset's record carries no reward
    real, filled = discounted_returns(rewards, gamma)
    assert torch.allclose(filled[:-1], torch.full((500,), 0.4 / (1 - gamma)), rtol=1e-4)
    assert abs(float(real[0]) - 0.4 * (1 - gamma ** 500) / (1 - gamma)) < 1e-2
    assert float(real[-1]) == 0.0 and float(real[-2]) == pytest.approx(0.4)


def test_the_table_of_learning_md_is_what_its_recorded_runs_give(tmp_path):
    """LEARNING.md's newest table is rebuilt from the run records kept in the repository
    (learning/sets/dmc_proprio_paper): every row of the rebuilt table is in the file."""
    out = tmp_path / "LEARNING.md"
    done = subprocess.run([sys.executable, "scripts/learning_report.py", "learning/sets/dmc_proprio_paper", "--out",
                           str(out), "--frames", "50000,100000"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line for line in out.read_text().splitlines() if line.startswith("|")]
    committed = (ROOT / "LEARNING.md").read_text().splitlines()
    folders = [path.name for path in (ROOT / "learning/sets/dmc_proprio_paper").glob("*-seed*")]
    assert len(folders) >= 6
    # A group per task and variant: <task>-seed<N> and <task>-seed<N>-<variant> (scripts/learn.py --variant).
    groups = {(name.split("-seed")[0], name.split("-seed")[1].partition("-")[2]) for name in folders}
    assert len({task for task, _ in groups}) == 6
    # The header and rule, a row per run, and per group the mean's row and the reference's.
    assert len(rows) == 2 + len(folders) + 2 * len(groups) and all(row in committed for row in rows)


@pytest.mark.parametrize("steps, pace, left, expected", [
    (400, None, 12, None),  # a run's first command: its pace is not known yet
    (400, 48.0, 30, None),  # it finishes in this command, with room to spare
    (400, 48.0, 2, None),  # it stops before its last round anyway (at 496 of 1,000; the round starts at 600)
    (400, 48.0, 3, (500 - 400) / 48.0),  # it would stop at 544, within the margin before the round: at 500
    (400, 48.0, 5, (500 - 400) / 48.0),  # it would stop at 640, within the last round: stopped at 500 instead
    (400, 48.0, 12, (500 - 400) / 48.0),  # it would stop at 976: stopped at 500 instead
    (400, 48.0, 13, (500 - 400) / 48.0),  # 1,024 is within the margin of finishing: not trusted to finish
    (400, 48.0, 15, None),  # 1,120: past the margin, it finishes
    (520, 48.0, 12, None),  # it starts within the round's margin: nothing to gain
])
def test_a_command_that_would_stop_a_run_within_its_last_round_stops_it_before_instead(steps, pace, left, expected):
    sys.path.insert(0, str(ROOT / "scripts"))
    from learn import early_stop

    after = early_stop(steps, 1000, 400, pace, left)  # a round of 400 agent steps, a margin of 100
    assert after == pytest.approx(expected) if expected is not None else after is None


FAKE_TRAINER = '''
import json, signal, sys, time
from pathlib import Path
# Stands in for `python -m dreamer.train`: advances its env steps at FAKE_PACE per second from the last
# record in its folder, exits 0 on SIGINT, and records a final evaluation once it reaches run.steps.
args = dict(a.split("=", 1) for a in sys.argv[3:] if "=" in a)
folder, total, pace = Path(args["hydra.run.dir"]), int(args["run.steps"]), float(sys.argv[-1].split("=")[1])
metrics = folder / "metrics.jsonl"
lines = metrics.read_text().splitlines() if metrics.is_file() else []
steps = max([json.loads(line)["env_steps"] for line in lines] or [0])
stop = []
signal.signal(signal.SIGINT, lambda *_: stop.append(1))
begin, first = time.monotonic(), steps
while not stop and steps < total:
    time.sleep(0.05)
    steps = min(total, int(first + pace * (time.monotonic() - begin)))
    with metrics.open("a") as handle:
        handle.write(json.dumps({"kind": "train", "env_steps": steps}) + "\\n")
if steps >= total:
    with metrics.open("a") as handle:
        handle.write(json.dumps({"kind": "final_eval", "env_steps": steps}) + "\\n")
'''


def test_the_driver_stops_a_run_before_its_last_round_once_it_knows_the_runs_pace(tmp_path):
    """scripts/learn.py's `--round-frames` with a fake trainer (the only faked part: `--python` runs a script
    that advances its steps at 50 per second, writes a record every 50 ms and obeys SIGINT as dreamer.train
    does): a command that would stop the run within its last round stops it before, and the next command
    makes that round whole."""
    fake = tmp_path / "fake_trainer.py"
    fake.write_text(FAKE_TRAINER)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {fake} \"$@\" pace=50\n")
    python.chmod(0o755)

    def command(seconds: float) -> str:
        done = subprocess.run(
            [sys.executable, "scripts/learn.py", "--dir", str(tmp_path / "set"), "--preset", "dmc_proprio_paper",
             "--tasks", "cartpole_balance", "--seeds", "0", "--frames", "2000", "--round-frames", "800",
             "--seconds", str(seconds), "--min-start", "0", "--python", str(python)],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def reached() -> int:  # the repeat of 2: 2,000 frames are 1,000 agent steps, a round of 800 frames 400
        lines = (tmp_path / "set" / "cartpole_balance-seed0" / "metrics.jsonl").read_text().splitlines()
        return max(json.loads(line)["env_steps"] for line in lines)

    # The fake steps at 50 per second after the driver's and its own start-up (2 to 4 s): 9 s leave the run
    # under 400 agent steps, so that the next command sees its pace well before its planned stop at 500.
    first = command(9)
    start = reached()
    assert "stops in" not in first and 0 < start < 420, first  # it stops before the last round (600 on) anyway
    # A command that would take it to about 900 (less the driver's own start-up, composing the config, a few
    # seconds): within the last round, so the driver stops it at about 500 (a margin of 100) instead.
    second = command((900 - start) / 50 + 3)
    assert "stops in about" in second and "before its last round of 400" in second, second
    assert start < reached() <= 600, second
    third = command(30)
    assert "1 of 1 runs finished" in third and reached() == 1000, third


def test_a_stopped_runs_steps_are_its_newest_checkpoints(tmp_path):
    """A SIGINT saves a checkpoint between two records (records come every run.log_every): the driver counts
    from the checkpoint's steps (its file name), not from the record before it."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from learn import frames_reached

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "train", "env_steps": 2000}) + "\n")
    assert frames_reached(tmp_path) == (2000, False)
    (tmp_path / "checkpoints").mkdir()
    for name in ("ckpt-000000003172.pt", "ckpt-000000002000.pt", "ckpt-000000009999.pt.tmp"):
        (tmp_path / "checkpoints" / name).write_bytes(b"")
    assert frames_reached(tmp_path) == (3172, False)


def test_the_physics_check_reports_this_installs_finger_spin_as_recorded():
    """scripts/dmc_physics.py under this project's MuJoCo prints the lines recorded in learning/physics/ for
    it (LEARNING.md compares them with an older install's): the model's options, the seeded returns and the
    spinner's speeds. A change of the pinned MuJoCo or dm_control that moves finger_spin's physics fails here."""
    done = subprocess.run([sys.executable, "scripts/dmc_physics.py", "--tasks", "finger_spin"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MUJOCO_GL": "disabled"})
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("finger_spin:")]
    assert len(lines) == 3, done.stdout
    assert "damping [2.5, 2.5, 0.5]" in lines[0] and "mean |hinge velocity|" in lines[2], lines
    version = done.stdout.splitlines()[0].split(",")[0].split()[1]  # "mujoco 3.17.0, dm_control ..."
    recorded = (ROOT / "learning" / "physics" / f"mujoco-{version}.txt").read_text().splitlines()
    assert lines == [line for line in recorded if line.startswith("finger_spin:")]
