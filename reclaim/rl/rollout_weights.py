"""The rollout engine's weights: a copy of the policy in the rollout dtype, refreshed from the
trainer's weights (FSDP2 shards or a DDP replica) after each optimizer step.

verl and TLT roll out from bfloat16 weights while the trainer keeps float32 master weights:
the rollout copy is half of a float32 one (a 32B model: 65 GB instead of 131 GB), and the copy
never exists in float32 on a rank. `rollout_copy` builds it tensor by tensor from the policy
before sharding (each tensor cast on its own, no float32 clone of the model); after a step
`Engine.update_weights` reads `FullWeights(policy, dtype=...)` (reclaim/fsdp.py): each tensor is
cast to the rollout dtype on its shard and only then gathered (half the bytes of a float32
gather), one tensor at a time, into the engine's copy in place. With `rollout_dtype: auto` the
copy keeps the training dtype (the float64 tests compare rollouts exactly across world sizes).

With tensor-parallel rollouts (`rollout_tensor_parallel_size` N > 1) a rank's copy is only its
shard (models/tensor_parallel.py's split, about 1/N): `rollout_copy(model, dtype, group)` cuts the
copy while its parameters are still on the meta device, then fills each shard from its slice of
the policy's tensor, cast on its own; no rank holds a whole rollout copy (each does hold the
loaded policy in the training dtype until FSDP shards it, as without TP). `update_weights`
slices each gathered tensor to the shard as it arrives. The engine's copy then cannot be a
checkpoint's HF weights: `host_copy` gathers them, shaped by `meta_copy` of the plain policy.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from reclaim.fsdp import FullWeights
from reclaim.models.tensor_parallel import copy_full, shard_llama

ROLLOUT_DTYPES = ("bfloat16", "float16", "float32", "auto")


def rollout_dtype(name: str, model: nn.Module) -> torch.dtype:
    """The dtype of the rollout copy: `name` (one of ROLLOUT_DTYPES), "auto" being the policy's own."""
    if name not in ROLLOUT_DTYPES:
        raise ValueError(f"rollout_dtype={name!r} is not one of {list(ROLLOUT_DTYPES)}")
    return next(model.parameters()).dtype if name == "auto" else getattr(torch, name)


def meta_copy(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """The plain `model`'s shape without its weights: a copy whose parameters are on the meta
    device (no memory; floating ones in `dtype`, default their own; tied weights stay tied), its
    buffers copied as they are."""
    memo: dict[int, object] = {}
    for p in model.parameters():
        if id(p) not in memo:
            kind = dtype if dtype is not None and p.is_floating_point() else p.dtype
            memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=kind, device="meta"), requires_grad=False)
    return copy.deepcopy(model, memo).eval()


def _materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """`model` with each meta parameter given (uninitialised) storage on `device`; tied stay tied."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=False)
            setattr(module, name, made[id(p)])
    return model


def rollout_copy(model: nn.Module, dtype: torch.dtype, group: Any = None) -> nn.Module:
    """A frozen copy of the plain (not yet sharded) `model` with its floating-point parameters in
    `dtype`, made tensor by tensor (tied weights stay tied; buffers copied as they are). With a
    tensor-parallel `group` (of more than one rank), only this rank's shard: the copy is cut
    (`shard_llama`) while it is still on the meta device, then each shard is filled from its slice
    of the policy's tensor, so no rank ever holds the whole copy."""
    out = meta_copy(model, dtype)
    if group is not None:
        shard_llama(out, group)
    copy_full(_materialize(out, next(model.parameters()).device), model.state_dict())
    return out


def host_copy(layout: nn.Module, model: nn.Module, dtype: torch.dtype, keep: bool) -> nn.Module | None:
    """The policy's full weights in `dtype` in host memory, shaped as `layout` (a plain, unsharded
    module: a checkpoint's HF layout keeps the training dtype when the rollout copy does not, and a
    tensor-parallel rollout copy holds only a shard). Every rank takes part in the gathers, one
    tensor at a time, in the same order; only a rank with `keep` holds the copy."""
    weights = FullWeights(model, keep=keep)
    if not keep:
        for name in weights:
            weights[name]
        return None
    out = _materialize(meta_copy(layout, dtype), "cpu").cpu()
    copy_full(out, weights)
    return out
