"""Paged KV cache: fixed-size blocks, a free list, per-sequence block tables, and the per-forward
view that a model's attention calls (the AttentionCache protocol of reclaim/models/cache.py).

`BlockManager` is plain Python (which blocks a sequence owns) so the scheduler can be tested
without tensors; `KVPool` holds the tensors and builds a `PagedView` for one forward;
`plan_kv_blocks` sizes the pool within a memory budget.
"""

from __future__ import annotations

from typing import Any

import torch

from reclaim.engine.config import GIB
from reclaim.models.cache import attention_mask


class BlockManager:
    """Hands out block ids from a free list and keeps each sequence's block table.

    Prefix sharing: a full block of prompt tokens whose K/V are computed is indexed by a hash of
    its tokens and of every token before it (`prefix_hashes`); a new sequence with the same
    prefix takes those blocks into its table (`share`) instead of computing them again, e.g. the
    n completions of one GRPO prompt. Blocks are reference-counted and return to the free list
    when the last sequence holding them lets go. Shared blocks are only ever full prompt blocks,
    which no sharer writes again (each writes from the first position it does not share), so no
    copy on write is needed; `forget_prefixes` empties the index when the weights change.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks={num_blocks}, block_size={block_size} are invalid; both must be >= 1"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        # LIFO: a just-freed block is reused first, while its memory is still warm.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}
        self._refs: dict[int, int] = {}
        self._cached: dict[int, int] = {}  # prefix hash -> block holding that prefix's last block
        self._hash_of: dict[int, int] = {}  # block -> its prefix hash
        self.owner: dict[int, str] = {}  # indexed block -> the sequence that computed it

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Grow `seq_id`'s table to hold `num_tokens` tokens; False (and no change) if blocks run out."""
        table = self.tables.get(seq_id, [])
        need = self.blocks_for(num_tokens) - len(table)
        if need > len(self._free):
            return False
        for _ in range(max(0, need)):
            block = self._free.pop()
            self._refs[block] = 1
            table.append(block)
        self.tables[seq_id] = table
        return True

    def free(self, seq_id: str) -> None:
        """Let go of all of `seq_id`'s blocks (no-op if it holds none); unshared ones are freed."""
        for block in reversed(self.tables.pop(seq_id, [])):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                del self._refs[block]
                h = self._hash_of.pop(block, None)
                self.owner.pop(block, None)
                if h is not None and self._cached.get(h) == block:
                    del self._cached[h]
                self._free.append(block)

    def prefix_hashes(self, token_ids: list[int], num_blocks: int) -> list[int]:
        """Chained hashes of the first `num_blocks` full blocks of `token_ids`."""
        out, h, bs = [], 0, self.block_size
        for i in range(num_blocks):
            h = hash((h, tuple(token_ids[i * bs:(i + 1) * bs])))
            out.append(h)
        return out

    def cached_prefix(self, hashes: list[int]) -> list[int]:
        """Blocks of the longest indexed prefix among `hashes` (in order)."""
        out = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def share(self, seq_id: str, blocks: list[int]) -> None:
        """Start `seq_id`'s (empty) table with another sequence's prefix blocks."""
        if self.tables.get(seq_id):
            raise ValueError(f"sequence {seq_id!r} already holds blocks; a shared prefix must come first")
        for block in blocks:
            self._refs[block] += 1
        self.tables[seq_id] = list(blocks)

    def index(self, seq_id: str, hashes: list[int]) -> None:
        """Record that `seq_id`'s first len(hashes) blocks hold computed prefixes with these hashes."""
        for block, h in zip(self.tables[seq_id], hashes):
            if h not in self._cached and block not in self._hash_of:
                self._cached[h] = block
                self._hash_of[block] = h
                self.owner[block] = seq_id

    def forget_prefixes(self) -> None:
        """Drop the index (K/V made with other weights must not be shared into new sequences)."""
        self._cached.clear()
        self._hash_of.clear()
        self.owner.clear()


