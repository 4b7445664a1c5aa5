"""The policy's state in host memory while the rollout runs (verl's `param_offload` and
`optimizer_offload`): the engine then has the device to itself for its weights and K/V.

Before a rollout `to_host` moves the policy's parameters (this rank's FSDP2 shards, or the DDP
replica) and AdamW's moments to host memory; the parameters come back right after the rollout
(the old policy's log-probs and the training forwards need them), the moments only just before
the optimizer step, so they are off the device through the micro-batches' forwards and
backwards too. Parameters move with `module.to`, which FSDP2 follows (it re-points its shards).
Each move is counted (`bytes`, `seconds`) and logged per step as offload/*; `reclaim plan`
prices them at a host link's bandwidth. On a CPU the host is the device: every move is a no-op
(`.to` returns the tensor itself) and only the bookkeeping runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from reclaim.fsdp import local_bytes, optimizer_tensors

HOST = torch.device("cpu")


@dataclass
class Offload:
    """What moves to host memory while rolling out, and the moves so far (bytes and seconds, both ways)."""

    params: bool = False
    optimizer: bool = False
    device: torch.device = HOST  # where training runs
    bytes_moved: int = 0
    seconds: float = 0.0
    on_host: set[str] = field(default_factory=set)  # "params", "optimizer": now in host memory

    @property
    def enabled(self) -> bool:
        return self.params or self.optimizer

    def to_host(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Before a rollout: the parameters and / or the optimizer's moments to host memory."""
        if self.params and "params" not in self.on_host:
            self._move(lambda: _move_module(model, HOST), local_bytes(model.parameters()))
            self.on_host.add("params")
        self.optimizer_to_host(optimizer)

    def optimizer_to_host(self, optimizer: torch.optim.Optimizer) -> None:
        """The moments to host memory (before a rollout, or right after the optimizer step when
        the engine wakes then: enable_sleep_mode)."""
        if self.optimizer and "optimizer" not in self.on_host:
            self._move(lambda: _move_state(optimizer, HOST), local_bytes(optimizer_tensors(optimizer)))
            self.on_host.add("optimizer")

    def params_to_device(self, model: nn.Module) -> None:
        """After a rollout: the parameters back for the forwards."""
        if "params" in self.on_host:
            self._move(lambda: _move_module(model, self.device), local_bytes(model.parameters()))
            self.on_host.discard("params")

    def optimizer_to_device(self, optimizer: torch.optim.Optimizer) -> None:
        """Before the optimizer step: its moments back."""
        if "optimizer" in self.on_host:
            self._move(lambda: _move_state(optimizer, self.device), local_bytes(optimizer_tensors(optimizer)))
            self.on_host.discard("optimizer")

    def take(self) -> dict[str, float]:
        """The moves since the last call, as log entries (offload/bytes, offload/s); then reset."""
        out = {"offload/bytes": self.bytes_moved, "offload/s": self.seconds}
        self.bytes_moved, self.seconds = 0, 0.0
        return out

    def _move(self, move, nbytes: int) -> None:  # noqa: ANN001 - a thunk
        t0 = time.perf_counter()
        move()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - t0
        self.bytes_moved += nbytes


def _move_module(model: nn.Module, device: torch.device) -> None:
    with torch.no_grad():
        model.to(device)


def _move_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim():
                state[k] = v.to(device)
