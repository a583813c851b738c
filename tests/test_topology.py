"""Device decisions for 0 / 1 / 2 / 4 / 8 visible GPUs (the count is passed in: no GPU is needed)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from dreamer.config import CONFIG_DIR
from dreamer.topology import resolve_topology


def _preset(name: str, **changes):
    cfg = OmegaConf.load(CONFIG_DIR / "topology" / f"{name}.yaml")
    return OmegaConf.merge(cfg, changes)


def _names(topology) -> tuple:
    return str(topology.learner), str(topology.inference), [str(d) for d in topology.render], topology.replay


@pytest.mark.parametrize("gpus, expected", [
    (0, ("cpu", "cpu", [], "host memory")),
    (1, ("cuda:0", "cuda:0", [], "pinned host memory")),
    (2, ("cuda:0", "cuda:1", [], "pinned host memory")),
    (4, ("cuda:0", "cuda:1", ["cuda:2", "cuda:3"], "pinned host memory")),
    (8, ("cuda:0", "cuda:1", [f"cuda:{i}" for i in range(2, 8)], "pinned host memory")),
])
def test_auto_follows_the_number_of_gpus(gpus, expected):
    topology = resolve_topology(_preset("auto"), gpus=gpus)
    assert _names(topology) == expected
    assert topology.name == ("cpu" if gpus == 0 else f"{gpus}gpu")
    assert topology.describe().startswith(f"topology {topology.name}: learner {expected[0]}")


def test_sweep_jobs_get_one_gpu_each():
    placed = [_names(resolve_topology(_preset("auto"), job=job, gpus=4))[:3] for job in range(6)]
    assert placed == [(f"cuda:{j % 4}", f"cuda:{j % 4}", []) for j in range(6)]
    assert _names(resolve_topology(_preset("auto"), job=3, gpus=0))[:2] == ("cpu", "cpu")


def test_presets_and_overrides():
    assert _names(resolve_topology(_preset("4gpu"), gpus=4))[:3] == ("cuda:0", "cuda:1", ["cuda:2", "cuda:3"])
    assert _names(resolve_topology(_preset("1gpu"), gpus=4))[:3] == ("cuda:0", "cuda:0", [])
    assert _names(resolve_topology(_preset("cpu"), gpus=4)) == ("cpu", "cpu", [], "host memory")
    # A CPU learner keeps inference on the CPU too, whatever the machine has.
    assert _names(resolve_topology(_preset("auto", learner="cpu"), gpus=2))[:2] == ("cpu", "cpu")
    assert "shared with the learner" in resolve_topology(_preset("1gpu"), gpus=1).describe()


@pytest.mark.parametrize("name, gpus, message", [
    ("4gpu", 2, "device cuda:2 does not exist: this machine has 2 CUDA device"),
    ("2gpu", 0, "device cuda:0 does not exist"),
])
def test_a_topology_the_machine_cannot_hold_fails_in_one_line(name, gpus, message):
    with pytest.raises(ValueError, match=message):
        resolve_topology(_preset(name), gpus=gpus)
    with pytest.raises(ValueError, match="must be auto or a list"):
        resolve_topology(_preset("auto", render="cuda:2"), gpus=4)


def test_the_devices_are_torch_devices():
    topology = resolve_topology(_preset("4gpu"), gpus=4)
    assert all(isinstance(d, torch.device) for d in (topology.learner, topology.inference, *topology.render))


@pytest.mark.parametrize("changes, message", [
    ({"learner": "tpu"}, "topology.learner='tpu' is not a device; use auto, cpu, cuda or cuda:N"),
    ({"learner": "cuda:x"}, "topology.learner='cuda:x' is not a device"),
    ({"learner": "cpu:1"}, "topology.learner='cpu:1' is not a device"),
    ({"learner": "mps"}, "topology.learner='mps' is not a device"),
    ({"learner": 0}, "topology.learner=0 is not a device"),
    ({"inference": "xla"}, "topology.inference='xla' is not a device"),
    ({"render": ["cuda:0", "vulkan"]}, r"topology.render\[1\]='vulkan' is not a device"),
])
def test_an_unknown_device_names_the_key_and_the_valid_forms(changes, message):
    with pytest.raises(ValueError, match=message):
        resolve_topology(_preset("auto", **changes), gpus=2)


def test_cuda_without_an_index_is_the_first_gpu():
    assert _names(resolve_topology(_preset("auto", learner="cuda", inference="cuda"), gpus=1))[:2] == (
        "cuda:0", "cuda:0")
