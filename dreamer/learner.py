"""The learner: DreamerV3's losses, LaProp-order optimizer with adaptive gradient clipping, slow critic.

One `update(batch)` = world-model loss, imagination, actor and critic losses, replay value loss,
backward, optimizer step and the soft update of the slow critic. At this stage the step is torchrl's
DreamerV3OptimizationStepper (compile and CUDA graph on request); metrics stay on the device and are
summed there until `drain()` reads them once per log period.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase
from torchrl.trainers.algorithms import DreamerV3OptimizationStepper, DreamerV3Optimizer

from dreamer.agent import Agent


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float = 4e-5
    eps: float = 1e-20
    agc: float = 0.3
    warmup: int = 1000
    beta1: float = 0.9
    beta2: float = 0.999


class Learner:
    def __init__(
        self,
        agent: Agent,
        optimizer: OptimizerSettings,
        device: torch.device,
        compile: bool = False,
        cudagraph: bool = False,
        bf16: bool = False,
    ):
        self.agent = agent
        self.device = torch.device(device)
        self.optimizer = DreamerV3Optimizer(
            agent.loss.parameters(),
            lr=optimizer.lr,
            agc=optimizer.agc,
            eps=optimizer.eps,
            beta1=optimizer.beta1,
            beta2=optimizer.beta2,
            warmup_steps=optimizer.warmup,
        )
        self.stepper = DreamerV3OptimizationStepper(
            agent.loss,
            self.optimizer,
            agent.slow_critic,
            compile_train_step=compile,
            cudagraph=cudagraph,
            mixed_precision=bf16,
        )
        self.needs_warmup = compile or cudagraph
        self.updates = 0
        self._sums: dict[str, torch.Tensor] = {}
        self._count = 0

    def warmup(self, batch: TensorDictBase) -> float:
        """Compiles / captures the step on a representative batch; returns the seconds it took."""
        if not self.needs_warmup:
            return 0.0
        start = time.perf_counter()
        self.stepper.warmup(batch)
        self.needs_warmup = False
        return time.perf_counter() - start

    def update(self, batch: TensorDictBase) -> TensorDictBase:
        """One update on batch [B, T]; writes the refreshed posterior to batch["replay_context"]."""
        metrics = self.stepper.step(None, batch)
        self.updates += 1
        self._count += 1
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.detach().reshape(())
                if key in self._sums:
                    self._sums[key] += value
                else:
                    self._sums[key] = value.clone().float()
        return batch

    def drain(self) -> dict[str, float]:
        """Mean of each metric since the last drain (one host read for all of them)."""
        if not self._count:
            return {}
        keys = sorted(self._sums)
        values = (torch.stack([self._sums[k] for k in keys]) / self._count).tolist()
        self._sums, self._count = {}, 0
        return {f"train/{k}": v for k, v in zip(keys, values)}

    def state_dict(self) -> dict:
        return {"loss": self.agent.loss.state_dict(), "stepper": self.stepper.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.agent.loss.load_state_dict(state["loss"])
        self.stepper.load_state_dict(state["stepper"])
        self.updates = int(state["updates"])
