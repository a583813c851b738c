"""What a run's agent believes against what happens: the checks of a learning shortfall, from a checkpoint.

    python scripts/diagnose_learning.py RUN_DIR [--checkpoint PATH] [--episodes 2] [--horizon 15]
        [--out FILE.json]

Loads the run's config and newest checkpoint (as `python -m dreamer.evaluate` does), plays `--episodes`
episodes with the training policy (sampled actions, as collection acts), and compares on them:

- **values**: the critic's value of each posterior state against the real discounted return from it
  (discount 1 - 1/horizon; only states at least 700 steps before the episode's end, where the cut-off
  changes the real return by under 12 %: that many discounts of 0.997 leave 0.12); and over every state,
  with the return's part past the episode's end (a time limit, which the critic bootstraps over) filled in
  at the episode's mean reward per step (shorter episodes, e.g. DMC's 500 steps at action repeat 2);
- **open-loop rewards**: from posterior states along the episodes, the prior rolled forward with the
  episode's real actions for `--horizon` steps: the predicted rewards against the real ones, per step ahead;
- **imagination against reality**: from the same states, the actor acting in the model for `--horizon`
  steps (as the learner imagines): the imagined reward per step against the real reward per step the
  same policy earned in the env from there (a model the actor exploits promises more than it gives);
- **the actor**: its standard deviations and entropy on the real states, and the return normalization's
  scale the learner divides advantages by.

Prints one line per check and writes them as JSON (default: RUN_DIR/diagnosis-<env steps>.json).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchrl.modules.models.model_based import _default_bins  # noqa: E402

from dreamer.losses import TwoHot  # noqa: E402

SEED = 3_000_000  # added to the run's seed: the diagnosis's env draws neither training's nor evaluation's episodes
DISCOUNT_TAIL = 700  # steps before an episode's end a state must be for the value check


@torch.no_grad()
def posterior(networks, records: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The world model's posterior (state, belief) after each record's observation, [T, ...]."""
    sequence = torch.stack(records).unsqueeze(0)
    seen = networks.world_model(sequence)
    return seen.get(("next", "state"))[0], seen.get(("next", "belief"))[0]


