"""GRPO's process group: N rollout workers that train the policy data parallel (torchrun).

`World.start` reads torchrun's RANK / WORLD_SIZE / LOCAL_RANK and starts a gloo (CPU) or NCCL
(CUDA) group; without torchrun it is rank 0 of 1 and every collective is the identity, so one
process is the N = 1 case of the same code.

The policy trains under torch's DistributedDataParallel (`World.data_parallel`): each rank holds
the whole model and optimizer, accumulates its micro-batches under `no_sync()` and DDP reduces
the gradients once per optimizer step, while the last micro-batch's backward runs. DDP averages
by default; GRPO's losses are already normalised to the global batch, so a comm hook sums
instead, the arithmetic of one process accumulating every rank's micro-batches. Every rank then
takes the same optimizer step, so the replicas never drift and the rollout engine reads full
weights from the plain module (`.module`). With `parallelism: fsdp` the policy is sharded instead
(reclaim/fsdp.py, FSDP2's `fully_shard`, also on gloo): each rank holds 1/N of it, its gradients
and optimizer state, and every rank gathers the full weights for its engine after each step.

With `rollout_tensor_parallel_size` N the world is also split into W/N rollout groups of N
consecutive ranks (`World.rollout_group`): a group shares one tensor-parallel engine, its first
rank (the leader) rolling out the group's share of the prompts while the others run the leader's
forwards on their shards. Training is unchanged: every rank trains on its micro-batches.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class World:
    """This process's place among the rollout workers (rank 0 of 1 without torchrun)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    started: bool = False  # the group was started here (and is destroyed by close)
    device: torch.device = torch.device("cpu")  # where collectives run (nccl: this rank's GPU)
    rollout_tp: int = 1  # ranks of a tensor-parallel rollout group (rollout_group)
    groups: list[Any] = field(default_factory=list, repr=False)  # made by rollout_group; close destroys them

    @classmethod
    def start(cls, device: str | torch.device = "cpu") -> "World":
        """Join torchrun's group (gloo on the CPU, nccl on CUDA: "cuda" means cuda:LOCAL_RANK);
        rank 0 of 1 without torchrun."""
        env = os.environ
        world = cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))
        device = torch.device(device)
        if device.type == "cuda":
            world.device = device if device.index is not None or world.size == 1 else \
                torch.device("cuda", world.local_rank)
            torch.cuda.set_device(world.device)
        if world.size == 1:
            return world
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            world.started = True
        return world

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_rollout_leader(self) -> bool:
        """Whether this rank drives its rollout group's engine (every rank without TP rollouts)."""
        return self.rank % self.rollout_tp == 0

    def close(self) -> None:
        import torch.distributed as dist

        for group in self.groups:
            dist.destroy_process_group(group)
        self.groups = []
        if self.started:
            dist.destroy_process_group()
            self.started = False

    def rollout_group(self, size: int) -> tuple[Any, Any] | None:
        """Split the world into tensor-parallel rollout groups of `size` consecutive ranks (group g:
        ranks [g * size, (g + 1) * size), its first rank the leader) and return this rank's group
        and a gloo group over the same ranks for the engine's step messages; None at size 1.
        Every rank makes every group, in the same order, as torch.distributed requires."""
        if size < 1 or self.size % size:
            raise ValueError(f"rollout groups of {size} ranks do not tile a world of {self.size}")
        self.rollout_tp = size
        if size == 1:
            return None
        import torch.distributed as dist

        mine = None
        for first in range(0, self.size, size):
            ranks = list(range(first, first + size))
            made = dist.new_group(ranks), dist.new_group(ranks, backend="gloo")
            if self.rank in ranks:
                mine = made
                self.groups += made
        return mine

    def share(self, n: int) -> range:
        """This rank's contiguous share of n items to roll out (rank order is item order; shares
        differ by <= 1). With rollout groups, the share of this rank's group on its leader and an
        empty one on the other ranks (they run the leader's forwards)."""
        parts, part = self.size // self.rollout_tp, self.rank // self.rollout_tp
        start, end = part * n // parts, (part + 1) * n // parts
        return range(start, end) if self.is_rollout_leader else range(start, start)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank (pickled)."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any, src: int) -> Any:
        """Rank src's `obj` on every rank (pickled)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def broadcast_tensors(self, tensors: Iterable[torch.Tensor], src: int) -> None:
        """Overwrite each tensor (same shapes on every rank) with rank src's, in place."""
        if self.size == 1:
            return
        import torch.distributed as dist

        with torch.no_grad():
            for t in tensors:
                dist.broadcast(t.data, src=src)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce t in place (sum over ranks); returns it."""
        if self.size > 1:
            import torch.distributed as dist

            buf = t.to(self.device)  # nccl reduces GPU tensors only
            dist.all_reduce(buf)
            if buf is not t:
                t.copy_(buf)
        return t

    def data_parallel(self, model: torch.nn.Module) -> torch.nn.Module:
        """The policy to train: `model` under DDP summing gradients over ranks (one process: itself).
        Its `.module` is `model`, whose weights the optimizer updates."""
        if self.size == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device] if self.device.type == "cuda" else None
        # Buffers (RoPE frequencies) are computed alike on every rank: no broadcast before each
        # forward. torch 2.13 renamed broadcast_buffers to forward_sync_buffers.
        no_sync_buffers = {"forward_sync_buffers" if "forward_sync_buffers" in
                           inspect.signature(DistributedDataParallel).parameters else "broadcast_buffers": False}
        ddp = DistributedDataParallel(model, device_ids=ids, **no_sync_buffers)
        ddp.register_comm_hook(None, _sum_hook)
        return ddp

    def signal_done(self) -> "DoneSignal":
        """Say this rank is done (non-blocking); the signal completes once every rank has said so."""
        return DoneSignal(self)

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier()


def accumulating(model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """Around a micro-batch's forward and backward: DDP's `no_sync()` (FSDP2's gradient sync
    switched off) unless it is the optimizer step's last, so the gradients are reduced once per step."""
    from torch.nn.parallel import DistributedDataParallel

    from reclaim import fsdp

    if fsdp.is_sharded(model):
        return fsdp.accumulating(model, last)
    return model.no_sync() if isinstance(model, DistributedDataParallel) and not last else contextlib.nullcontext()


def _sum_hook(group, bucket):  # noqa: ANN001 - DDP refuses string annotations (this module's __future__)
    """DDP comm hook: the bucket's gradients summed over ranks (DDP's own hook divides by the size)."""
    import torch.distributed as dist

    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class DoneSignal:
    """A non-blocking all-reduce every rank posts when it finishes its rollout share: a rank
    that finished early polls `all_done()` between drafter steps, which turns true when the
    slowest rank has posted too. One process: done at once."""

    def __init__(self, world: World) -> None:
        self._work, self._first = None, True
        if world.size > 1:
            import torch.distributed as dist

            self._flag = torch.zeros(1, device=world.device)
            self._work = dist.all_reduce(self._flag, async_op=True)

    def all_done(self, grace_s: float = 0.05) -> bool:
        """Whether every rank is done. The first call waits up to grace_s for the answer, so the
        slowest rank (whose post completes the signal) does not start a drafter step while its
        own post is still on the wire; an early rank spends that wait idle anyway."""
        if self._work is None:
            return True
        end = time.perf_counter() + (grace_s if self._first else 0.0)
        self._first = False
        while not self._work.is_completed():
            if time.perf_counter() >= end:
                return False
            time.sleep(0.001)
        return True

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
