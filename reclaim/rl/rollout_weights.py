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
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from reclaim.fsdp import FullWeights

ROLLOUT_DTYPES = ("bfloat16", "float16", "float32", "auto")


def rollout_dtype(name: str, model: nn.Module) -> torch.dtype:
    """The dtype of the rollout copy: `name` (one of ROLLOUT_DTYPES), "auto" being the policy's own."""
    if name not in ROLLOUT_DTYPES:
        raise ValueError(f"rollout_dtype={name!r} is not one of {list(ROLLOUT_DTYPES)}")
    return next(model.parameters()).dtype if name == "auto" else getattr(torch, name)


def rollout_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A frozen copy of the plain (not yet sharded) `model` with its floating-point parameters in
    `dtype`, each cast on its own (tied weights stay tied); buffers are copied as they are."""
    memo: dict[int, object] = {}
    for p in model.parameters():
        if id(p) not in memo:
            cast = p.detach().to(dtype) if p.is_floating_point() else p.detach()
            memo[id(p)] = nn.Parameter(cast.clone() if cast.data_ptr() == p.data_ptr() else cast,
                                       requires_grad=False)
    return copy.deepcopy(model, memo).eval()


def host_copy(served: nn.Module, model: nn.Module, dtype: torch.dtype, keep: bool) -> nn.Module | None:
    """The policy's full weights in `dtype` in host memory, shaped as `served` (a checkpoint's HF
    layout keeps the training dtype when the rollout copy does not). Every rank takes part in the
    gathers, one tensor at a time, in the same order; only a rank with `keep` holds the copy."""
    weights = FullWeights(model, keep=keep)
    if not keep:
        for name in weights:
            weights[name]
        return None
    memo = {id(p): nn.Parameter(torch.empty(p.shape, dtype=dtype, device="cpu"), requires_grad=False)
            for p in served.parameters()}
    out = copy.deepcopy(served, memo).cpu()
    own = out.state_dict()
    with torch.no_grad():
        for name in weights:
            own[name].copy_(weights[name])
    return out
