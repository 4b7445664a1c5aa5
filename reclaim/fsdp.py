"""FSDP2 applied to a model from outside it (torchtitan's `parallelize`): the model file stays plain.

`parallelize(model, mesh)` wraps each decoder layer, then the whole model (the root: embeddings,
final norm, LM head), with `fully_shard`: every rank holds 1/N of each parameter (dim 0, the
chunks `torch.chunk` makes), gathers a layer's full weights just before it runs and frees them
after (`reshard_after_forward`). Gradients are reduce-scattered and summed, not averaged: the
trainers' losses are already normalised to the whole step, so the sum is the arithmetic of one
process accumulating every rank's micro-batches. `bf16` is FSDP's mixed precision (bf16 compute,
float32 gradient reduction, the sharded weights and the optimizer in their own dtype);
`cpu_offload` keeps the shards and the optimizer state in host memory.

`shard_bytes` is the same sharding as arithmetic, for `reclaim plan`; tests check it equals what
`fully_shard` gives at world size N on a fake process group.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

PARALLELISMS = ("ddp", "fsdp")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The blocks FSDP wraps one by one: `model.model.layers` (the Llama family) or
    `model.backbone.layers` (Mamba); any other model is refused naming its class."""
    for owner in ("model", "backbone"):
        layers = getattr(getattr(model, owner, None), "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers):
            return list(layers)
    raise ValueError(f"parallelism 'fsdp' shards a model by its decoder layers (model.layers or backbone.layers); "
                     f"{type(model).__name__} has neither: use parallelism 'ddp'")


def parallelize(model: nn.Module, mesh: Any, *, bf16: bool = False, cpu_offload: bool = False,
                reshard_after_forward: bool = True, gradient_checkpointing: bool = False) -> nn.Module:
    """Shard `model` in place over `mesh` (a 1-D DeviceMesh): each decoder layer, then the root.
    Returns it (now an FSDPModule); build the optimizer over its parameters afterwards."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    layers = decoder_layers(model)
    if gradient_checkpointing:
        checkpoint_layers(model)
        layers = decoder_layers(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    kw = {"mesh": mesh, "mp_policy": mp, "offload_policy": offload}
    for i, layer in enumerate(layers):
        # The last layer's weights are needed again at once by the backward: keep them (torchtitan).
        fully_shard(layer, reshard_after_forward=reshard_after_forward and i < len(layers) - 1, **kw)
    fully_shard(model, reshard_after_forward=False, **kw)  # the root: embeddings, norm, head
    for m in (*layers, model):
        m.set_gradient_divide_factor(1.0)  # summed over ranks (the losses are normalised to the step)
        m.set_force_sum_reduction_for_comms(True)  # a plain SUM: float32's PREMUL_SUM(1.0) is NCCL-only
    return model


def checkpoint_layers(model: nn.Module) -> None:
    """transformers' gradient_checkpointing: each decoder layer keeps only its input for the
    backward and reruns its forward there (state-dict names unchanged)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for owner in ("model", "backbone"):
        layers = getattr(getattr(model, owner, None), "layers", None)
        if isinstance(layers, nn.ModuleList):
            for i, layer in enumerate(layers):
                layers[i] = checkpoint_wrapper(layer)
            return
    decoder_layers(model)  # raises naming the model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def accumulating(model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """Around a micro-batch's forward and backward: FSDP reduce-scatters gradients only on the
    optimizer step's last micro-batch (the others accumulate unsharded gradients locally)."""
    if not is_sharded(model):
        return contextlib.nullcontext()
    model.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float) -> float:
    """torch's clip_grad_norm_ over plain or sharded (DTensor) gradients; the total norm over ranks."""
    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


class FullWeights(Mapping):
    """A sharded model's state dict, each tensor gathered whole when read (every rank reads the
    same names in the same order: each read is an all-gather). `keep` False: this rank takes part
    in the gathers but is handed nothing to hold (a rank without a rollout engine). `dtype`: each
    floating-point tensor cast on its shard before the gather (a bfloat16 rollout copy)."""

    def __init__(self, model: nn.Module, keep: bool = True, dtype: torch.dtype | None = None) -> None:
        self._sd, self.keep, self.dtype = model.state_dict(), keep, dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._sd[name]
        if self.dtype is not None and t.is_floating_point():
            t = t.to(self.dtype)
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        return full if self.keep else full.new_empty(0)

    def __iter__(self) -> Iterator[str]:
        return iter(self._sd)

    def __len__(self) -> int:
        return len(self._sd)


def local_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes this rank holds of `tensors` (a DTensor's local shard; plain tensors whole; None: 0)."""
    total = 0
    for t in tensors:
        if t is not None:
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def training_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of the policy's parameters, gradients and optimizer state, as held now."""
    params = list(model.parameters())
    return {"params_bytes": local_bytes(params), "grads_bytes": local_bytes(p.grad for p in params),
            "optimizer_bytes": local_bytes(optimizer_tensors(optimizer))}


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's per-parameter state tensors (AdamW's moments; scalar step counters left out)."""
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]


def shard_rows(rows: int, world_size: int, rank: int) -> int:
    """Rows of a dim-0 size `rows` that rank `rank` holds: torch.chunk's split, which FSDP2 uses
    (chunks of ceil(rows / N); the last ranks may hold fewer, or none)."""
    chunk = math.ceil(rows / world_size)
    return max(0, min(chunk, rows - rank * chunk))


def shard_bytes(shapes: Iterable[tuple[tuple[int, ...], int]], world_size: int, rank: int = 0) -> int:
    """Bytes rank `rank` holds of tensors given as (shape, bytes per element) under FSDP2's
    dim-0 sharding over `world_size` ranks."""
    total = 0
    for shape, itemsize in shapes:
        rest = math.prod(shape[1:]) if len(shape) > 1 else 1
        total += shard_rows(shape[0], world_size, rank) * rest * itemsize if shape else itemsize
    return total
