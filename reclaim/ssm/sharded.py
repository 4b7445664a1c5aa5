"""Fully sharded data parallel for `ssm-train` (`sharding: fsdp`): FSDP's memory layout, on
torch.distributed's collectives.

Each rank keeps 1/W of every parameter (its flat, zero-padded slice: the master weights AdamW
updates), so the optimizer state and the gradients that reach it are 1/W per rank too. A step
gathers the full parameters (all-gather), computes its gradients with any grad_mode, reduce-
scatters their mean onto the slices and frees the full parameters and gradients again; between
steps a rank holds only its slices. The data plan is data parallel's ("none"): rank r takes its
own batches, so W ranks equal one process accumulating their batches.

Not FSDP2's `fully_shard`: its all-gather and reduce-scatter hang on the hooks of a module's
`forward` and of the autograd graph that forward builds, and the adjoint runs each layer's
pieces (`forward_chunk`, per-chunk `autograd.backward` and vector-Jacobian products) outside any
module's forward, accumulating `.grad` across many partial backwards. Here the gather and the
scatter are explicit, around the whole step, so every grad_mode is sharded alike.

Checkpoints hold the full model (HF layout) and the full AdamW state in the unsharded trainer's
format (`optimizer.pt`), so a run resumes at any world size, and with or without sharding.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class ShardedParams:
    """The slices of `params` this rank owns (`shards`, what the optimizer steps on) and the
    gathers and scatters between them and the full parameters the model computes with."""

    def __init__(self, params: list[nn.Parameter], rank: int, world: int, group=None) -> None:
        self.params, self.rank, self.world, self.group = params, rank, world, group
        self.sizes = [math.ceil(p.numel() / world) for p in params]
        self.shapes = [p.shape for p in params]
        self.shards = [nn.Parameter(self._slice(p.detach(), n).clone()) for p, n in zip(params, self.sizes)]
        self.release()

    def _slice(self, full: torch.Tensor, n: int) -> torch.Tensor:
        """This rank's n values of `full`, flattened and zero-padded to n * world."""
        return self._padded(full, n)[self.rank * n: (self.rank + 1) * n]

    def gather(self) -> None:
        """Every parameter full again, from every rank's slice (its values after the last step)."""
        for i, (p, shard) in enumerate(zip(self.params, self.shards)):
            p.data = self._full(shard.detach(), i)

    def release(self) -> None:
        """Free the full parameters and their gradients: a rank keeps only its slices."""
        for p in self.params:
            p.data = p.data.new_empty(0)
            p.grad = None

    def reduce_gradients(self, loss: float) -> float:
        """Each slice's gradient = the mean over ranks of the full gradient's slice (reduce-
        scatter); returns the mean loss. The full gradients are then freed with the parameters."""
        for p, shard, n in zip(self.params, self.shards, self.sizes):
            grad = torch.zeros_like(p) if p.grad is None else p.grad
            mine = shard.new_empty(n)
            dist.reduce_scatter_tensor(mine, self._padded(grad, n), group=self.group)
            shard.grad = mine / self.world
        total = torch.tensor([loss], dtype=torch.float64, device=self.shards[0].device)
        dist.all_reduce(total, group=self.group)
        self.release()
        return total.item() / self.world

    def _padded(self, full: torch.Tensor, n: int) -> torch.Tensor:
        """`full` flattened (detached) and zero-padded to n * world values."""
        flat = full.detach().reshape(-1)
        if flat.numel() < n * self.world:
            flat = torch.cat([flat, flat.new_zeros(n * self.world - flat.numel())])
        return flat

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """The full parameters for the duration (every rank enters), e.g. to write a checkpoint."""
        self.gather()
        try:
            yield
        finally:
            self.release()

    def _full(self, shard: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's full tensor (its shape) from every rank's slice `shard` of it."""
        out = shard.new_empty(self.sizes[i] * self.world)
        dist.all_gather_into_tensor(out, shard.contiguous(), group=self.group)
        return out[: math.prod(self.shapes[i])].view(self.shapes[i])

    def full_optimizer_state(self, opt: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state dict as one process over the full parameters would hold it
        (every rank enters; its tensors gathered from the slices)."""
        sd = opt.state_dict()
        state = {}
        for i, s in sd["state"].items():
            state[i] = {k: self._full(v, i) if torch.is_tensor(v) and v.dim() == 1 else v for k, v in s.items()}
        return {"state": state, "param_groups": sd["param_groups"]}

    def load_full_optimizer_state(self, opt: torch.optim.Optimizer, full: dict[str, Any]) -> None:
        """Load an unsharded optimizer state dict (this class's, or the unsharded trainer's): each
        rank keeps its slices of the per-parameter tensors."""
        state = {}
        for i, s in full["state"].items():
            i = int(i)
            state[i] = {k: self._slice(v, self.sizes[i]).clone() if torch.is_tensor(v) and v.dim() > 0 else v
                        for k, v in s.items()}
        opt.load_state_dict({"state": state, "param_groups": full["param_groups"]})
