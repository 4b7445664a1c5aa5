"""Tensor parallelism for the Llama-family decoder, applied from outside the model (Megatron's layout).

`shard_llama(model, group)` cuts a loaded `LlamaForCausalLM` in place for one rank of a group of
N: q/k/v and gate/up keep their rows of this rank's heads and intermediate units (column
parallel: no communication), o_proj and down_proj their columns (row parallel: one all-reduce
each, the bias added once after it), the embedding and the LM head their rows of the vocabulary
(the embedding looks up the ids it holds and all-reduces; the head's logits are all-gathered).
Each rank's attention sees only its own query and K/V heads, so its K/V cache holds 1/N of them.

Why plain sharded weights with explicit collectives, not DTensor's `parallelize_module`: the
engine's forward is plain tensors through reclaim's own kernels (the few-row CPU matmul, paged
attention reading the pool in place) and a decode step runs ~10 small ops per layer, where
DTensor's per-op dispatch would cost more than the matmuls; here the only changes to a forward
are two all-reduces per layer, and parameter names stay the model's (a shard of `o_proj.weight`
is still `o_proj.weight`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from reclaim.models.kernels.linear import Linear, linear


def check_tensor_parallel(cfg: Any, size: int, *, name: str = "tensor_parallel_size",
                          world_size: int | None = None) -> None:
    """Refuse a TP size that does not split the model evenly (or, with `world_size`, does not tile
    the world into groups of consecutive ranks), naming the value and the sizes that do (before
    any rank loads weights: only the config is read). `name`: the field the size came from."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{name}={size!r}; allowed: an integer >= 1")
    if size == 1:
        return
    dims = {"num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size}
    if world_size is not None:
        dims = {"world_size": world_size, **dims}
    for what, n in dims.items():
        if n % size:
            ok = [d for d in range(1, min(dims.values()) + 1) if all(v % d == 0 for v in dims.values())]
            why = ("groups of consecutive ranks tile the world" if what == "world_size"
                   else "each rank takes an equal share")
            at = "" if world_size is None else f" at world size {world_size}"
            raise ValueError(f"{name}={size} does not divide {what}={n} ({why}); allowed for this model{at}: {ok}")


@dataclass
class TensorParallel:
    """One rank's place in a tensor-parallel group and the collectives the sharded layers call."""

    group: Any  # a torch.distributed ProcessGroup
    rank: int
    size: int
    vocab_size: int  # the whole vocabulary
    num_kv_heads: int  # this rank's K/V heads

    @property
    def vocab_range(self) -> tuple[int, int]:
        """The ids [start, end) of this rank's embedding and LM head rows."""
        n = self.vocab_size // self.size
        return self.rank * n, (self.rank + 1) * n

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's logits [..., V / N] joined into [..., V] (in rank order: vocabulary order)."""
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor `name` of the unsharded model's state dict (as is
        for a replicated one): how new full weights reach a sharded model."""
        part = self.part(name, tuple(full.shape))
        return full if part is None else full.narrow(*part)

    def part(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(dim, start, length) of this rank's slice of tensor `name` of `shape`; None: whole."""
        dim = _split_dim(name)
        if dim is None:
            return None
        rows = shape[dim] // self.size
        return dim, self.rank * rows, rows


# Parameter name endings and the dimension each is split along (0: rows, 1: columns).
_SPLITS = {"q_proj.weight": 0, "q_proj.bias": 0, "k_proj.weight": 0, "k_proj.bias": 0, "v_proj.weight": 0,
           "v_proj.bias": 0, "gate_proj.weight": 0, "gate_proj.bias": 0, "up_proj.weight": 0, "up_proj.bias": 0,
           "o_proj.weight": 1, "down_proj.weight": 1, "embed_tokens.weight": 0, "lm_head.weight": 0}


def _split_dim(name: str) -> int | None:
    return next((d for end, d in _SPLITS.items() if name.endswith(end)), None)


