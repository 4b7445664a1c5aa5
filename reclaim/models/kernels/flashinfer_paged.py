"""Paged attention through FlashInfer (`flashinfer-python`): the engine's attention on CUDA in
float16 or bfloat16, reading the K/V pool where it lies, as vLLM's and SGLang's FlashInfer
backends do.

The pool is stored as FlashInfer's "HND" pages, each layer's keys and values [blocks, Hkv,
block_size, D] (KVPool's "pages" layout; its k attribute is the transposed view [blocks, Hkv, D,
block_size] the other paths index). One forward's rows, packed one after another, become one
`BatchPrefillWithPagedKVCacheWrapper` plan: rows in FlashInfer's CSR form (qo_indptr; each row's
pages and how full its last page is), planned once per forward on the host and run by every
layer. Decodes, chunked prefills and whole fresh prompts go through the same plan (a fresh
prompt's K/V are written to the pool first). FlashInfer's causal mask aligns a row's queries with
the end of its keys (query i of a row of n new tokens after p cached ones sees keys up to p + i),
which is the engine's. Sliding windows pass as window_left (a query at position s sees s -
window + 1 .. s). A batch with a speculative tree row passes a custom mask instead, for every
row: the tree row's new keys where its mask allows, the others causal, the window folded in.

Not yet run on a GPU (none has been lent): tests/models/test_flashinfer_paged.py checks the plan
against an emulation of FlashInfer's documented semantics on the CPU, and scripts/gpu_check.py
compares the real kernel with the gathering torch path on the first lent GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass
from typing import Any

import torch

DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace, one per device (its examples' size)

_wrappers: dict[str, list[Any]] = {}  # device -> [BatchPrefillWithPagedKVCacheWrapper, the Attention planned on it]
_failed: list[str] = []  # why FlashInfer failed in this process, once it has (see `failed`)


@functools.cache
def installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def failed(error: BaseException) -> None:
    """FlashInfer raised here (its first-use JIT build, a kernel it has no build of): one warning
    that says why, and no pool of this process reads through it again (`why_not` says so); the
    view that met it attends through the gathering path, which reads the same pages."""
    import warnings

    if not _failed:
        _failed.append(f"{type(error).__name__}: {error}")
        warnings.warn(f"reclaim: FlashInfer paged attention failed, gathering K/V instead ({_failed[0]})",
                      RuntimeWarning, stacklevel=3)


def why_not(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FlashInfer cannot take this attention (None: it can): CUDA, float16 or bfloat16,
    head_dim 64, 128 or 256, and flashinfer installed."""
    if device.type != "cuda":
        return f"FlashInfer runs on CUDA; the device is {device}"
    if dtype not in DTYPES:
        return f"FlashInfer takes {[str(d) for d in DTYPES]}; the KV cache is {dtype}"
    if head_dim not in HEAD_DIMS:
        return f"FlashInfer's prebuilt head_dim are {list(HEAD_DIMS)}; the model's is {head_dim}"
    if not installed():
        return "flashinfer is not installed (pip install flashinfer-python)"
    if _failed:
        return f"FlashInfer failed in this process ({_failed[0]})"
    return None


def pages(k_pool: torch.Tensor, v_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One layer's pool as FlashInfer's HND pages (k, v [blocks, Hkv, bs, D], contiguous), or None
    where it is not stored so (another layout)."""
    k = k_pool.transpose(2, 3)
    return (k, v_pool) if k.is_contiguous() and v_pool.is_contiguous() else None


@dataclass
class Plan:
    """One forward's rows in FlashInfer's terms, built on the host: qo_indptr [B + 1], the pages
    of each row (kv_indptr [B + 1], kv_indices) and how many slots of its last page it fills
    (last_page_len [B]); mask: the flattened [new, past + new] boolean mask of every row, in row
    order, or None (causal, with window_left)."""

    qo_indptr: list[int]
    kv_indptr: list[int]
    kv_indices: list[int]
    last_page_len: list[int]
    mask: list[bool] | None
    window_left: int


def plan_rows(tables: list[list[int]], past: list[int], new: list[int], block_size: int,
              trees: dict[int, list[list[bool]]], positions: list[int], window: int | None) -> Plan:
    """The plan of rows with `past[r]` cached and `new[r]` new tokens (already in the pool) under
    block `tables`; `trees`: row -> which new tokens each new token sees (kv_cache.tree_depths);
    `positions`: every packed query's position (a tree token's: past + its depth)."""
    qo, kv, idx, last = [0], [0], [], []
    for tb, p, n in zip(tables, past, new):
        total = p + n
        pages_used = -(-total // block_size)
        idx += tb[:pages_used]
        qo.append(qo[-1] + n)
        kv.append(kv[-1] + pages_used)
        last.append(total - (pages_used - 1) * block_size)
    mask = None
    if trees:
        mask = []
        for r, (p, n) in enumerate(zip(past, new)):
            for i in range(n):
                pos = positions[qo[r] + i]
                lo = 0 if window is None else pos - window + 1
                seen = trees[r][i] if r in trees else [j <= i for j in range(n)]
                mask += [lo <= s for s in range(p)] + [seen[j] and lo <= p + j for j in range(n)]
    # With a mask the window is in it (a tree token's window follows its depth, not its index).
    return Plan(qo, kv, idx, last, mask, -1 if window is None or mask is not None else window - 1)


class Attention:
    """A planned FlashInfer attention for one forward: `run` per layer. The wrapper (and its
    workspace) is one per device; whichever forward ran on it last is planned again first."""

    def __init__(self, plan: Plan, *, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        import flashinfer

        key = str(device)
        if key not in _wrappers:
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            _wrappers[key] = [flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="HND"), None]
        self.slot = _wrappers[key]
        i32 = dict(dtype=torch.int32)
        self.args = (torch.tensor(plan.qo_indptr, **i32), torch.tensor(plan.kv_indptr, **i32),
                     torch.tensor(plan.kv_indices, **i32, device=device), torch.tensor(plan.last_page_len, **i32),
                     num_heads, num_kv_heads, head_dim, block_size)
        self.kwargs = dict(custom_mask=None if plan.mask is None else torch.tensor(plan.mask, dtype=torch.bool, device=device),
                           causal=plan.mask is None, sm_scale=1.0 / math.sqrt(head_dim), window_left=plan.window_left,
                           q_data_type=dtype, kv_data_type=dtype)

    def run(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """Attention of the packed queries q [N, nh, D] over one layer's pool: [N, nh, D]."""
        kv = pages(k_pool, v_pool)
        if kv is None:
            raise ValueError("FlashInfer reads a pool in the 'pages' layout (KVPool(layout='pages'))")
        wrapper, owner = self.slot
        if owner is not self:
            wrapper.plan(*self.args, **self.kwargs)
            self.slot[1] = self
        return wrapper.run(q.contiguous(), kv)
