"""Attention of packed query rows over a paged K/V pool: the C kernel (`paged_attention.c`, float32
on a CPU) and a batched torch path that gathers the rows' keys (any device and dtype; the path on
GPUs until FlashInfer's or flash-attn's paged kernels are wired in).

The pool holds one layer's keys as [blocks, Hkv, D, block_size] (transposed within a block: 16
keys' d-th entries are one vector for the kernel) and its values as [blocks, Hkv, block_size, D];
one head's keys (and values) of a block are contiguous, what one (row, head) of the kernel streams.
A batch is rows of new tokens packed one after another ([N, H, D], no padding); row r's queries
are q_start[r] .. q_end[r] - 1, after past[r] cached tokens, and their K/V are already in the pool. Which keys each query sees is in `PagedRows` (see
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
from reclaim.models.kernels.flex_paged import paged_attention_flex

_fn = None


@dataclass
class PagedRows:
    """Which rows attend through the pool and what each query sees (int32 tensors, on the pool's
    device). tables [B, W] block ids; q_start, q_end, past [B]; q_pos, q_hi [N] per packed query
    (all N, also those of rows not listed here); tree [N, T] uint8 or None, tree_row [B].

    What the torch path needs to stay batched without reading the device (host ints, set by
    whoever built the tensors): the most queries a row has and the slots it gathers (first_key
    up to max_keys). None: read them from the tensors (a host sync each)."""

    tables: torch.Tensor
    q_start: torch.Tensor
    q_end: torch.Tensor
    past: torch.Tensor
    q_pos: torch.Tensor
    q_hi: torch.Tensor
    tree: torch.Tensor | None
    tree_row: torch.Tensor
    window: int | None
    max_new: int | None = None
    first_key: int | None = None
    max_keys: int | None = None
    flex: tuple[torch.Tensor, torch.Tensor] | None = None  # FlexAttention's query blocks (flex_paged.py)

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
            lib.paged_write.argtypes = [p, p, p, p, p, p, i64, i32, i32, i32]
            lib.paged_write.restype = None
            _fn = lib
    return _fn or None


def write(k_pool: torch.Tensor, v_pool: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor,
          v: torch.Tensor) -> None:
    """Store new K/V ([N, Hkv, D]) at their (block, offset) slots (int32) of one layer's pool:
    the C kernel where it takes this attention, else indexing."""
    blk, off = where
    if kernel_eligible(k, k_pool) and blk.dtype == off.dtype == torch.int32:
        k, v = k.contiguous(), v.contiguous()
        _kernel().paged_write(k_pool.data_ptr(), v_pool.data_ptr(), k.data_ptr(), v.data_ptr(), blk.data_ptr(),
                              off.data_ptr(), k.shape[0], k.shape[1], k.shape[2], k_pool.shape[3])
    else:
        k_pool[blk, :, :, off] = k
        v_pool[blk, :, off] = v


def kernel_status() -> str:
    """'on', or why the C kernel is not used."""
    return "on" if _kernel() is not None else f"off: {cbuild.why_not('paged_attention')}"


def kernel_eligible(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """Whether the C kernel takes this attention: float32 on a CPU, head_dim a multiple of 16
    up to 256, block_size a multiple of 16, and the kernel built."""
    d, bs = q.shape[-1], k_pool.shape[-1]
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_pool.dtype == torch.float32
            and k_pool.is_contiguous() and d % 16 == 0 and d <= 256 and bs % 16 == 0 and _kernel() is not None)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: PagedRows,
                    out: torch.Tensor) -> None:
    """Write attention of `rows`' queries (q [N, nh, D]) over the pool (k [blocks, Hkv, D, bs],
    v [blocks, Hkv, bs, D])
    into `out` [N, nh, D] (other rows' entries untouched): the C kernel where eligible, else
    the torch reference."""
    if rows.num_rows == 0:
        return
    if not kernel_eligible(q, k_pool):
        if paged_attention_flex(q, k_pool, v_pool, rows, out):  # a head-major pool (off the CPU)
            return
        return paged_attention_torch(q, k_pool, v_pool, rows, out)
    n, nh, d = q.shape
    nkv, bs = k_pool.shape[1], k_pool.shape[3]
    q = q if q.is_contiguous() else q.contiguous()
    tree = rows.tree
    _kernel().paged_attention(out.data_ptr(), q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
              rows.tables.data_ptr(), rows.tables.shape[1], rows.q_start.data_ptr(), rows.q_end.data_ptr(),
              rows.past.data_ptr(), rows.q_pos.data_ptr(), rows.q_hi.data_ptr(),
              None if tree is None else tree.data_ptr(), 0 if tree is None else tree.shape[1],
              rows.tree_row.data_ptr(), rows.num_rows, nh, nkv, d, bs, rows.window or 0,
              1.0 / math.sqrt(d), torch.get_num_threads())


def paged_attention_torch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: PagedRows,
                          out: torch.Tensor) -> None:
    """Any device and dtype, batched: every row's keys gathered from the pool into [B, S, Hkv, D]
    (slots first_key .. max_keys - 1, none older than the window), its queries padded to the
    longest row, one SDPA under each query's mask, and the rows' outputs copied into `out`."""
    dev, (n, nh, d) = q.device, q.shape
    nkv, bs = k_pool.shape[1], k_pool.shape[3]
    b = rows.num_rows
    t = rows.max_new if rows.max_new is not None else int((rows.q_end - rows.q_start).max())
    hi_max = rows.max_keys if rows.max_keys is not None else int(rows.q_hi.max())
    lo = rows.first_key if rows.first_key is not None else (
        0 if rows.window is None else max(0, int(rows.q_pos.min()) - rows.window + 1))
    s = torch.arange(lo, hi_max, device=dev)
    blk = rows.tables.long().gather(1, (s // bs)[None].expand(b, -1))  # [B, S]
    off = (s % bs)[None].expand(b, -1)
    k, v = k_pool[blk, :, :, off], v_pool[blk, :, off]  # [B, S, Hkv, D]
    qi = rows.q_start.long()[:, None] + torch.arange(t, device=dev)  # [B, T]
    valid = qi < rows.q_end.long()[:, None]
    qi = torch.where(valid, qi, n)  # padding queries: the dump row past the end
    qx = torch.cat([q, q.new_zeros(1, nh, d)])[qi]  # [B, T, nh, D]
    pos, hi = (torch.cat([x.long(), x.new_zeros(1).long()])[qi] for x in (rows.q_pos, rows.q_hi))
    mask = (s < hi[..., None]) & valid[..., None]
    if rows.window is not None:
        mask &= s > pos[..., None] - rows.window
    if rows.tree is not None:
        tt = rows.tree.shape[1]
        new = s[None, None, :] - rows.past.long()[:, None, None]  # [B, 1, S]: which new token a key is
        seen = torch.cat([rows.tree.bool(), rows.tree.new_zeros(1, tt).bool()])[qi]  # [B, T, Tt]
        seen = seen.gather(2, new.clamp(0, tt - 1).expand(-1, t, -1))
        in_tree = ((new >= 0) & (new < tt)) & rows.tree_row.bool()[:, None, None]
        mask &= ~in_tree | seen
    # Slots no query of a row sees may hold anything (another sequence's data, or nothing
    # written): zero them, so that a masked weight of 0 never meets a NaN there.
    unseen = ~mask.any(1)[:, :, None, None]  # [B, S, 1, 1]
    k, v = k.masked_fill(unseen, 0), v.masked_fill(unseen, 0)
    mask |= ~mask.any(-1, keepdim=True) & (s == s[0])  # a query that sees nothing: no NaN (discarded)
    o = F.scaled_dot_product_attention(qx.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask[:, None], enable_gqa=nkv != nh).transpose(1, 2)
    # Into a copy of `out` with a dump row at the end (padding queries land there): no read of
    # which queries are real, so nothing waits for the device (and a captured graph can hold it).
    full = torch.cat([out, out.new_zeros(1, nh, d)]).index_copy_(0, qi.flatten(), o.flatten(0, 1))
    out.copy_(full[:n])


@torch.library.custom_op("reclaim::paged_attention", mutates_args=("k_pool", "v_pool"))
def paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                       v_pool: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, tables: torch.Tensor,
                       q_start: torch.Tensor, q_end: torch.Tensor, past: torch.Tensor, q_pos: torch.Tensor,
                       q_hi: torch.Tensor, tree: torch.Tensor | None, tree_row: torch.Tensor,
                       window: int, max_new: int, first_key: int, max_keys: int) -> torch.Tensor:
    """One layer's paged attention as one op for compiled graphs: the new K/V ([N, Hkv, D])
    written to their (block, offset) slots of the layer's pool, then `paged_attention` of every
    query (each row of `tables` a paged row; window 0: none; the ints as PagedRows')."""
    write(k_pool, v_pool, (blk, off), k, v)
    out = torch.empty_like(q)
    rows = PagedRows(tables, q_start, q_end, past, q_pos, q_hi, tree, tree_row, window or None, max_new,
                     first_key, max_keys)
    paged_attention(q, k_pool, v_pool, rows, out)
    return out


@paged_attention_op.register_fake
def _(q, k, v, k_pool, v_pool, blk, off, tables, q_start, q_end, past, q_pos, q_hi, tree, tree_row, window,
      max_new, first_key, max_keys):
    return torch.empty_like(q)
