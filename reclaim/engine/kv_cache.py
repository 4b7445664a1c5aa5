"""Paged KV cache: fixed-size blocks, a free list, per-sequence block tables, and the per-forward
view that a model's attention calls (the AttentionCache protocol of reclaim/models/cache.py).

`BlockManager` is plain Python (which blocks a sequence owns) so the scheduler can be tested
without tensors; `KVPool` holds the tensors and builds a `PagedView` for one forward;
`plan_kv_blocks` sizes the pool within a memory budget.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from reclaim.engine.config import GIB
from reclaim.models.cache import causal_mask, needs_mask
from reclaim.models.kernels import flashinfer_paged
from reclaim.models.kernels.flex_paged import flex_index
from reclaim.models.kernels.paged import PagedRows, paged_attention
from reclaim.models.kernels.paged import write as paged_write


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
    dtype: torch.dtype, num_kv_heads: int | None = None,
) -> int:
    """Blocks the KV cache gets within `kv_cache_bytes`: as many as the budget holds, at most
    enough for `max_num_seqs` full-length sequences.

    `cfg` is the model config (num_hidden_layers, num_key_value_heads, head_dim); `num_kv_heads`
    the K/V heads this pool holds, if not all (a tensor-parallel rank's share). Raises
    ValueError, naming the budget, the bytes per token and the minimum, when the budget cannot
    hold one sequence of `max_model_len` tokens: the budget is never raised silently.
    """
    heads = cfg.num_key_value_heads if num_kv_heads is None else num_kv_heads
    per_token = KVPool.bytes_per_token(cfg.num_hidden_layers, heads, cfg.head_dim, dtype)
    per_seq = -(-max_model_len // block_size)
    budget = kv_cache_bytes // (per_token * block_size)
    if budget < per_seq:
        need = per_seq * block_size * per_token
        raise ValueError(
            f"KV cache budget of {kv_cache_bytes} bytes ({kv_cache_bytes / GIB:.4g} GiB) holds "
            f"{budget * block_size} tokens at {per_token} bytes per token ({cfg.num_hidden_layers} "
            f"layers x {heads} K/V heads x {cfg.head_dim} x 2 x "
            f"{str(dtype).removeprefix('torch.')}); one sequence of max_model_len={max_model_len} "
            f"needs {need} bytes ({need / GIB:.4g} GiB): give at least that much KV cache memory "
            f"or a max_model_len of at most {budget * block_size}"
        )
    return min(budget, max_num_seqs * per_seq)


LAYOUTS = ("blocks", "heads", "pages")
BACKENDS = ("auto", "flex", "flashinfer")


def attention_backend() -> str:
    """RECLAIM_ATTENTION_BACKEND (after vLLM's VLLM_ATTENTION_BACKEND): auto (on a CPU the C kernel;
    on CUDA FlashInfer where it takes the cache's dtype and head_dim and is installed, else
    FlexAttention; where none runs, each row's keys gathered and one SDPA), flex (FlexAttention,
    on a CPU too) or flashinfer (FlashInfer's pages wherever it can run, else the gathering path)."""
    name = os.environ.get("RECLAIM_ATTENTION_BACKEND", "auto").lower()
    if name not in BACKENDS:
        raise ValueError(f"RECLAIM_ATTENTION_BACKEND={name!r}; allowed: {list(BACKENDS)}")
    if name == "flashinfer" and not flashinfer_paged.installed():
        raise ValueError("RECLAIM_ATTENTION_BACKEND=flashinfer, but flashinfer is not installed "
                         "(pip install flashinfer-python); or leave it to auto")
    return name


def attention_layout(device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None) -> str:
    """The pool layout the attention backend reads in place: "blocks" for the C kernel (and the
    torch path), "heads" for FlexAttention, "pages" for FlashInfer (auto: on CUDA where it can
    take a cache of `dtype` and `head_dim`)."""
    backend = attention_backend()
    if backend == "flashinfer":
        return "pages"
    if backend == "flex":
        return "heads"
    if device.type == "cpu":
        return "blocks"
    usable = dtype is not None and head_dim is not None and flashinfer_paged.why_not(device, dtype, head_dim) is None
    return "pages" if usable else "heads"


def free_storage(tensors: Iterable[torch.Tensor]) -> int:
    """Shrink each tensor's storage to nothing (shapes and identities kept, so every reference
    to it stays valid; shared storage counted once); returns the bytes freed."""
    freed = 0
    for t in {t.untyped_storage().data_ptr(): t for t in tensors}.values():
        freed += t.untyped_storage().nbytes()
        t.untyped_storage().resize_(0)
    return freed


def restore_storage(tensors: Iterable[torch.Tensor]) -> None:
    """Storage again for tensors `free_storage` emptied (contents undefined)."""
    for t in tensors:
        if t.untyped_storage().nbytes() == 0:
            t.untyped_storage().resize_(t.numel() * t.element_size())


class KVPool:
    """K and V for every block, a tensor per layer: k[layer] [blocks, Hkv, D, block_size] (keys
    transposed within a block), v[layer] [blocks, Hkv, block_size, D]: the layout paged attention
    reads in place (models/kernels/paged.py). One allocation per layer, not one for all: a
    compiled graph writes each layer's pool, and writes to views of one shared tensor are not
    kept apart there.
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
        layout: str | None = None,
    ) -> None:
        # One block past num_blocks, never handed out: where padding tokens' K/V go.
        self.spare = num_blocks
        shape = (num_blocks + 1, num_kv_heads, block_size, head_dim)
        self.layout = attention_layout(torch.device(device), dtype, head_dim) if layout is None else layout
        if self.layout not in LAYOUTS:
            raise ValueError(f"KV pool layout={self.layout!r}; allowed: {list(LAYOUTS)}")
        # Zeros, not empty: a kernel never uses unwritten slots, but garbage could be NaN in a dump.
        if self.layout == "blocks":  # the C kernel's: one head's keys of a block contiguous, transposed
            self.k = [torch.zeros(shape, dtype=dtype, device=device).transpose(2, 3).contiguous()
                      for _ in range(num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        elif self.layout == "pages":  # FlashInfer's HND pages: keys stored as values are, seen transposed
            self.k = [torch.zeros(shape, dtype=dtype, device=device).transpose(2, 3) for _ in range(num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        else:  # FlexAttention's: stored [Hkv, blocks, bs, D], seen through views of the shapes above
            heads = (num_kv_heads, num_blocks + 1, block_size, head_dim)
            self.k = [torch.zeros(heads, dtype=dtype, device=device).permute(1, 0, 3, 2) for _ in range(num_layers)]
            self.v = [torch.zeros(heads, dtype=dtype, device=device).permute(1, 0, 2, 3) for _ in range(num_layers)]
        self.block_size = block_size
        self.dtype, self.device = dtype, torch.device(device)
        # Whether FlashInfer reads this pool (decided once: a view asks every forward).
        self.flashinfer = self.layout == "pages" and flashinfer_paged.why_not(self.device, dtype, head_dim) is None
        self._staged: tuple[torch.Tensor, torch.Tensor] | None = None  # pinned host, device buffers

    def free(self) -> int:
        """Give the pool's memory back (the engine's sleep); returns the bytes freed."""
        return free_storage([*self.k, *self.v])

    def restore(self) -> None:
        """The pool's memory again after `free`, zeroed (its old contents are gone)."""
        restore_storage([*self.k, *self.v])
        for t in (*self.k, *self.v):
            t.zero_()

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def slots(self, table: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) index tensors of a sequence's `positions` under its block `table`."""
        bs = self.block_size
        return (torch.tensor([table[p // bs] for p in positions], device=self.device),
                torch.tensor([p % bs for p in positions], device=self.device))

    def write(self, layer: int, where: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [N, Hkv, D] at N (block, offset) slots of `layer`."""
        paged_write(self.k[layer], self.v[layer], where, k, v)

    def move(self, src: tuple[torch.Tensor, torch.Tensor], dst: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Copy the K/V of slots `src` to slots `dst` in every layer."""
        for k, v in zip(self.k, self.v):
            k[dst[0], :, :, dst[1]] = k[src[0], :, :, src[1]]
            v[dst[0], :, dst[1]] = v[src[0], :, src[1]]

    def view(
        self, tables: list[list[int]], past: list[int], new: list[int], *, sliding_window: int | None = None,
        trees: list[list[int] | None] | None = None, token_ids: list[list[int]] | None = None,
        pad_to: int | None = None, table_width: int | None = None,
    ) -> "PagedView":
        """The cache for one forward over rows that hold `past[i]` cached and `new[i]` new tokens.

        `sliding_window` must be the model config's: each query then sees only the last
        `sliding_window` positions up to its own (older blocks are not even read). `trees`: per
        row, None or the parent of each new token (a speculative tree to verify; see PagedView).
        `token_ids`: the rows' new tokens, staged with the rest as the view's `input_ids`.
        `pad_to`, `table_width`: tokens (and paged rows) padded to that many and block tables to
        that width, for a captured graph's static shapes.
        """
        return PagedView(self, tables, past, new, sliding_window=sliding_window, trees=trees,
                         token_ids=token_ids, pad_to=pad_to, table_width=table_width)

    def stage(self, values: list[int]) -> torch.Tensor:
        """`values` as an int32 tensor on the pool's device: on a GPU through a persistent pinned
        host buffer and one asynchronous copy into a persistent device buffer (valid until the
        next call: a step reads its results before the next one stages)."""
        host = torch.tensor(values, dtype=torch.int32)
        if self.device.type == "cpu":
            return host
        n = len(values)
        if self._staged is None or self._staged[0].numel() < n:
            cap = max(n, 2 * (0 if self._staged is None else self._staged[0].numel()), 1 << 14)
            self._staged = (torch.empty(cap, dtype=torch.int32, pin_memory=True),
                            torch.empty(cap, dtype=torch.int32, device=self.device))
        pinned, dev = self._staged
        pinned[:n].copy_(host)
        return dev[:n].copy_(pinned[:n], non_blocking=True)


def tree_depths(parents: list[int], row: int) -> tuple[list[int], list[list[bool]]]:
    """Each new token's depth in a speculative tree and which of the new tokens it sees (its
    ancestors and itself), from each token's parent among them (-1: the cached prefix)."""
    n = len(parents)
    depth, seen = [0] * n, [[False] * n for _ in range(n)]
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"tree row {row}: token {i} has parent {p}; a parent must come before it")
        if p >= 0:
            depth[i] = depth[p] + 1
            seen[i] = list(seen[p])
        seen[i][i] = True
    return depth, seen


class PagedView:
    """One forward's window on the pool, over rows packed one after another (no padding): the
    model runs on [1, N] tokens, `positions` [1, N]; each layer's attention (`attend`) writes
    the new K/V to their slots and attends in place.

    Rows whose tokens are a whole fresh prompt attend to their own new K/V (SDPA, causal); every
    other row (decodes, chunks after a cached prefix, speculative trees) reads the pool through
    the paged kernel (models/kernels/paged.py). Everything a layer needs is built here once, on
    the host, and copied to the device in one go (`input_ids` too, when `token_ids` are given).
    """

    def __init__(
        self, pool: KVPool, tables: list[list[int]], past: list[int], new: list[int],
        *, sliding_window: int | None = None, trees: list[list[int] | None] | None = None,
        token_ids: list[list[int]] | None = None, pad_to: int | None = None, table_width: int | None = None,
    ) -> None:
        if not (len(tables) == len(past) == len(new)) or not tables or min(new) < 1:
            raise ValueError(
                f"bad batch: {len(tables)} tables, past={past}, new={new}; need equal lengths and new >= 1"
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window}; allowed: >= 1 or None")
        device = pool.device
        bs, w = pool.block_size, sliding_window
        trees = trees or [None] * len(new)
        total = [p + n for p, n in zip(past, new)]
        if any(len(tb) * bs < n for tb, n in zip(tables, total)):
            raise ValueError(f"block tables too short for totals {total} at block_size {bs}")
        starts = [0]
        for n in new:
            starts.append(starts[-1] + n)
        pos: list[int] = []
        hi: list[int] = []
        blk: list[int] = []
        tree_rows: dict[int, list[list[bool]]] = {}
        for r, (tb, p, n, parents) in enumerate(zip(tables, past, new, trees)):
            blk += [tb[s // bs] for s in range(p, p + n)]
            if parents is None:
                pos += range(p, p + n)
                hi += range(p + 1, p + n + 1)
            else:
                if len(parents) != n:
                    raise ValueError(f"tree row {r} has {len(parents)} parents for {n} new tokens")
                depth, seen = tree_depths(parents, r)
                pos += [p + d for d in depth]
                hi += [p + n] * n
                tree_rows[r] = seen
        # FlashInfer (a "pages" pool on CUDA) takes every row from the pool in one planned call.
        self.flashinfer_plan, self._flashinfer = None, None
        if pool.flashinfer and pad_to is None:
            self.flashinfer_plan = flashinfer_paged.plan_rows(tables, past, new, bs, tree_rows, pos, w)
        # Otherwise fresh prompts attend to their own K/V; the rest read the pool.
        self.fresh = [] if self.flashinfer_plan is not None else [
            r for r in range(len(new)) if past[r] == 0 and new[r] > 1 and r not in tree_rows]
        fresh = set(self.fresh)
        paged = [r for r in range(len(new)) if r not in fresh]
        self.spans = list(zip(starts[:-1], starts[1:]))
        n, width = starts[-1], max([len(tables[r]) for r in paged], default=1)
        offsets = [s % bs for p, m in zip(past, new) for s in range(p, p + m)]
        # Static shapes for a captured graph: padding tokens (no row reads them; their K/V go to
        # the pool's spare block) and padding rows (no queries), tables of a fixed width.
        real = n
        if pad_to is not None and pad_to > n:
            extra = pad_to - n
            pos, hi, blk, offsets = pos + [0] * extra, hi + [1] * extra, blk + [pool.spare] * extra, offsets + [0] * extra
            token_ids = None if token_ids is None else [*token_ids, [0] * extra]
            n = pad_to
        pad_rows = 0 if pad_to is None else max(0, pad_to - len(paged))
        if table_width is not None:
            if table_width < width:
                raise ValueError(f"table_width={table_width} < the longest block table ({width} blocks)")
            width = table_width
        # Every index the forward needs, in one int32 buffer: built on the host, copied to the
        # device at once, then cut into views.
        ids = [t for row in token_ids for t in row] if token_ids is not None else [0] * n
        if len(ids) != n:
            raise ValueError(f"{len(ids)} token ids for a view of {n} new tokens")
        sections = [("ids", ids), ("positions", pos), ("blk", blk), ("off", offsets), ("hi", hi),
                    ("tables", [b for r in paged for b in (tables[r] + [0] * width)[:width]] + [0] * (pad_rows * width)),
                    ("q_start", [starts[r] for r in paged] + [0] * pad_rows),
                    ("q_end", [starts[r + 1] for r in paged] + [0] * pad_rows),
                    ("past", [past[r] for r in paged] + [0] * pad_rows),
                    ("tree_row", [int(r in tree_rows) for r in paged] + [0] * pad_rows)]
        if pool.layout == "heads":  # FlexAttention's padded query blocks (kernels/flex_paged.py)
            block_row, q_index = flex_index([starts[r] for r in paged] + [0] * pad_rows,
                                            [starts[r + 1] for r in paged] + [0] * pad_rows, n)
            sections += [("flex_rows", block_row), ("flex_index", q_index)]
        buf = pool.stage([v for _, xs in sections for v in xs])
        view, at = {}, 0
        for name, xs in sections:
            view[name], at = buf[at:at + len(xs)], at + len(xs)
        tree = None
        if tree_rows:
            t = max(len(s) for s in tree_rows.values())
            mask = [[False] * t for _ in range(n)]  # (no padding: trees never run a captured graph)
            for r, seen in tree_rows.items():
                for i, row in enumerate(seen):
                    mask[starts[r] + i][: len(row)] = row
            tree = torch.tensor(mask, dtype=torch.uint8, device=device)
        # What the torch path gathers, known here without reading the device: with a fixed table
        # width (a captured graph) the same for every step.
        if table_width is not None:
            max_new, first_key, max_keys = max(new[r] for r in paged) if paged else 1, 0, width * bs
        else:
            max_new = max([new[r] for r in paged], default=1)
            max_keys = max([hi[i] for r in paged for i in range(starts[r], starts[r + 1])], default=1)
            first_key = 0 if w is None else max(0, min([pos[i] for r in paged for i in range(starts[r], starts[r + 1])],
                                                       default=0) - w + 1)
        self.rows = PagedRows(
            tables=view["tables"].view(len(paged) + pad_rows, width), q_start=view["q_start"], q_end=view["q_end"],
            past=view["past"], q_pos=view["positions"], q_hi=view["hi"], tree=tree, tree_row=view["tree_row"],
            window=w, max_new=max_new, first_key=first_key, max_keys=max_keys,
            flex=(view["flex_rows"], view["flex_index"]) if pool.layout == "heads" else None,
        )
        self.input_ids = view["ids"][None]  # [1, N]: the token ids given, if any
        self.positions = view["positions"][None]  # [1, N]
        self.slot_mapping = (view["blk"], view["off"])  # where each new token's K/V goes
        self.pool = pool
        self.sliding_window = w
        self.num_tokens = real  # the rows' own tokens (input_ids may hold padding after them)

    def pack(self, token_ids: list[list[int]]) -> torch.Tensor:
        """The rows' new token ids as the model's input [1, N] (a view built without them)."""
        flat = [t for row in token_ids for t in row]
        if len(flat) != self.num_tokens:
            raise ValueError(f"{len(flat)} token ids for a view of {self.num_tokens} new tokens")
        return torch.tensor(flat, device=self.pool.device)[None]

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """A packed output [1, N, ...] as each row's [new tokens, ...]."""
        return [x[0, a:b] for a, b in self.spans]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        raise TypeError("a PagedView attends in place: call attend(layer, q, k, v)")

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this layer's new K/V ([N, Hkv, D]) in their slots and return the attention of
        the queries ([N, nh, D]) as [N, nh, D]. Under torch.compile (decode rows only: no fresh
        prompt) both are one opaque op."""
        if torch.compiler.is_compiling():
            r = self.rows
            return torch.ops.reclaim.paged_attention(q, k, v, self.pool.k[layer], self.pool.v[layer],
                                                     *self.slot_mapping, r.tables, r.q_start, r.q_end, r.past,
                                                     r.q_pos, r.q_hi, r.tree, r.tree_row, r.window or 0,
                                                     r.max_new, r.first_key, r.max_keys)
        self.pool.write(layer, self.slot_mapping, k, v)
        if self.flashinfer_plan is not None:
            try:
                if self._flashinfer is None:  # planned at the first layer, once q's heads are known
                    self._flashinfer = flashinfer_paged.Attention(
                        self.flashinfer_plan, num_heads=q.shape[1], num_kv_heads=k.shape[1], head_dim=q.shape[2],
                        block_size=self.pool.block_size, dtype=self.pool.dtype, device=q.device)
                return self._flashinfer.run(q, self.pool.k[layer], self.pool.v[layer])
            except Exception as e:  # noqa: BLE001 - its build or kernel failed: gather from the same pages
                flashinfer_paged.failed(e)
                self.flashinfer_plan, self.pool.flashinfer = None, False  # self.rows holds every row
        out = torch.empty_like(q)
        w, gqa = self.sliding_window, k.shape[1] != q.shape[1]
        for r in self.fresh:
            a, b = self.spans[r]
            mask = causal_mask(b - a, 0, q.device, w) if needs_mask(b - a, 0, w) else None
            o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
                                               v[a:b].transpose(0, 1)[None], attn_mask=mask,
                                               is_causal=mask is None, enable_gqa=gqa)
            out[a:b] = o[0].transpose(0, 1)
        paged_attention(q, self.pool.k[layer], self.pool.v[layer], self.rows, out)
        return out
