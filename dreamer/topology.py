"""Which device does what, from the number of visible GPUs or an explicit `topology=...`.

At this stage only the learner's device is placed (collection is synchronous, acting on that device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig


@dataclass(frozen=True)
class Topology:
    name: str
    learner: torch.device


def _device(spec: str) -> torch.device:
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"'{spec}' is not a device; use cpu or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if device.index is None else device.index
        if index >= count:
            raise ValueError(
                f"device {spec} does not exist: this machine has {count} CUDA device(s); "
                "use topology=cpu or topology=auto"
            )
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ValueError(f"device {spec} is not supported; use cpu or cuda:N")
    return device


def resolve_topology(cfg: DictConfig) -> Topology:
    learner = cfg.learner
    if learner == "auto":
        learner = "cuda:0" if torch.cuda.is_available() else "cpu"
    device = _device(str(learner))
    name = cfg.name if cfg.name != "auto" else ("1gpu" if device.type == "cuda" else "cpu")
    return Topology(name=name, learner=device)
