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


def sweep_job_number() -> int | None:
    """The job number inside a Hydra multirun, None otherwise."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        config = HydraConfig.get()
        return int(config.job.num) if config.mode == RunMode.MULTIRUN else None
    except (ValueError, ImportError, AttributeError):  # not inside a Hydra job
        return None


def resolve_topology(cfg: DictConfig, job: int | None = None) -> Topology:
    """`auto` puts the learner on cuda:0, or in a sweep on GPU (job number mod GPU count), so parallel
    jobs of a joblib sweep on one node each get their own GPU."""
    learner = cfg.learner
    if learner == "auto":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        learner = f"cuda:{(job or 0) % count}" if count else "cpu"
    device = _device(str(learner))
    name = cfg.name if cfg.name != "auto" else ("1gpu" if device.type == "cuda" else "cpu")
    return Topology(name=name, learner=device)
