"""Attention of packed query rows over a paged K/V pool: the C kernel (`paged_attention.c`, float32
on a CPU) and a torch reference that gathers each row's keys (any device and dtype).

The pool holds one layer's keys as [blocks, Hkv, D, block_size] (transposed within a block: 16
keys' d-th entries are one vector for the kernel) and its values as [blocks, Hkv, block_size, D];
one head's keys (and values) of a block are contiguous, what one (row, head) of the kernel streams. A batch is rows of new tokens packed one after another ([N, H, D],
no padding); row r's queries are q_start[r] .. q_end[r] - 1, after past[r] cached tokens, and
their K/V are already in the pool. Which keys each query sees is in `PagedRows` (see
paged_attention.c's header): slots lo <= s < hi, and for a speculative tree row only the new
keys its tree mask allows.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from reclaim.models.kernels import cbuild

_fn = None


@dataclass
class PagedRows:
    """Which rows attend through the pool and what each query sees (int32 tensors, on the pool's
    device). tables [B, W] block ids; q_start, q_end, past [B]; q_pos, q_hi [N] per packed query
    (all N, also those of rows not listed here); tree [N, T] uint8 or None, tree_row [B]."""

    tables: torch.Tensor
    q_start: torch.Tensor
    q_end: torch.Tensor
    past: torch.Tensor
    q_pos: torch.Tensor
    q_hi: torch.Tensor
    tree: torch.Tensor | None
    tree_row: torch.Tensor
    window: int | None

    @property
    def num_rows(self) -> int:
        return self.tables.shape[0]


def _kernel():
    global _fn
    if _fn is None:
        lib = cbuild.load("paged_attention")
        if lib is None:
            _fn = False
        else:
            p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
            lib.paged_attention.argtypes = [p, p, p, p, p, i64, p, p, p, p, p, p, i64, p,
                                            i32, i32, i32, i32, i32, i32, ctypes.c_float, i32]
            lib.paged_attention.restype = None
            _fn = lib.paged_attention
    return _fn or None


def kernel_status() -> str:
    """'on', or why the C kernel is not used."""
    return "on" if _kernel() is not None else f"off: {cbuild.why_not('paged_attention')}"


def kernel_eligible(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """Whether the C kernel takes this attention: float32 on a CPU, head_dim a multiple of 16
    up to 256, block_size a multiple of 16, and the kernel built."""
    d, bs = q.shape[-1], k_pool.shape[-1]
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_pool.dtype == torch.float32
            and d % 16 == 0 and d <= 256 and bs % 16 == 0 and _kernel() is not None)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: PagedRows,
                    out: torch.Tensor) -> None:
    """Write attention of `rows`' queries (q [N, nh, D]) over the pool (k [blocks, Hkv, D, bs],
    v [blocks, Hkv, bs, D])
    into `out` [N, nh, D] (other rows' entries untouched): the C kernel where eligible, else
    the torch reference."""
    if rows.num_rows == 0:
        return
    if not kernel_eligible(q, k_pool):
        return paged_attention_torch(q, k_pool, v_pool, rows, out)
    n, nh, d = q.shape
    nkv, bs = k_pool.shape[1], k_pool.shape[3]
    q = q if q.is_contiguous() else q.contiguous()
    tree = rows.tree
    _kernel()(out.data_ptr(), q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
              rows.tables.data_ptr(), rows.tables.shape[1], rows.q_start.data_ptr(), rows.q_end.data_ptr(),
              rows.past.data_ptr(), rows.q_pos.data_ptr(), rows.q_hi.data_ptr(),
              None if tree is None else tree.data_ptr(), 0 if tree is None else tree.shape[1],
              rows.tree_row.data_ptr(), rows.num_rows, nh, nkv, d, bs, rows.window or 0,
              1.0 / math.sqrt(d), torch.get_num_threads())


def visible(rows: PagedRows, r: int, first: int, keys: int) -> torch.Tensor:
    """[T, keys - first] bool: which of slots first..keys-1 each query of row r sees."""
    a, b = int(rows.q_start[r]), int(rows.q_end[r])
    dev = rows.q_pos.device
    s = torch.arange(first, keys, device=dev)[None, :]
    hi, pos = rows.q_hi[a:b, None].long(), rows.q_pos[a:b, None].long()
    ok = s < hi
    if rows.window is not None:
        ok &= s > pos - rows.window
    if rows.tree is not None and bool(rows.tree_row[r]):
        past, t = int(rows.past[r]), rows.tree.shape[1]
        new = (s >= past) & (s < past + t)
        seen = rows.tree[a:b].bool().gather(1, (s - past).clamp(0, t - 1).expand(b - a, -1))
        ok &= ~new | seen
    return ok


def paged_attention_torch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: PagedRows,
                          out: torch.Tensor) -> None:
    """The reference: per row, gather the keys its queries may see from the pool (none older
    than the window) and run SDPA under its mask."""
    nh, nkv, bs = q.shape[1], k_pool.shape[1], k_pool.shape[3]
    for r in range(rows.num_rows):
        a, b = int(rows.q_start[r]), int(rows.q_end[r])
        keys = int(rows.q_hi[a:b].max())
        first = 0 if rows.window is None else max(0, int(rows.q_pos[a:b].min()) - rows.window + 1)
        s = torch.arange(first, keys, device=q.device)
        blk, off = rows.tables[r].long()[s // bs], s % bs
        k = k_pool[blk, :, :, off].transpose(0, 1)[None]  # [1, Hkv, S, D]
        v = v_pool[blk, :, off].transpose(0, 1)[None]
        mask = visible(rows, r, first, keys)[None, None]
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], k, v, attn_mask=mask,
                                           enable_gqa=nkv != nh)
        out[a:b] = o[0].transpose(0, 1)


@torch.library.custom_op("reclaim::paged_attention", mutates_args=("k_pool", "v_pool"))
def paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                       v_pool: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, tables: torch.Tensor,
                       q_start: torch.Tensor, q_end: torch.Tensor, past: torch.Tensor, q_pos: torch.Tensor,
                       q_hi: torch.Tensor, tree: torch.Tensor | None, tree_row: torch.Tensor,
                       window: int) -> torch.Tensor:
    """One layer's paged attention as one op for compiled graphs: the new K/V ([N, Hkv, D])
    written to their (block, offset) slots of the layer's pool, then `paged_attention` of every
    query (each row of `tables` a paged row; window 0: none)."""
    k_pool[blk, :, :, off] = k
    v_pool[blk, :, off] = v
    out = torch.empty_like(q)
    rows = PagedRows(tables, q_start, q_end, past, q_pos, q_hi, tree, tree_row, window or None)
    paged_attention(q, k_pool, v_pool, rows, out)
    return out


@paged_attention_op.register_fake
def _(q, k, v, k_pool, v_pool, blk, off, tables, q_start, q_end, past, q_pos, q_hi, tree, tree_row, window):
    return torch.empty_like(q)
