"""The model runner: how one engine step runs on the model (vLLM v1's split).

It owns the K/V pool and the LM head kernel. Given rows of new tokens placed after each
sequence's cached prefix (prefill chunks, decode rows, speculative verify rows), it runs the
decoder over them together, similar-length rows sharing a forward, and returns their final
hidden states; `logits` applies the head only where the caller needs it. A drafter that declares
`aux_layers` (EAGLE-3) gets the states entering those layers from the same forward
(`run_features`).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch

from reclaim.engine.kv_cache import BlockManager, KVPool
from reclaim.models.kernels.linear import eligible, small_linear, torch_kernels

HEAD_KERNELS = ("auto", "linear")


def cpu_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for an LM head on CPU: a few rows through reclaim's kernel (SmolLM2's head,
    1 thread: 4.6 ms for 1 row, 5.1 for 4, against MKL's 9.4 and 15.3); more through oneDNN,
    which beats MKL's sgemm there (24 rows: 21 ms against 29)."""
    if eligible(x, weight):
        return small_linear(x, weight)
    if x.numel() == x.shape[-1]:
        return torch.nn.functional.linear(x, weight)
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def head_kernel(device: torch.device, dtype: torch.dtype,
                kind: str = "auto") -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The matmul the engine uses for logits: 'auto' picks reclaim's kernel or oneDNN for fp32 on
    CPU, 'linear' is plain `F.linear` (what transformers uses; benchmarks compare both)."""
    if kind not in HEAD_KERNELS:
        raise ValueError(f"head kernel {kind!r} is unknown; allowed: {list(HEAD_KERNELS)}")
    if kind == "auto" and device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        return cpu_linear
    return torch.nn.functional.linear


@dataclass
class Row:
    """New tokens of one sequence: token_ids placed at positions start, start + 1, ...

    parents: a tree of new tokens instead (a draft to verify): token i's parent among them (-1:
    none, it follows the cached prefix). Token i is stored in slot start + i but sits at position
    start + depth(i) and sees the prefix and its own ancestors only.
    """

    seq_id: str
    start: int
    token_ids: list[int]
    parents: list[int] | None = None


def group_rows(rows: list[Row], max_waste: float = 0.25, forward_tokens: int = 8,
               pad_cost: float = 0.5) -> list[list[int]]:
    """Indices of `rows` split into forwards of similar length: a row joins the current forward
    unless its padding, at `pad_cost` of a real token (the model's layers skip padded tokens;
    only attention runs over them), would exceed `max_waste` of the work plus `forward_tokens`,
    what one more forward costs in tokens (reading every weight again: a few tokens' worth on a
    CPU, far more on a GPU). So verify rows of a few tokens ride with decode rows of 1 instead of
    paying for a forward of their own."""
    groups: list[list[int]] = []
    cur: list[int] = []
    work = 0
    for i in sorted(range(len(rows)), key=lambda i: len(rows[i].token_ids)):
        n = len(rows[i].token_ids)
        if cur and pad_cost * ((len(cur) + 1) * n - work - n) > max_waste * (work + n) + forward_tokens:
            groups.append(cur)
            cur, work = [], 0
        cur.append(i)
        work += n
    if cur:
        groups.append(cur)
    return groups


class ModelRunner:
    """Runs rows of new tokens through a reclaim causal LM against the paged K/V cache."""

    def __init__(self, model: torch.nn.Module, blocks: BlockManager, device: torch.device,
                 *, head: str = "auto") -> None:
        cfg = model.config
        dtype = next(model.parameters()).dtype
        self.device = device
        self.model = model.to(device).eval()
        self.blocks = blocks
        self.pool = KVPool(cfg.num_hidden_layers, blocks.num_blocks, blocks.block_size,
                           cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=device)
        self._head = head_kernel(device, dtype, head)
        # head='linear' also keeps the layers on F.linear: transformers' kernels throughout.
        self._kernels = torch_kernels if head == "linear" else nullcontext
        self.sliding_window = getattr(cfg, "sliding_window", None)

    def move_kv(self, seq_id: str, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of positions `src` of a sequence to positions `dst` (every layer): an
        accepted tree path moves into place after the prefix."""
        pairs = [(s, d) for s, d in zip(src, dst) if s != d]
        if not pairs:
            return
        table, bs = self.blocks.tables[seq_id], self.blocks.block_size
        slot = lambda p: table[p // bs] * bs + p % bs  # noqa: E731
        s_idx = torch.tensor([slot(s) for s, _ in pairs], device=self.device)
        d_idx = torch.tensor([slot(d) for _, d in pairs], device=self.device)
        for kv in (self.pool.k_slots, self.pool.v_slots):
            kv[:, :, d_idx] = kv[:, :, s_idx]

    def write_kv(self, seq_id: str, start: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Store K/V computed elsewhere (a recorded prefill) for positions start.. of a sequence:
        per layer [1, Hkv, T, D] (any dtype and device; copied, never kept)."""
        t = keys[0].shape[2]
        table, bs = self.blocks.tables[seq_id], self.blocks.block_size
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(start, start + t)], device=self.device)
        with torch.no_grad():
            for layer, (k, v) in enumerate(zip(keys, values)):
                dtype = self.pool.k_slots.dtype
                self.pool.k_slots[layer].index_copy_(1, slots, k[0].detach().to(self.device, dtype))
                self.pool.v_slots[layer].index_copy_(1, slots, v[0].detach().to(self.device, dtype))

    def forward(self, rows: list[Row]) -> torch.Tensor:
        """One model forward over `rows` (padded to the longest); final hidden states [B, T, H]."""
        return self._forward(rows, None).hidden

    def _forward(self, rows: list[Row], aux_layers: tuple[int, ...] | None) -> Any:
        new = [len(r.token_ids) for r in rows]
        t = max(new)
        view = self.pool.view([self.blocks.tables[r.seq_id] for r in rows], [r.start for r in rows], new,
                              sliding_window=self.sliding_window, trees=[r.parents for r in rows])
        input_ids = torch.tensor([r.token_ids + [0] * (t - len(r.token_ids)) for r in rows], device=self.device)
        taps = {} if aux_layers is None else {"aux_layers": aux_layers}  # only asked of models that have them
        with self._kernels():
            return self.model(input_ids, view.positions, view, return_hidden=True, compute_logits=False, **taps)

    def run(self, rows: list[Row]) -> list[torch.Tensor]:
        """Final hidden states of every row's tokens ([len(token_ids), H] each), grouping rows of
        similar length into one forward."""
        return [h for h, _ in self.run_features(rows)]

    def run_features(self, rows: list[Row], aux_layers: tuple[int, ...] | None = None
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each row's final hidden states and its drafter features from the same forward: the
        states entering `aux_layers`, concatenated ([len(token_ids), len(aux_layers) * H]), or the
        final states again without aux_layers."""
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(rows)
        for group in group_rows(rows):
            got = self._forward([rows[i] for i in group], aux_layers)
            feats = got.hidden if aux_layers is None else got.aux
            for j, i in enumerate(group):
                n = len(rows[i].token_ids)
                out[i] = (got.hidden[j, :n], feats[j, :n])
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits from final hidden states [..., H], as the model's lm_head computes them."""
        head = self.model.lm_head
        out = self._head(hidden, head.weight)
        if head.bias is not None:
            out = out + head.bias
        return out.float()
