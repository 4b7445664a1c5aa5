"""Paged attention through PyTorch's FlexAttention: the engine's attention off the CPU, reading the
K/V pool where it lies (no gathered copy of any row's history).

The pool is stored head-major there, each layer's keys and values [Hkv, blocks, block_size, D]
(KVPool's "heads" layout; its k/v attributes are views of that storage in the shapes the other
paths index), so one layer's whole pool is one [1, Hkv, blocks * block_size, D] tensor: every
slot a key position FlexAttention can address. The packed query rows are padded, row by row, to
a multiple of Q_BLOCK queries (one row per query block), and the BlockMask lists for each query
block the pool blocks of its row's table, so FlexAttention reads only those; a mask function then
maps each physical slot back to its row's position (the row's table inverted) and applies what
PagedRows says each query sees: causal (slots below q_hi), the sliding window, a speculative
tree's ancestors. Padding queries see nothing and are dropped.

Everything is built from PagedRows' device tensors and the host ints PagedView staged (no read
of the device), once per step: the block mask and the inverted tables are kept on the PagedRows
and reused by every layer. FlexAttention runs under torch.compile (Triton on CUDA, C++ on a CPU,
where the C kernel is faster and this path runs only when asked for: tests, and
RECLAIM_ATTENTION_BACKEND=flex). A failure to compile or run falls back to the gathering torch
path with one warning that says why. The compiled decode (engine `compile`, CUDA graphs) keeps
the gathering path inside its opaque op. Not yet run on a GPU: scripts/gpu_check.py compares it
there against the gathering path and reports whether it fell back.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

Q_BLOCK = 16  # queries per FlexAttention query block: one row's, padded (a decode row: 1 and 15 pads)

_compiled: dict[str, Any] = {}  # device type -> flex_attention compiled for it
failed: str | None = None  # why the flex path was given up, once it failed


def flex_index(starts: list[int], ends: list[int], n: int) -> tuple[list[int], list[int]]:
    """Host-side layout of the padded queries: each query block's row (index into the paged
    rows) and each padded query's packed token (n: padding)."""
    block_row: list[int] = []
    index: list[int] = []
    for r, (a, b) in enumerate(zip(starts, ends)):
        blocks = max(1, -(-(b - a) // Q_BLOCK))
        block_row += [r] * blocks
        index += list(range(a, b)) + [n] * (blocks * Q_BLOCK - (b - a))
    return block_row, index


def heads_layout(k_pool: torch.Tensor, v_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The pool as [1, Hkv, slots, D] keys and values, where its storage is head-major; else None."""
    kh, vh = k_pool.permute(1, 0, 3, 2), v_pool.permute(1, 0, 2, 3)  # [Hkv, blocks, bs, D]
    if not (kh.is_contiguous() and vh.is_contiguous()):
        return None
    h, nb, bs, d = kh.shape
    return kh.view(1, h, nb * bs, d), vh.view(1, h, nb * bs, d)


def _flex(device: torch.device) -> Any:
    """flex_attention compiled: shapes dynamic on CUDA (one graph for every step); static on a CPU,
    where inductor's C++ flex template does not compile with dynamic shapes (torch 2.13)."""
    if device.type not in _compiled:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled[device.type] = torch.compile(flex_attention, dynamic=device.type != "cpu")
    return _compiled[device.type]


def _block_mask(rows: Any, num_slots: int, bs: int) -> Any:
    """The step's BlockMask over the pool (built once, kept on `rows`)."""
    cached = getattr(rows, "_flex_mask", None)
    if cached is not None:
        return cached
    from torch.nn.attention.flex_attention import BlockMask

    dev = rows.tables.device
    block_row, q_index = rows.flex
    tables = rows.tables.long()
    r, w = tables.shape
    num_blocks = num_slots // bs
    empty = rows.q_end <= rows.q_start
    hi_row = rows.q_hi.long()[(rows.q_end.long() - 1).clamp(min=0)]
    nblk = torch.where(empty, 0, (hi_row + bs - 1) // bs).clamp(max=w)  # [R] blocks each row reads
    col = torch.arange(w, device=dev)
    used = col[None] < nblk[:, None]
    # each row's table inverted: pool block -> its position in the row (-1: not the row's)
    inv = torch.full((r, num_blocks), -1, dtype=torch.long, device=dev)
    inv.scatter_(1, torch.where(used, tables, num_blocks - 1), torch.where(used, col[None], -1).expand(r, w))
    inv[:, num_blocks - 1] = -1  # the spare block (padding writes) is nobody's
    br = block_row.long()
    kv_num = nblk[br].int()[None, None]
    # FlexAttention wants the index as wide as the KV sequence has blocks (the pool's): a row's
    # table first, zeros after (past kv_num, never read)
    kv_idx = torch.zeros(len(br), num_blocks, dtype=torch.int32, device=dev)
    kv_idx[:, :w] = torch.where(used, tables, 0)[br]
    kv_idx = kv_idx[None, None]
    row_of = br.repeat_interleave(Q_BLOCK)  # [L] each padded query's row
    tok = q_index.long()
    pos = torch.cat([rows.q_pos.long(), rows.q_pos.new_zeros(1).long()])[tok]
    hi = torch.cat([rows.q_hi.long(), rows.q_hi.new_zeros(1).long()])[tok]  # padding: sees nothing
    window, past, tree = rows.window, rows.past.long(), rows.tree
    tree_row = rows.tree_row.bool()
    if tree is not None:
        t = tree.shape[1]
        seen = torch.cat([tree.bool(), tree.new_zeros(1, t).bool()])[tok]  # [L, T]

    def mask_mod(b, h, qi, ki):  # noqa: ANN001, ANN202 - FlexAttention's signature
        row = row_of[qi]
        lg = inv[row, ki // bs]
        kp = lg * bs + ki % bs
        ok = (lg >= 0) & (kp < hi[qi])
        if window is not None:
            ok = ok & (kp > pos[qi] - window)
        if tree is not None:
            j = kp - past[row]
            in_tree = (j >= 0) & tree_row[row]
            ok = ok & (~in_tree | seen[qi, j.clamp(0, t - 1)])
        return ok

    mask = BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=(Q_BLOCK, bs), mask_mod=mask_mod,
                                    seq_lengths=(len(tok), num_slots), compute_q_blocks=False)
    rows._flex_mask = mask
    return mask


def paged_attention_flex(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: Any,
                         out: torch.Tensor) -> bool:
    """Attention of `rows`' queries (q [N, nh, D]) over a head-major pool into `out` [N, nh, D];
    False where it cannot run here (not head-major, no query layout on `rows`, or it failed once:
    the caller takes the torch path)."""
    global failed
    if rows.num_rows == 0:
        return True
    pools = heads_layout(k_pool, v_pool)
    if failed is not None or pools is None or getattr(rows, "flex", None) is None:
        return False
    k, v = pools
    n, nh, d = q.shape
    bs = k_pool.shape[3]
    try:
        mask = _block_mask(rows, k.shape[2], bs)
        tok = rows.flex[1].long()
        qx = torch.cat([q, q.new_zeros(1, nh, d)])[tok].transpose(0, 1)[None]  # [1, nh, L, D]
        # Triton's tiles must divide the mask's blocks: Q_BLOCK queries, a pool block of keys
        tiles = {"BLOCK_M": Q_BLOCK, "BLOCK_N": min(bs, 64)} if q.device.type == "cuda" else None
        o = _flex(q.device)(qx, k, v, block_mask=mask, scale=1.0 / math.sqrt(d), enable_gqa=nh != k.shape[1],
                            kernel_options=tiles)
        full = torch.cat([out, out.new_zeros(1, nh, d)]).index_copy_(0, tok, o[0].transpose(0, 1).to(out.dtype))
        out.copy_(full[:n])
        return True
    except Exception as e:  # noqa: BLE001 - any compile or kernel error: the torch path instead
        failed = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        warnings.warn(f"reclaim: FlexAttention paged attention failed, gathering K/V instead ({failed})",
                      stacklevel=2)
        return False