def copy_full(model: nn.Module, state_dict: Mapping[str, torch.Tensor],
              also: Callable[[str, torch.Tensor], None] | None = None) -> None:
    """Copy the unsharded model's tensors (names of model.state_dict(), read in their order) into
    `model` in place, each cut to this rank's shard where `model` is sharded (`shard_llama`);
    `also(name, tensor)` sees each whole tensor as it is read."""
    tp = getattr(model, "tensor_parallel", None)
    own = model.state_dict()
    unknown = sorted(set(state_dict) - set(own))
    if unknown:
        raise ValueError(f"unknown parameter names {unknown[:5]}; expected names of model.state_dict()")
    with torch.no_grad():
        for name, value in state_dict.items():
            if also is not None:
                also(name, value)
            if tp is not None:
                value = tp.shard(name, value)
            if own[name].shape != value.shape:
                raise ValueError(f"{name}: shape {tuple(value.shape)} does not match {tuple(own[name].shape)}")
            own[name].copy_(value)


class RowParallelLinear(Linear):
    """A row-parallel projection: this rank's input columns, partial sums all-reduced, then the bias."""

    tp: TensorParallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the vocabulary; ids held elsewhere look up zeros, and the sum over
    ranks is every id's embedding."""

    tp: TensorParallel

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start, end = self.tp.vocab_range
        mine = (ids >= start) & (ids < end)
        x = F.embedding(torch.where(mine, ids - start, 0), self.weight)
        return self.tp.all_reduce(x * mine[..., None].to(x.dtype))


class VocabParallelHead(Linear):
    """This rank's rows of the LM head; its forward returns the whole vocabulary's logits."""

    tp: TensorParallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.gather_vocab(super().forward(x))


def _cut(module: nn.Module, cls: type, tp: TensorParallel, prefix: str) -> nn.Module:
    """`module` as `cls` holding only this rank's slice of each of its parameters (copies: the
    full tensors are freed once the model lets go of them)."""
    module.__class__ = cls
    module.tp = tp
    for name, p in list(module.named_parameters(recurse=False)):
        part = tp.shard(f"{prefix}.{name}", p.data).clone()
        setattr(module, name, nn.Parameter(part, requires_grad=p.requires_grad))
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = module.weight.shape
    else:
        module.num_embeddings = module.weight.shape[0]
    return module


def shard_llama(model: nn.Module, group: Any = None) -> TensorParallel:
    """Shard a Llama-family model in place over `group` (default: the whole world), keeping this
    rank's part of every projection, the embedding and the LM head; returns the rank's
    `TensorParallel`, also set as `model.tensor_parallel`. Every rank must call it with the same
    weights (a loaded checkpoint, or the same seed)."""
    if getattr(model, "tensor_parallel", None) is not None:
        raise ValueError("the model is sharded already (model.tensor_parallel is set)")
    cfg = model.config
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    check_tensor_parallel(cfg, size)
    tp = TensorParallel(group, rank, size, cfg.vocab_size, cfg.num_key_value_heads // size)
    model.tensor_parallel = tp
    if size == 1:
        return tp
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    for i, layer in enumerate(model.model.layers):
        attn, mlp, at = layer.self_attn, layer.mlp, f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            _cut(getattr(attn, name), Linear, tp, f"{at}.self_attn.{name}")
        _cut(attn.o_proj, RowParallelLinear, tp, f"{at}.self_attn.o_proj")
        attn.nh, attn.nkv = attn.nh // size, attn.nkv // size
        for name in ("gate_proj", "up_proj"):
            _cut(getattr(mlp, name), Linear, tp, f"{at}.mlp.{name}")
        _cut(mlp.down_proj, RowParallelLinear, tp, f"{at}.mlp.down_proj")
    _cut(model.model.embed_tokens, VocabParallelEmbedding, tp, "model.embed_tokens")
    if tied:
        model.lm_head.__class__, model.lm_head.tp = VocabParallelHead, tp
        model.lm_head.weight = model.model.embed_tokens.weight
        model.lm_head.out_features = model.lm_head.weight.shape[0]
    else:
        _cut(model.lm_head, VocabParallelHead, tp, "lm_head")
    return tp
