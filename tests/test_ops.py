"""Evaluation command, sweep summary and learning-curve plot, on real (tiny) runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import imageio.v2 as imageio

from tests.conftest import ROOT, run_train

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


def _python(args, cwd):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)


def test_evaluate_writes_returns_and_a_video_that_decodes(workdir):
    # Collected in the training process: the run then ends exactly at run.steps (256; worker chunks
    # would overshoot it), which names the checkpoint and the files below.
    args = ["+exp=emulated", "+debug=smoke", "run.name=ev", "run.eval_every=0", "env.step_latency=0",
            "env.max_episode_steps=30", "run.collect=inline"]
    assert run_train(args, workdir).returncode == 0
    result = _python(["-m", "dreamer.evaluate", "runs/ev", "--episodes", "2"], workdir)
    assert result.returncode == 0, result.stderr[-2000:]
    out = workdir / "runs" / "ev" / "eval"
    record = json.loads((out / "eval-000000000256.json").read_text())
    assert record["eval/episodes"] == 2 and len(record["returns"]) == 2 and record["lengths"] == [30, 30]
    reader = imageio.get_reader(out / "eval-000000000256.mp4")
    frames = [frame for frame in reader]
    assert len(frames) == 62 and frames[0].shape == (64, 64, 3)
    # Open loop: 5 context steps, then predictions for the rest of the first (31-record) episode,
    # each frame the real image beside the predicted one.
    predicted = [frame for frame in imageio.get_reader(out / "eval-000000000256-openloop.mp4")]
    assert len(predicted) == 26 and predicted[0].shape == (64, 128, 3)
    # Two envs at once: 3 episodes, 2 of them the first env's (the video's), 1 the second's.
    result = _python(["-m", "dreamer.evaluate", "runs/ev", "--episodes", "3", "--envs", "2"], workdir)
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads((out / "eval-000000000256.json").read_text())
    assert record["eval/episodes"] == 3 and record["lengths"] == [30, 30, 30]
    assert len([frame for frame in imageio.get_reader(out / "eval-000000000256.mp4")]) == 62
    result = _python(["-m", "dreamer.evaluate", "runs/ev", "--envs", "0"], workdir)
    assert result.returncode == 2 and result.stderr.strip() == "error: --envs must be at least 1, got 0"


def test_evaluate_without_a_checkpoint_says_so_in_one_line(workdir):
    (workdir / "run").mkdir()
    (workdir / "run" / "config.yaml").write_text("seed: 0\n")
    result = _python(["-m", "dreamer.evaluate", "run"], workdir)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "run has no checkpoint yet" in lines[0]
    result = _python(["-m", "dreamer.evaluate", "nowhere"], workdir)
    assert result.returncode == 2 and "is not a run folder" in result.stderr


def test_a_joblib_sweep_makes_one_run_folder_per_job_and_a_summary(workdir):
    result = run_train(["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "+debug=smoke", "seed=0,1",
                        "run.eval_every=0", "run.steps=128"], workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    (sweep,) = (workdir / "runs" / "sweeps").iterdir()
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0", "1"] and all((sweep / j / "checkpoints").is_dir() for j in jobs)
    table = _python([str(ROOT / "scripts" / "summarize.py"), str(sweep)], workdir)
    assert table.returncode == 0, table.stderr
    rows = table.stdout.strip().splitlines()[2:]
    assert len(rows) == 2 and "seed=0" in rows[0] and "seed=1" in rows[1]
    # The first job says where the sweep went and how to resume it; the same command naming that folder
    # resumes its jobs (both finished here: each says so) instead of starting a new sweep.
    hint = f"dreamer: sweep folder {sweep.relative_to(workdir)} (a run folder per job); the same command with " \
           f"hydra.sweep.dir={sweep.relative_to(workdir)} resumes its jobs"
    assert result.stdout.count(hint) == 1, result.stdout[-3000:]
    again = run_train(["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "+debug=smoke", "seed=0,1",
                       "run.eval_every=0", "run.steps=128", f"hydra.sweep.dir={sweep.relative_to(workdir)}"], workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(list((workdir / "runs" / "sweeps").iterdir())) == 1
    assert again.stdout.count("already finished") == 2, again.stdout[-3000:]
    # Each job's closing summary gives the command that resumes that job's folder on its own.
    assert f"command: python -m dreamer.train +debug=smoke seed=1 run.eval_every=0 run.steps=128 " \
           f"hydra.run.dir={sweep / '1'}\n" in again.stdout, again.stdout[-3000:]

    plot = _python([str(ROOT / "scripts" / "plot.py"), str(sweep / "0"), str(sweep / "1"), "--out", "c.png",
                    "--metric", "eval/return_mean"], workdir)
    assert plot.returncode == 0, plot.stderr
    assert (workdir / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # As the README shows it: the sweep's folder, or its entries (multirun.yaml among them, skipped).
    for paths in ([str(sweep)], [str(p) for p in sorted(sweep.iterdir())]):
        plot = _python([str(ROOT / "scripts" / "plot.py"), *paths, "--out", "d.png"], workdir)
        assert plot.returncode == 0, plot.stderr
        assert "2 runs in 1 group(s)" in plot.stdout and "reference none published" in plot.stdout


def test_plot_draws_a_dmc_run_over_the_reference_curve_at_equal_frames(workdir):
    """A recorded dmc run folder (its config.yaml and metrics.jsonl written here, as training writes them):
    the plot finds the reference's walker_walk curve; a folder that is not a run gets one line, exit 2."""
    run = workdir / "runs" / "dmc"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("env:\n  suite: dmc\n  task: walker_walk\n  obs: proprio\n  repeat: 1\n")
    records = [{"kind": "train", "env_steps": s, "frames": s, "updates": s, "episode/return": s / 200}
               for s in range(5000, 60001, 5000)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    plot = _python([str(ROOT / "scripts" / "plot.py"), str(run), "--out", "w.png"], workdir)
    assert plot.returncode == 0, plot.stderr
    assert "reference dmc_proprio:dmc_walker_walk" in plot.stdout
    assert (workdir / "w.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = workdir / "empty"
    empty.mkdir()
    plot = _python([str(ROOT / "scripts" / "plot.py"), str(empty)], workdir)
    assert plot.returncode == 2 and len(plot.stderr.strip().splitlines()) == 1 and "not a run folder" in plot.stderr


def test_plot_draws_a_run_of_the_reference_code_beside_a_task_by_its_rounds_of_episodes(workdir):
    """`--compare` reads a logdir of the reference's own code (its scores.jsonl, written here in that code's
    format: one record per episode, step in frames): episodes ending together are one point, their mean."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from plot import load_scores
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    run = workdir / "runs" / "dmc"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("env:\n  suite: dmc\n  task: finger_spin\n  obs: proprio\n  repeat: 2\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"env_steps": s, "frames": 2 * s, "episode/return": s / 100})
                                               + "\n" for s in range(8000, 40001, 8000)))
    other = workdir / "ref" / "finger_spin-s0"
    other.mkdir(parents=True)
    episodes = [(16000 + 2 * i, 10.0 + i) for i in range(4)] + [(32000 + 2 * i, 100.0 + i) for i in range(4)]
    (other / "scores.jsonl").write_text("".join(json.dumps({"step": s, "episode/score": v}) + "\n"
                                                for s, v in episodes)
                                        + json.dumps({"step": 32010, "episode/length": 500}) + "\n")
    frames, scores = load_scores(other)
    assert frames.tolist() == [16003, 32003] and scores.tolist() == [11.5, 101.5]
    plot = _python([str(ROOT / "scripts" / "plot.py"), str(run), "--compare", str(other), "--out", "r.png"], workdir)
    assert plot.returncode == 0, plot.stderr
    assert "1 runs in 1 group(s), beside 1 of the reference code" in plot.stdout
    assert (workdir / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A logdir without scores.jsonl (one of this project's run folders, say), or runs of two tasks: one line.
    bad = _python([str(ROOT / "scripts" / "plot.py"), str(run), "--compare", str(run)], workdir)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "no scores.jsonl" in bad.stderr
    walker = workdir / "runs" / "walker"
    walker.mkdir()
    (walker / "config.yaml").write_text("env:\n  suite: dmc\n  task: walker_walk\n  obs: proprio\n  repeat: 2\n")
    (walker / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text())
    two = _python([str(ROOT / "scripts" / "plot.py"), str(run), str(walker), "--compare", str(other)], workdir)
    assert two.returncode == 2 and "one task" in two.stderr and len(two.stderr.strip().splitlines()) == 1


def test_an_unknown_key_in_a_sweep_fails_before_any_job(workdir):
    result = run_train(["-m", "hydra/launcher=joblib", "+debug=smoke", "run.nope=1,2"], workdir)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "'run.nope' is not a setting; did you mean run.name" in lines[0]
    assert not (workdir / "runs").exists()


def test_benchmark_and_baseline_scripts_run(workdir):
    bench = _python([str(ROOT / "scripts" / "bench_envs.py"), "--suite", "emulated", "--workers", "1,2",
                     "--seconds", "0.5", "step_latency=0.01"], workdir)
    assert bench.returncode == 0, bench.stderr[-2000:]
    rows = [json.loads(line) for line in bench.stdout.strip().splitlines()]
    assert [r["workers"] for r in rows] == [1, 2]
    assert all(0 < r["per_worker"] <= 100 for r in rows)  # 10 ms per step: at most 100 steps/s each
    baseline = _python([str(ROOT / "scripts" / "random_return.py"), "gym", "CartPole-v1", "5"], workdir)
    assert baseline.returncode == 0 and "random policy mean return" in baseline.stdout


def test_the_server_copies_benchmark_times_each_thread_count_in_a_process_of_its_own(workdir):
    """Each --threads value is applied in its own process (3 threads is neither 1 nor this machine's
    default here), the rows are the Minecraft preset's at the model asked; times are not checked."""
    bench = _python([str(ROOT / "scripts" / "bench_server_copies.py"), "--threads", "3,1", "--busy", "1",
                     "--passes", "100", "--model", "size1m"], workdir)
    assert bench.returncode == 0, bench.stderr[-2000:]
    lines = [json.loads(line) for line in bench.stdout.strip().splitlines()]
    assert [(r["asked"], r["threads"]) for r in lines[:2]] == [(3, 3), (1, 1)]
    assert lines[0]["request_bytes"] > 64 * 64 * 3 and lines[0]["model"] == "size1m"
    assert all(0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"] for r in lines[:2])
    assert lines[2]["of"] == "3 threads" and lines[2]["against"] == "1 threads"
    refused = _python([str(ROOT / "scripts" / "bench_server_copies.py"), "--threads", "two"], workdir)
    assert refused.returncode == 2
    assert "--threads must be comma-separated integers" in refused.stderr.strip().splitlines()[-1]


def test_the_startup_benchmark_measures_both_ways_of_starting_workers(workdir):
    """Both methods start the application's workers (their processes are found and measured: the fork
    server's run has one process more), the ratio line follows; times are not checked."""
    bench = _python([str(ROOT / "scripts" / "bench_startup.py"), "--envs", "2", "--settle", "1", "--",
                     "+exp=emulated", "+debug=smoke", "env.step_latency=0.001", "run.inference=thread"], workdir)
    assert bench.returncode == 0, bench.stderr[-2000:] + bench.stdout[-2000:]
    lines = bench.stdout.strip().splitlines()
    rows = [json.loads(line) for line in lines[:2]]
    assert [(r["method"], r["processes"]) for r in rows] == [("spawn", 2), ("forkserver", 3)]
    assert all(r["all_stepping_s"] >= 0 and r["pss_mb"] > 0 for r in rows)  # its line was read
    assert lines[2].startswith("forkserver against spawn: start-up ")
    refused = _python([str(ROOT / "scripts" / "bench_startup.py"), "--methods", "fork"], workdir)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1


def test_learner_benchmark_runs_on_cpu(workdir):
    """Both variants run in their own processes and the ratio line follows (timings are not checked);
    --parallel starts torchrl's after ours and checks its timed phase against the others side by side."""
    bench = _python([str(ROOT / "scripts" / "bench_learner.py"), "--device", "cpu", "--model", "tiny", "--batch", "2",
                     "--length", "8", "--updates", "2", "--parallel", "--out", "bench.jsonl"], workdir)
    assert bench.returncode == 0, bench.stderr[-2000:]
    rows = [json.loads(line) for line in bench.stdout.strip().splitlines()]
    assert [r.get("variant") for r in rows[:2]] == ["ours", "torchrl_eager"]
    assert rows[1]["overlapped_with"] == [] and "overlapped_with" not in rows[0]
    assert rows[0]["measured_span"][1] <= rows[1]["measured_span"][0]  # ours ran to its end first
    assert all(r["updates_per_second"] > 0 and r["gflop_per_update"] > 0 for r in rows[:1])
    assert rows[2]["ratio"] == "ours/torchrl" and rows[2]["speedup"] > 0
    assert len((workdir / "bench.jsonl").read_text().splitlines()) == 3


def test_preset_costs_counts_each_presets_updates_and_prices_them_with_bench_lines(workdir):
    """Updates per 100K frames follow each preset's train_ratio, batch and action repeat; a learner step
    measured at a preset's shapes prices it. The reader keys on what bench_learner.py writes: a real CPU
    line with --image carries its shape; the priced lines are in that format, with chosen ms values."""
    bench = _python([str(ROOT / "scripts" / "bench_learner.py"), "--device", "cpu", "--model", "tiny", "--batch", "2",
                     "--length", "4", "--obs", "image", "--image", "1,16,16", "--variant", "ours", "--updates", "1",
                     "--no-flops", "--out", "bench.jsonl"], workdir)
    assert bench.returncode == 0, bench.stderr[-2000:]
    written = json.loads((workdir / "bench.jsonl").read_text().splitlines()[0])
    assert written["image"] == [1, 16, 16] and written["obs"] == "image" and written["variant"] == "ours"
    lines = [{**written, "model": "size200m", "batch": 16, "length": 64, "image": [1, 96, 96], "ms_per_update": 96.0},
             {**written, "model": "size200m", "batch": 16, "length": 64, "image": [3, 64, 64], "ms_per_update": 48.0},
             {**written, "variant": "torchrl_eager", "model": "size1m", "obs": "vector", "batch": 16, "length": 64}]
    (workdir / "priced.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = _python([str(ROOT / "scripts" / "preset_costs.py"), "--measured", "priced.jsonl"], workdir)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in result.stdout.splitlines()[2:]}
    updates = {name: row[6] for name, row in rows.items()}
    assert updates == {"dmc_proprio": "100,000", "dmc_proprio_paper": "25,000", "dmc_vision": "25,000",
                       "dmc_vision_paper": "25,000", "crafter": "50,000", "atari100k": "6,250", "atari": "781",
                       "minecraft": "195"}
    assert rows["atari"][2] == "image 1 x 96 x 96" and rows["dmc_proprio"][2] == "vector"
    # 781.25 updates x 96 ms; 25,000 and 50,000 x 48 ms; another variant's line prices nothing.
    assert rows["atari"][7:9] == ["96.00", "1.2"] and rows["dmc_vision"][7:9] == ["48.00", "20.0"]
    assert rows["crafter"][8] == "40.0" and rows["atari100k"][8] == "5.0" and rows["dmc_proprio"][7] == "-"
    refused = _python([str(ROOT / "scripts" / "preset_costs.py"), "--presets", "dmc_proprio,nope"], workdir)
    assert refused.returncode == 1 and refused.stderr.strip().startswith("error: unknown preset(s) nope")


def test_pipeline_benchmark_runs_on_cpu(workdir):
    """Every phase reports, with 4 emulated-env workers and the CPU inference server (timings not checked)."""
    bench = _python([str(ROOT / "scripts" / "bench_pipeline.py"), "--device", "cpu", "--model", "smoke", "--batch", "4",
                     "--length", "8", "--envs", "4", "--latency", "0.01", "--seconds", "2", "--rounds", "2",
                     "--overhead-updates", "4", "--replay", "4000", "--threads", "1", "--out", "pipeline.jsonl"], workdir)
    assert bench.returncode == 0, bench.stderr[-2000:]
    lines = [json.loads(line) for line in (workdir / "pipeline.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in lines] == ["warmup", "collect", "train", "collect", "inference_alone", "train",
                                           "inference", "overhead", "ratios"]  # two rounds, alternating
    assert [r["round"] for r in lines if r["phase"] in ("collect", "train")] == [0, 0, 1, 1]
    rows = {r["phase"]: r for r in lines}  # the last of each phase
    collected = [r["env_steps_per_s"] for r in lines if r["phase"] == "collect"]
    trained = [r["env_steps_per_s"] for r in lines if r["phase"] == "train"]
    assert rows["ratios"]["train_over_collect"] == round(sum(trained) / sum(collected), 4)
    assert len(rows["ratios"]["train_over_collect_by_round"]) == 2
    assert rows["warmup"]["threads"] == 1  # --threads reached torch
    assert rows["collect"]["env_steps_per_s"] > 0 and rows["train"]["updates"] > 0
    assert rows["collect"]["received_env_steps_per_s"] > 0  # chunks arrived too
    assert rows["inference"]["batches"] > 0 and rows["inference"]["p99_ms"] >= rows["inference"]["p50_ms"]
    assert rows["ratios"]["worker_restarts"] == 0
    # The training loop's own pieces: the trainer thread's time by part of Updates, the workers' step times.
    assert set(rows["train"]["host_fraction"]) == {"wait", "sample", "update", "write_back", "sync"}
    assert rows["collect"]["worker_step_ms"]["env_ms"] > 0 and rows["train"]["worker_step_ms"]["policy_ms"] > 0
    assert rows["overhead"]["steady_ms_with_replay"] > 0 and rows["overhead"]["steady_ms_resident"] > 0


def test_replay_benchmark_runs_on_cpu(workdir):
    """Both variants report; ours samples fewer bytes (the context of first records only). Timings not checked."""
    bench = _python([str(ROOT / "scripts" / "bench_replay.py"), "--model", "tiny", "--streams", "4", "--capacity",
                     "200", "--per-stream", "128", "--batch", "4", "--length", "16", "--samples", "2"], workdir)
    assert bench.returncode == 0, bench.stderr[-2000:]
    rows = [json.loads(line) for line in bench.stdout.strip().splitlines()]
    assert [r.get("variant") for r in rows[:2]] == ["ours", "stock"] and rows[2]["ratio"] == "stock / ours"
    assert rows[0]["sampled_mb"] < rows[1]["sampled_mb"] and all(r["sample_ms"] > 0 for r in rows[:2])


def test_the_slurm_launcher_config_composes():
    """hydra/launcher=slurm resolves to submitit's Slurm launcher with one GPU per job (nothing is submitted)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "+exp=dmc_proprio"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert launcher.gpus_per_node == 1 and launcher.tasks_per_node == 1 and launcher.timeout_min > 0


def test_summarize_reads_finished_interrupted_and_resumed_runs_under_any_folder(workdir):
    """Recorded run folders (metrics.jsonl as training writes it): a finished run; one stopped in its first
    evaluation before an episode ended (`eval/episodes` 0, no return); one resumed (its `time` starts
    again). Pointed at `runs/`, every one gets a row; rates are of the training phase (prefill apart)."""
    def record(kind, steps, updates, time, **values):
        return {"kind": kind, "env_steps": steps, "frames": steps, "updates": updates, "time": time, **values}

    runs = workdir / "runs"
    finished = [record("train", 500, 0, 1.0, env_steps_per_s=500.0),  # the prefill: fast
                record("train", 1000, 10, 51.0), record("train", 1500, 20, 101.0),
                record("final_eval", 1500, 20, 110.0, **{"eval/return_mean": 7.5, "eval/episodes": 2})]
    interrupted = [record("train", 500, 0, 1.0), record("train", 1000, 10, 51.0),
                   record("eval", 1000, 10, 60.0, **{"eval/episodes": 0})]
    resumed = [record("train", 500, 0, 1.0), record("train", 1000, 10, 51.0), record("train", 1500, 20, 101.0),
               record("eval", 1500, 20, 105.0, **{"eval/return_mean": 3.0, "eval/episodes": 1}),
               record("train", 2000, 30, 40.0)]  # the second command: 40 s after its start
    for name, records in (("done", finished), ("cut", interrupted), ("sweeps/1/0", resumed)):
        (runs / name).mkdir(parents=True)
        (runs / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "tr')
    (runs / "done" / "overrides.yaml").write_text("- +exp=cartpole\n- seed=1\n")
    table = _python([str(ROOT / "scripts" / "summarize.py"), "runs"], workdir)
    assert table.returncode == 0, table.stderr
    rows = {line.split()[0]: line.split() for line in table.stdout.strip().splitlines()[2:]}
    assert set(rows) == {"done", "cut", "sweeps/1/0"}
    assert rows["done"][1:3] == ["+exp=cartpole", "seed=1"]
    assert rows["done"][-3:] == ["10.0", "0.20", "7.50"]  # 500 env steps in 50 s; not 500 steps/s
    assert rows["cut"][-3:] == ["-", "-", "-"]  # one training record: no rate yet; no return
    # 1,000 env steps from 51 s to 105 + 40 s (the resumed command's time goes on from the first's last
    # record), the last evaluation's return at 1,500 env steps.
    assert rows["sweeps/1/0"][-4:] == ["10.6", "0.21", "3.00", "@1,500"]
    assert rows["sweeps/1/0"][1:5] == ["-", "2,000", "30", "02:25"]  # wall-clock: 105 + 40 s
    bad = _python([str(ROOT / "scripts" / "summarize.py"), "nowhere"], workdir)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_a_missing_video_package_is_named_in_one_line_with_its_extra(monkeypatch):
    """Without imageio-ffmpeg (hidden here) a run of an image env says so at start-up and writes no
    videos, instead of failing at its first evaluation."""
    import importlib.util

    from dreamer.evaluate import missing_video_support

    assert missing_video_support() is None  # the test environment has the media extra
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "imageio_ffmpeg" else real(name, *a))
    line = missing_video_support()
    assert line.startswith("imageio-ffmpeg not installed") and "pip install -e '.[media]'" in line and "\n" not in line
