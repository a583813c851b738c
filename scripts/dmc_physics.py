"""DeepMind Control's physics under the installed MuJoCo and dm_control, for comparing two installs.

    python scripts/dmc_physics.py [--tasks finger_spin,walker_walk,cartpole_swingup,ball_in_cup_catch]
        [--episodes 10]

Run it under each install (e.g. a virtual environment with `mujoco==3.1.1 dm-control==1.0.16`, the reference's
time, beside this project's pins) and compare the lines: a task whose model options, joint damping and
friction, and whose returns under the same seeded actions agree is not harder under one install than the
other. Per task: the model's solver options; the returns of 3 episodes of uniform random actions and 2 of a
smooth periodic open-loop action (the same actions under both installs); and for finger_spin the spinner's
speed under smooth random (autoregressive) actions over `--episodes` episodes, the quantity its reward
thresholds (1 at |hinge velocity| >= 15 rad/s).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("MUJOCO_GL", "disabled")  # physics only: no renderer

import mujoco  # noqa: E402
import numpy as np  # noqa: E402
from dm_control import suite  # noqa: E402

def load(task: str):
    """The suite's `domain_task` (e.g. ball_in_cup_catch), seeded. The script imports dm_control alone, not
    this project, so that it runs under another install (a virtual environment without torch)."""
    tasks = {f"{domain}_{name}": (domain, name) for domain, name in suite.ALL_TASKS}
    if task not in tasks:
        raise SystemExit(f"error: unknown task '{task}'; dm_control's suite has e.g. {', '.join(list(tasks)[:6])}")
    return suite.load(*tasks[task], task_kwargs={"random": 0})


def returns(env, episodes: int = 5) -> list[float]:
    """3 episodes of uniform random actions, then 2 of a smooth periodic action: the same under any install."""
    spec, rng, scores = env.action_spec(), np.random.default_rng(1), []
    for episode in range(episodes):
        step, score, t = env.reset(), 0.0, 0
        while not step.last():
            if episode < 3:
                action = rng.uniform(spec.minimum, spec.maximum)
            else:
                action = np.sin(0.05 * t + np.arange(spec.shape[0])) * spec.maximum
            step, t = env.step(action), t + 1
            score += step.reward
        scores.append(round(float(score), 3))
    return scores


def spinner_speeds(env, episodes: int) -> str:
    """finger_spin: the spinner's |hinge velocity| under smooth random actions (an AR(1) process)."""
    rng, speeds, score = np.random.default_rng(0), [], 0.0
    for _ in range(episodes):
        step, action = env.reset(), np.zeros(2)
        while not step.last():
            action = np.clip(0.9 * action + 0.45 * rng.standard_normal(2), -1, 1)
            step = env.step(action)
            score += step.reward
            speeds.append(abs(float(env.physics.named.data.sensordata["hinge_velocity"][0])))
    speeds = np.array(speeds)
    return (f"mean |hinge velocity| {speeds.mean():.3f}, 99th percentile {np.percentile(speeds, 99):.2f}, "
            f"steps at >= 15: {(speeds >= 15).mean():.2%}, return over {episodes} episodes {score:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="finger_spin,walker_walk,cartpole_swingup,ball_in_cup_catch")
    parser.add_argument("--episodes", type=int, default=10)
    args = parser.parse_args()
    from importlib.metadata import version

    print(f"mujoco {mujoco.__version__}, dm_control {version('dm_control')}")
    for task in args.tasks.split(","):
        env = load(task)
        model, opt = env.physics.model, env.physics.model.opt
        damping, friction = np.round(model.dof_damping, 4).tolist(), np.round(model.dof_frictionloss, 4).tolist()
        geoms = np.unique(np.round(model.geom_friction, 4), axis=0).tolist()
        print(f"{task}: timestep {opt.timestep}, solver {opt.solver}, iterations {opt.iterations}, cone {opt.cone}, "
              f"impratio {opt.impratio}, integrator {opt.integrator}; damping {damping}, friction loss {friction}, "
              f"geom friction {geoms}")
        print(f"{task}: returns {returns(env)}")
        if task == "finger_spin":
            print(f"{task}: {spinner_speeds(env, args.episodes)}")


if __name__ == "__main__":
    main()
