"""Mean return of a uniformly random policy, the floor a trained agent must clear.

    python scripts/random_return.py [SUITE] [TASK] [EPISODES]      # defaults: gym CartPole-v1 100
"""

from __future__ import annotations

import statistics
import sys

import torch
from omegaconf import OmegaConf

from dreamer.envs import make_env


def main() -> None:
    suite, task, episodes = (sys.argv[1:] + ["gym", "CartPole-v1", "100"][len(sys.argv) - 1:])[:3]
    env = make_env(OmegaConf.create({"suite": suite, "task": task, "max_episode_steps": 1000}), seed=0)
    torch.manual_seed(0)
    scores = []
    for _ in range(int(episodes)):
        td, score = env.reset(), 0.0
        while True:
            td = env.rand_step(td)
            score += float(td.get(("next", "reward")))
            if bool(td.get(("next", "done"))):
                break
            td = td.get("next")
        scores.append(score)
    print(f"{suite} {task}: random policy mean return {statistics.fmean(scores):.1f} "
          f"(std {statistics.pstdev(scores):.1f}) over {len(scores)} episodes")


if __name__ == "__main__":
    main()