def plan_kv_blocks(
    cfg: Any, *, kv_cache_bytes: int, block_size: int, max_model_len: int, max_num_seqs: int,
    dtype: torch.dtype,
) -> int:
    """Blocks the KV cache gets within `kv_cache_bytes`: as many as the budget holds, at most
    enough for `max_num_seqs` full-length sequences.

    `cfg` is the model config (num_hidden_layers, num_key_value_heads, head_dim). Raises
    ValueError, naming the budget, the bytes per token and the minimum, when the budget cannot
    hold one sequence of `max_model_len` tokens: the budget is never raised silently.
    """
    per_token = KVPool.bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype)
    per_seq = -(-max_model_len // block_size)
    budget = kv_cache_bytes // (per_token * block_size)
    if budget < per_seq:
        need = per_seq * block_size * per_token
        raise ValueError(
            f"KV cache budget of {kv_cache_bytes} bytes ({kv_cache_bytes / GIB:.4g} GiB) holds "
            f"{budget * block_size} tokens at {per_token} bytes per token ({cfg.num_hidden_layers} "
            f"layers x {cfg.num_key_value_heads} K/V heads x {cfg.head_dim} x 2 x "
            f"{str(dtype).removeprefix('torch.')}); one sequence of max_model_len={max_model_len} "
            f"needs {need} bytes ({need / GIB:.4g} GiB): give at least that much KV cache memory "
            f"or a max_model_len of at most {budget * block_size}"
        )
    return min(budget, max_num_seqs * per_seq)


class KVPool:
    """K and V for every block: tensors [layers, Hkv, blocks, block_size, D].

    Heads come before blocks so that a gathered context is, per head, one contiguous [S, D]
    matrix, which is what the attention kernel reads fastest.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
        # Zeros, not empty: padding reads land in real blocks' unused slots, and garbage could be NaN.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        # Slot views [layers, Hkv, blocks * block_size, D] share storage with k and v.
        slots = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        self.k_slots, self.v_slots = self.k.view(slots), self.v.view(slots)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def view(
        self, tables: list[list[int]], past: list[int], new: list[int], *, sliding_window: int | None = None,
        trees: list[list[int] | None] | None = None,
    ) -> "PagedView":
        """The cache for one forward over rows that hold `past[i]` cached and `new[i]` new tokens.

        `sliding_window` must be the model config's: each query then sees only the last
        `sliding_window` positions up to its own (older blocks are not even read). `trees`: per
        row, None or the parent of each new token (a speculative tree to verify; see PagedView).
        """
        return PagedView(self, tables, past, new, sliding_window=sliding_window, trees=trees)


class PagedView:
    """One forward's window on the pool: writes the new K/V to their slots and gathers each row's
    blocks, padded to the longest row (in whole blocks), with a mask: causal within the new
    tokens, padding hidden, and keys older than `sliding_window` hidden.

    Index tensors and the mask are built once here, not per layer. `positions` [B, T] are the
    absolute positions to feed the model (padded query rows get harmless positions).
    """

    def __init__(
        self, pool: KVPool, tables: list[list[int]], past: list[int], new: list[int],
        *, sliding_window: int | None = None, trees: list[list[int] | None] | None = None,
    ) -> None:
        if not (len(tables) == len(past) == len(new)) or not tables or min(new) < 1:
            raise ValueError(
                f"bad batch: {len(tables)} tables, past={past}, new={new}; need equal lengths and new >= 1"
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window}; allowed: >= 1 or None")
        device = pool.k.device
        bs, w = pool.block_size, sliding_window
        b, t = len(new), max(new)
        total = [p + n for p, n in zip(past, new)]
        nblk = -(-max(total) // bs)
        if any(len(tb) * bs < n for tb, n in zip(tables, total)):
            raise ValueError(f"block tables too short for totals {total} at block_size {bs}")
        # Each row reads blocks lo..nblk-1 (block 0 stands in where a row has fewer); blocks
        # below lo hold only keys older than every query's window.
        lo = 0 if w is None else min(max(0, p + 1 - w) for p in past) // bs
        table_t = torch.tensor([(tb + [0] * nblk)[:nblk] for tb in tables], device=device)
        self.read_blocks = table_t[:, lo:].reshape(-1)
        s = (nblk - lo) * bs
        past_t = torch.tensor(past, device=device)
        new_t = torch.tensor(new, device=device)
        key_pos = lo * bs + torch.arange(s, device=device)  # absolute position of each read key
        self.positions = past_t[:, None] + torch.arange(t, device=device)  # [B, T]
        query_ok = torch.arange(t, device=device) < new_t[:, None]  # [B, T]
        pos = self.positions[query_ok]
        rows = torch.arange(b, device=device)[:, None].expand(b, t)[query_ok]
        self.write_idx = table_t[rows, pos // bs] * bs + pos % bs
        # Rows of the [B*T] new K/V that are real tokens; None when no row is padded.
        self.src_idx = None if min(new) == t else query_ok.reshape(-1).nonzero().squeeze(1)
        self.shape = (b, t, s)
        self.pool = pool
        self.sliding_window = w
        self.mask: torch.Tensor | None = None  # None: plain causal attention over the new tokens
        self.fresh_prompt = b == 1 and past[0] == 0
        # One row decoding one token sees exactly its keys, the last w of them: cut the read
        # keys to those and skip the mask.
        self.cut: slice | None = None
        if b == 1 and t == 1:
            self.cut = slice(max(0, total[0] - (w or total[0])) - lo * bs, total[0] - lo * bs)
        elif self.fresh_prompt:
            if w is not None and t > w:  # keys are the new tokens themselves
                self.mask = attention_mask(self.positions, torch.arange(t, device=device), w)
        else:
            key_ok = key_pos < (past_t + new_t)[:, None]
            mask = attention_mask(self.positions, key_pos, w)
            if w is not None and min(new) < t:
                # Padded query rows see all their row's real keys, so no softmax row is all -inf.
                mask |= ~query_ok[:, None, :, None] & attention_mask(self.positions, key_pos)
            self.mask = mask & key_ok[:, None, None, :]
        if trees is not None and any(tr is not None for tr in trees):
            self._tree(trees, past_t, key_pos, t)

    def _tree(self, trees: list[list[int] | None], past_t: torch.Tensor, key_pos: torch.Tensor, t: int) -> None:
        """Tree rows (speculative verification): new token i is stored at slot position past + i but
        sits at position past + depth(i) and, of the row's new tokens, sees only its ancestors and
        itself (parents come before their children)."""
        device = past_t.device
        b = len(trees)
        anc = torch.ones(b, t, t, dtype=torch.bool).tril()
        depth = torch.arange(t).expand(b, t).clone()
        for r, parents in enumerate(trees):
            if parents is None:
                continue
            n = len(parents)
            a = torch.eye(n, dtype=torch.bool)
            for i, p in enumerate(parents):
                if p >= 0:
                    if p >= i:
                        raise ValueError(f"tree row {r}: token {i} has parent {p}; a parent must come before it")
                    a[i] |= a[p]
                    depth[r, i] = depth[r, p] + 1
                else:
                    depth[r, i] = 0
            anc[r, :n, :n] = a
        anc, depth = anc.to(device), depth.to(device)
        self.positions = past_t[:, None] + depth
        new_idx = key_pos[None, :] - past_t[:, None]  # [B, S]: which new token a key is, if any
        in_new = (new_idx >= 0) & (new_idx < t)
        seen = anc.gather(2, new_idx.clamp(0, t - 1)[:, None, :].expand(b, t, -1))
        self.mask = self.mask & (~in_new[:, None, :] | seen)[:, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store this layer's new K/V ([B, Hkv, T, D]) and return the rows' full contexts."""
        b, t, s = self.shape
        h, d = k.shape[1], k.shape[-1]
        kf = k.transpose(0, 1).reshape(h, b * t, d)
        vf = v.transpose(0, 1).reshape(h, b * t, d)
        if self.src_idx is not None:
            kf, vf = kf.index_select(1, self.src_idx), vf.index_select(1, self.src_idx)
        self.pool.k_slots[layer].index_copy_(1, self.write_idx, kf)
        self.pool.v_slots[layer].index_copy_(1, self.write_idx, vf)
        if self.fresh_prompt:
            return k, v, self.mask
        # [Hkv, B * nblk, bs, D] -> [B, Hkv, S, D], contiguous per (row, head)
        k_all = self.pool.k[layer].index_select(1, self.read_blocks).view(h, b, s, d).transpose(0, 1)
        v_all = self.pool.v[layer].index_select(1, self.read_blocks).view(h, b, s, d).transpose(0, 1)
        if self.cut is not None:
            k_all, v_all = k_all[:, :, self.cut], v_all[:, :, self.cut]
        return k_all, v_all, self.mask