def discounted_returns(rewards: torch.Tensor, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per state t of an episode (rewards [T]: r[t] arrived with o[t]): the real discounted return after it,
    r[t+1] + gamma r[t+2] + ... + gamma^(n-1) r[T-1] (n rewards), and the same with its tail past the
    episode's end (a time limit, which the critic bootstraps over) filled in at the episode's mean reward
    per step, + gamma^n mean / (1 - gamma): an estimate that holds where the policy earns at a steady rate."""
    steps = len(rewards)
    real = torch.zeros(steps)
    running = torch.zeros(())
    for t in range(steps - 2, -1, -1):
        running = rewards[t + 1] + gamma * running
        real[t] = running
    after = torch.arange(steps - 1, -1, -1).float()  # n: the rewards after state t
    rate = rewards[1:].mean() if steps > 1 else torch.zeros(())
    return real, real + gamma ** after * rate / (1 - gamma)


def return_scale(learner: dict) -> float:
    """The actor's advantage scale when the checkpoint was written, max(1, high - low) of the return
    normalizer's percentiles (learner state format 2, or format 1's torchrl loss buffers)."""
    if "return_norm" in learner:
        low, high = learner["return_norm"]["low"], learner["return_norm"]["high"]
    else:
        loss = learner["loss"]
        low, high = (next(v for k, v in loss.items() if k.endswith(f"retnorm.{end}")) for end in ("low", "high"))
    return max(1.0, float((high - low).reshape(-1)[0]))


@torch.no_grad()
def analyse(agent, two_hot: str, records: list, horizon: int, gamma: float, stride: int = 25) -> dict:
    """The checks on one episode's records (record t: the carry before o[t], a[t-1], and o[t], r[t])."""
    networks = agent.networks
    heads = TwoHot(_default_bins(agent.size.bins), two_hot)  # as the run's learner read them
    states, beliefs = posterior(networks, records)
    rewards = torch.stack([r.get(("next", "reward")).reshape(()) for r in records]).float()
    actions = torch.stack([r.get("action") for r in records]).float()  # actions[t] = a[t-1]
    steps = len(records)
    out: dict = {"steps": steps, "return": float(rewards.sum())}

    # The reward head on the posterior (each observation seen): the model's reward error without its
    # dynamics. State t follows o[t] and predicts r[t].
    seen = heads.mean(networks.reward_head(states, beliefs))
    out["posterior_reward_per_step"], out["episode_reward_per_step"] = float(seen[1:].mean()), float(rewards[1:].mean())

    values = heads.mean(networks.critic_head(states, beliefs))
    real, filled = discounted_returns(rewards, gamma)
    far = max(steps - DISCOUNT_TAIL, 0)
    if far:
        out["value_mean"], out["real_return_mean"] = float(values[:far].mean()), float(real[:far].mean())
    if steps > 2:
        out["value_mean_all"], out["real_return_filled_mean"] = float(values[:-1].mean()), float(filled[:-1].mean())

    starts = list(range(1, steps - horizon - 1, stride))
    if starts:
        index = torch.tensor(starts)
        s, b = states[index], beliefs[index]
        predicted, errors = [], []
        for k in range(1, horizon + 1):  # prior step with the real action a[t+k-1] (stored in record t+k)
            _, s, b = networks.prior(s, b, actions[index + k])
            guess = heads.mean(networks.reward_head(s, b))
            predicted.append(guess)
            errors.append((guess - rewards[index + k]).abs().mean())
        real_sums = torch.stack([rewards[index + k] for k in range(1, horizon + 1)]).sum(0)
        out["open_loop_reward_abs_error_by_step"] = [round(float(e), 4) for e in errors]
        out["open_loop_reward_sum"] = float(torch.stack(predicted).sum(0).mean())
        out["real_reward_sum"] = float(real_sums.mean())

        s, b = states[index], beliefs[index]
        imagined = []
        for _ in range(horizon):  # the actor's sampled actions, as the learner's imagination draws them
            if agent.layout.discrete:
                logits = networks.actor_net(s, b)  # log-probabilities
                action = torch.nn.functional.one_hot(torch.distributions.Categorical(logits=logits).sample(),
                                                     logits.shape[-1]).float()
            else:
                mean, std = networks.actor_net(s, b)
                action = mean + std * torch.randn_like(mean)
            _, s, b = networks.prior(s, b, action)
            imagined.append(heads.mean(networks.reward_head(s, b)))
        out["imagined_reward_per_step"] = float(torch.stack(imagined).mean())
        out["real_reward_per_step"] = float(real_sums.mean() / horizon)

    if not agent.layout.discrete:
        mean, std = networks.actor_net(states, beliefs)
        out["actor_std_mean"] = float(std.mean())
        out["actor_entropy"] = float(torch.distributions.Normal(mean, std).entropy().sum(-1).mean())
    else:
        logits = networks.actor_net(states, beliefs)
        out["actor_entropy"] = float(torch.distributions.Categorical(logits=logits).entropy().mean())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: the run's newest checkpoint")
    parser.add_argument("--episodes", type=int, default=2)
    parser.add_argument("--horizon", type=int, default=15, help="steps ahead of the open-loop and imagined checks")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.getLogger("torchrl").setLevel(logging.WARNING)

    from dreamer.collect import Collector
    from dreamer.envs import make_env
    from dreamer.evaluate import RunError, load_run

    if args.episodes < 1 or args.horizon < 1:
        print("error: --episodes and --horizon must be at least 1", file=sys.stderr)
        return 2
    try:  # on the CPU: the checks below step one env and run the networks on single records
        cfg, settings, state, path, env, layout, agent = load_run(args.run_dir, args.checkpoint, SEED, "cpu")
    except RunError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # one record at a time: more threads only contend (as in dreamer.evaluate)
    agent.networks.trained.eval()
    gamma = 1 - 1 / float(cfg.loss.horizon)
    collector = Collector([env], lambda i: make_env(cfg.env, cfg.seed + SEED), agent.policy, layout,
                          settings.size, "cpu", explore=True, suite=cfg.env.suite)
    collector.reset()
    episodes, current = [], []
    while len(episodes) < args.episodes:
        record, ended = collector.step()
        current.append(record[0])
        if ended:
            episodes.append(current)
            current = []
    collector.close()
    results = [analyse(agent, settings.loss.two_hot, records, args.horizon, gamma) for records in episodes]
    summary = {"checkpoint": str(path), "env_steps": state["step"], "episodes": results,
               "return_scale": return_scale(state["learner"])}
    out = args.out or args.run_dir / f"diagnosis-{state['step']:012d}.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")

    def mean(key):
        values = [r[key] for r in results if key in r]
        return sum(values) / len(values) if values else float("nan")

    print(f"{len(results)} episodes from {path.name} (env step {state['step']:,}), sampled actions: "
          f"return {mean('return'):.1f}")
    if any("value_mean" in r for r in results):
        print(f"values: critic {mean('value_mean'):.2f} against the real discounted return "
              f"{mean('real_return_mean'):.2f} (states {DISCOUNT_TAIL} steps or more before the episode's end)")
    else:  # e.g. a 1,000-frame episode at action repeat 2 has 500 steps
        print(f"values: no state {DISCOUNT_TAIL} steps before an episode's end, where the real discounted return "
              f"is cut off by under 12 %")
    if any("value_mean_all" in r for r in results):
        print(f"values, every state: critic {mean('value_mean_all'):.2f} against the real discounted return "
              f"{mean('real_return_filled_mean'):.2f} (its part past the episode's end at the episode's mean reward)")
    print(f"reward head on the posterior (observations seen): {mean('posterior_reward_per_step'):.4f} per step "
          f"against real {mean('episode_reward_per_step'):.4f}")
    print(f"open loop, {args.horizon} steps with the real actions: predicted reward sum "
          f"{mean('open_loop_reward_sum'):.3f} against real {mean('real_reward_sum'):.3f}")
    print(f"imagination against reality: {mean('imagined_reward_per_step'):.4f} reward per step imagined, "
          f"{mean('real_reward_per_step'):.4f} earned")
    print(f"actor: entropy {mean('actor_entropy'):.2f}"
          + (f", std {mean('actor_std_mean'):.3f}" if not layout.discrete else "")
          + f"; return scale {summary['return_scale']:.3f}")
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
