"""Evaluation episodes with the policy's mode (no exploration noise)."""

from __future__ import annotations

import statistics

from dreamer.collect import Collector


def evaluate(collector: Collector, episodes: int) -> dict[str, float]:
    """Runs `episodes` episodes on the evaluation envs; returns the metrics record."""
    finished = collector.run_episodes(episodes)
    scores = [e.score for e in finished]
    return {
        "eval/return_mean": statistics.fmean(scores),
        "eval/return_min": min(scores),
        "eval/return_max": max(scores),
        "eval/length_mean": statistics.fmean(e.length for e in finished),
        "eval/episodes": len(finished),
    }
