"""Which device does what, from the number of visible GPUs or an explicit `topology=...`.

| GPUs      | learner | inference server            | env rendering  | replay             |
|-----------|---------|-----------------------------|----------------|--------------------|
| 0         | cpu     | cpu                         | cpu            | host memory        |
| 1         | cuda:0  | cuda:0 (own thread/stream)  | cpu            | pinned host memory |
| 2         | cuda:0  | cuda:1                      | cpu            | pinned host memory |
| n >= 3    | cuda:0  | cuda:1                      | cuda:2..n-1    | pinned host memory |

In a multirun (`-m`), `auto` gives each job one GPU, job number mod GPU count, for all of its parts, so
the parallel jobs of a joblib sweep on one node never share a GPU. The learner uses one GPU; a
data-parallel learner over several is not built.

The learner's device trains, and acts too with `run.collect=inline`; with `run.collect=workers` the
inference server runs on the inference device (in its own process when that is a GPU of its own, see
`dreamer.collect.start_workers`). Rendering devices are decided and printed, not used yet.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, ListConfig


@dataclass(frozen=True)
class Topology:
    name: str
    learner: torch.device
    inference: torch.device
    render: tuple[torch.device, ...]  # GPUs env workers render on, round-robin; () = on the CPU

    @property
    def replay(self) -> str:
        return "pinned host memory" if self.learner.type == "cuda" else "host memory"

    def describe(self) -> str:
        render = ", ".join(str(d) for d in self.render) or "cpu"
        shared = " (shared with the learner)" if self.inference == self.learner and self.learner.type == "cuda" else ""
        return (f"topology {self.name}: learner {self.learner}, inference {self.inference}{shared}, "
                f"env rendering {render}, replay in {self.replay}")


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


DEVICE_FORMS = "cpu, cuda or cuda:N"


def _device(key: str, spec, gpus: int) -> torch.device:
    """The device `spec` names; ValueError (one line naming `key`) for anything but cpu, cuda, cuda:N."""
    match = re.fullmatch(r"(cpu|cuda)(?::(\d+))?", str(spec).strip())
    if match is None or (match.group(1) == "cpu" and match.group(2) is not None):
        raise ValueError(f"{key}={spec!r} is not a device; use auto, {DEVICE_FORMS}")
    if match.group(1) == "cpu":
        return torch.device("cpu")
    index = int(match.group(2) or 0)
    if index >= gpus:
        raise ValueError(
            f"{key}: device cuda:{index} does not exist: this machine has {gpus} CUDA device(s); "
            "use topology=cpu or topology=auto"
        )
    return torch.device("cuda", index)


def sweep_job_number() -> int | None:
    """The job number inside a Hydra multirun, None otherwise."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        config = HydraConfig.get()
        return int(config.job.num) if config.mode == RunMode.MULTIRUN else None
    except (ValueError, ImportError, AttributeError):  # not inside a Hydra job
        return None


def plan(gpus: int, job: int | None = None) -> tuple[str, str, list[str]]:
    """(learner, inference, render devices) for `gpus` visible GPUs; `job` = the multirun job number."""
    if gpus == 0:
        return "cpu", "cpu", []
    if job is not None:
        device = f"cuda:{job % gpus}"
        return device, device, []
    if gpus == 1:
        return "cuda:0", "cuda:0", []
    return "cuda:0", "cuda:1", [f"cuda:{i}" for i in range(2, gpus)]


def resolve_topology(cfg: DictConfig, job: int | None = None, gpus: int | None = None) -> Topology:
    """The topology config's devices, with every `auto` filled in from `plan`; ValueError names the key."""
    gpus = visible_gpus() if gpus is None else gpus
    learner, inference, render = plan(gpus, job)
    if cfg.learner != "auto":
        learner = cfg.learner
    learner = _device("topology.learner", learner, gpus)
    chosen = cfg.get("inference", "auto")
    if chosen != "auto":
        inference = chosen
    elif learner.type == "cpu":
        inference = "cpu"
    inference = _device("topology.inference", inference, gpus)
    chosen = cfg.get("render", "auto")
    if chosen != "auto":
        if not isinstance(chosen, (list, tuple, ListConfig)):
            raise ValueError(f"topology.render must be auto or a list of devices ({DEVICE_FORMS}), got {chosen!r}")
        render = list(chosen)
    render = tuple(_device(f"topology.render[{i}]", d, gpus) for i, d in enumerate(render))
    name = cfg.name
    if name == "auto":
        name = "cpu" if learner.type == "cpu" else f"{gpus}gpu" if job is None else "1gpu-per-job"
    return Topology(name, learner, inference, render)
