"""logger=wandb without an API key: offline run files in the run folder, never a hang; resume keeps the id."""

from __future__ import annotations

from tests.conftest import run_train


def test_wandb_goes_offline_without_a_key_and_a_resume_keeps_the_run_id(workdir):
    environment = {"WANDB_MODE": None, "WANDB_API_KEY": None, "HOME": str(workdir), "NETRC": str(workdir / "none")}
    args = ["+debug=smoke", "run.name=wb", "logger=wandb", "run.eval_every=0"]
    first = run_train(args + ["run.steps=128"], workdir, env=environment)
    assert first.returncode == 0, first.stderr[-3000:]
    run = workdir / "runs" / "wb"
    run_id = (run / "wandb_id.txt").read_text().strip()
    offline = sorted((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and offline[0].name.endswith(run_id)
    assert any(p.suffix == ".wandb" for p in offline[0].iterdir())
    # The run says it logs offline, where, and how to upload it (one line, on stdout: not a warning).
    said = [line for line in first.stdout.splitlines() if "wandb logs offline" in line]
    assert len(said) == 1 and "no API key" in said[0] and f"`wandb sync {offline[0]}`" in said[0], first.stdout[-2000:]

    second = run_train(args + ["run.steps=256"], workdir, env=environment)
    assert second.returncode == 0, second.stderr[-3000:]
    assert (run / "wandb_id.txt").read_text().strip() == run_id
    assert all(p.name.endswith(run_id) for p in (run / "wandb").glob("offline-run-*"))


def test_evaluation_videos_are_written_and_logged(workdir):
    """An image env: the final evaluation writes the episode and open-loop MP4s and logs both to wandb."""
    environment = {"WANDB_MODE": None, "WANDB_API_KEY": None, "HOME": str(workdir), "NETRC": str(workdir / "none")}
    args = ["+exp=emulated", "+debug=smoke", "run.name=wv", "logger=wandb", "run.eval_every=0",
            "env.step_latency=0", "env.max_episode_steps=30", "run.eval_episodes=1"]
    result = run_train(args, workdir, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    run = workdir / "runs" / "wv"
    written = sorted(p.name for p in (run / "eval").glob("final_eval-*.mp4"))
    assert written == [f"{written[1][:-4]}-openloop.mp4", written[1]]
    logged = list((run / "wandb").glob("offline-run-*/files/media/videos/eval/*.mp4"))
    assert {p.name.split("_")[0] for p in logged} == {"video", "openloop"}


def test_disabled_wandb_costs_nothing(workdir):
    args = ["+debug=smoke", "run.name=wd", "logger=wandb", "logger.mode=disabled", "run.eval_every=0", "run.steps=64"]
    result = run_train(args, workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    run = workdir / "runs" / "wd"
    assert (run / "metrics.jsonl").is_file()
    assert not (run / "wandb").exists() and not (run / "wandb_id.txt").exists()
