"""Exact adjoint training of a Mamba-1 or Mamba-2 LM in O(chunk) activation memory.

Pass 1 runs the sequence chunk by chunk without autograd and keeps only each layer's state
(h, conv tail) at every chunk start. Pass 2 walks the chunks in reverse: it re-runs the chunk with
autograd from those states through every layer, takes the loss gradient in sub-chunks (the
vocabulary never materialises for the whole sequence), and pulls it back through the chunk's
graph together with each layer's state adjoint carried from the next chunk (mu = dL/dh and the
conv-tail cotangent). The result equals `loss.backward()` up to float reassociation, for any chunk
size, at the cost of one extra no-grad forward. `recompute="layer"` cuts the same backward into
(layer, chunk) shards (`cell_forward`/`cell_backward`, also used by the parallel schedules in
`parallel.py`): one layer's graph at a time, for one more no-grad forward of the chunk.

Unlike the paper's Prop. 3, the cotangent a layer receives includes every path through the layers
above it (they are back-propagated first, within the chunk, and carry their own state adjoints),
and layer inputs are not held fixed.

Truncated mode (`window=W`) replaces each layer's state adjoint, for its parameter and input
gradients, by mu_W(i) = mu(i) - (prod_{j=i+1}^{i+W} Abar_j) mu(i+W) (see window.Window): each
output reaches back through at most W state transitions per layer. The conv (K-1 tokens), the
skip D, the C-path and the carried exact mu are untouched; W >= T is exact.

Families: a layer's state and scan come from its model family (`KERNELS`). A Mamba-2 layer
carries h [heads, head_dim, state] and its conv tail across chunks; inside a chunk its SSD runs in
the chunked form (quadratic inside SSD blocks, the state carried between them) and autograd
through it is exact; the truncated mode runs the SSD's hand-written backward, whose per-head state
adjoint the same Window truncates.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from reclaim.models.bamba import RotaryAttention
from reclaim.models.kernels.scan import ScanFn, selective_scan
from reclaim.models.mamba import MambaMixer
from reclaim.models.mamba2 import Mamba2Mixer
from reclaim.models.nemotron_h import MLP, Attention, KVState
from reclaim.models.ssd import ssd_scan
from reclaim.ssm.window import Window, scan_for

RECOMPUTE = ("chunk", "layer")  # what pass 2 holds an autograd graph for: see adjoint_loss_backward


# Mixer type -> its scan kernel (each takes an `adjoint=` hook for the truncated mode); None for
# mixers without one (attention, MLP), whose state (if any) is carried exactly.
KERNELS: dict[type, ScanFn | None] = {MambaMixer: selective_scan, Mamba2Mixer: ssd_scan,
                                      Attention: None, RotaryAttention: None, MLP: None}


def layer_kernel(layer: nn.Module) -> ScanFn | None:
    """The scan kernel of a layer's mixer: Mamba-1's selective scan, Mamba-2's SSD, or None."""
    mixer = getattr(layer, "mixer", layer)
    if type(mixer) not in KERNELS:
        supported = [t.__name__ for t in KERNELS]
        raise ValueError(f"no adjoint for layer type {type(mixer).__name__}; supported: {supported}")
    return KERNELS[type(mixer)]


def kernel_args(layer: nn.Module, window: Window | None) -> dict:
    """What `forward_chunk` takes besides the input and state: its scan, truncated if `window`."""
    kernel = layer_kernel(layer)
    return {} if kernel is None else {"scan": scan_for(window, kernel)}


def check_family(model: nn.Module, chunk: int, window: int | None) -> None:
    """Refuse a model whose layers have no adjoint here, and a Mamba-2 window shorter than a chunk
    (the issue's contract for Mamba-2 and its hybrids; Mamba-1 keeps accepting any window)."""
    kernels = [layer_kernel(layer) for layer in model.backbone.layers]
    if window is not None and window < chunk and ssd_scan in kernels:
        raise ValueError(f"window ({window}) must be >= chunk ({chunk}) for Mamba-2 layers")


def _leaf(state: tuple) -> tuple:
    """The state as fresh autograd leaves (same NamedTuple type)."""
    return state._make(t.detach().requires_grad_() for t in state)


def _grads(leaf: tuple) -> tuple:
    """The adjoint of a state made by `_leaf` (zeros where nothing reached it)."""
    return leaf._make(t.grad if t.grad is not None else torch.zeros_like(t) for t in leaf)


def chunk_bounds(length: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of each time chunk; the last may be short."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return [(s, min(length, s + chunk)) for s in range(0, length, chunk)]


def aligned_labels(input_ids: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    """Target per position (position t predicts labels[t + 1]; the last is ignored, -100)."""
    labels = input_ids if labels is None else labels
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} != input_ids shape {tuple(input_ids.shape)}")
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], 1)


def layer_windows(window: int | None, length: int, n_layers: int) -> list[Window | None]:
    """One truncation state per layer; a window spanning the sequence truncates nothing (None)."""
    return [Window(window) if window is not None and window < length else None
            for _ in range(n_layers)]


def cell_forward(layer: nn.Module, x: torch.Tensor, state: tuple) -> tuple[torch.Tensor, tuple]:
    """One (layer, chunk) shard without autograd: (layer output, state at the chunk's end)."""
    with torch.no_grad():
        y, *after = layer.forward_chunk(x, *state)
    return y, state._make(after)


def cell_backward(
    layer: nn.Module,
    x: torch.Tensor,
    state: tuple,
    dy: torch.Tensor,
    dstate: tuple | None,
    window: Window | None = None,
) -> tuple[torch.Tensor, tuple]:
    """One shard's backward: recompute with autograd and pull (dy, end-state adjoint) through it.

    Accumulates the layer's parameter .grad; returns (dL/dx, adjoint of the start state). dstate
    None means nothing downstream reads the end state (the last chunk). `window` truncates.
    """
    x = x.detach().requires_grad_()
    leaf = _leaf(state)
    with torch.enable_grad():
        y, *after = layer.forward_chunk(x, *leaf, **kernel_args(layer, window))
        outs, grads = [y], [dy]
        if dstate is not None:
            outs += after
            grads += list(dstate)
        torch.autograd.backward(outs, grads)
    return x.grad, _grads(leaf)


def head_backward(
    model: nn.Module, r: torch.Tensor, labels: torch.Tensor, scale: float, loss_chunk: int
) -> tuple[float, torch.Tensor]:
    """Summed CE of final residual r [B, L, H] vs labels [B, L], in sub-chunks: (sum, dL/dr).

    Gradients are of `scale * sum`, accumulated into norm_f and lm_head (and a tied embedding).
    """
    r = r.detach().requires_grad_()
    total = 0.0
    for s, e in chunk_bounds(r.shape[1], loss_chunk):
        with torch.enable_grad():
            logits = model.logits(model.backbone.norm_f(r[:, s:e]))
            loss = F.cross_entropy(
                logits.flatten(0, 1), labels[:, s:e].flatten(), ignore_index=-100, reduction="sum"
            )
            (loss * scale).backward()
        total += loss.item()
    return total, r.grad if r.grad is not None else torch.zeros_like(r)


def embed_backward(model: nn.Module, ids: torch.Tensor, dr: torch.Tensor) -> None:
    """Accumulate the embedding gradient of one chunk of token ids."""
    with torch.enable_grad():
        torch.autograd.backward(model.backbone.embeddings(ids), dr)


def _stash(state: tuple, offload: bool) -> tuple:
    if not offload:
        return state
    pin = torch.cuda.is_available()  # pinned pages need a CUDA runtime; plain host memory otherwise
    return state._make(torch.empty(s.shape, dtype=s.dtype, pin_memory=pin).copy_(s, non_blocking=pin)
                       for s in state)


def _fetch(state: tuple, device: torch.device) -> tuple:
    return state._make(s.to(device, non_blocking=True) for s in state)


class _Prefix(NamedTuple):
    """Placeholder for keys and values at a chunk start: the first `length` of the final ones."""

    length: int


def keep_state(state: tuple, offload: bool = False) -> tuple:
    """What a chunk start keeps of a layer's state: the state itself (in pinned host memory if
    `offload`), or for keys and values only their length (`prefix_views` makes them views later),
    so a layer's earlier keys are held once, not once per chunk."""
    return _Prefix(state.k.shape[2]) if isinstance(state, KVState) else _stash(state, offload)


def prefix_view(kept: tuple, final: tuple) -> tuple:
    """A chunk-start state from `keep_state`: keys and values as a view of the layer's `final` ones."""
    return KVState(*(t[:, :, :kept.length] for t in final)) if isinstance(kept, _Prefix) else kept


def forward_states(
    model: nn.Module, input_ids: torch.Tensor, bounds: list[tuple[int, int]], offload: bool = False
) -> list[list[tuple]]:
    """Pass 1 without autograd: every layer's state at every chunk start (saved[chunk][layer]),
    in pinned host memory if `offload`.

    An attention layer's state (the keys and values so far) is not copied per chunk: every chunk's
    is a view of the first tokens of the final one, O(T) bytes in all, left on its device.
    """
    states = model.zero_states(input_ids.shape[0])
    saved: list[list] = []
    with torch.no_grad():
        for s, e in bounds:
            saved.append([keep_state(st, offload) for st in states])
            x = model.backbone.embeddings(input_ids[:, s:e])
            for k, layer in enumerate(model.backbone.layers):
                x, states[k] = cell_forward(layer, x, states[k])
    return [[prefix_view(st, final) for st, final in zip(row, states)] for row in saved]


def chunk_inputs(model: nn.Module, ids: torch.Tensor, states: list[tuple]) -> list[torch.Tensor]:
    """Residual stream entering each layer (and leaving the last) over one chunk, without autograd."""
    with torch.no_grad():
        x = model.backbone.embeddings(ids)
        xs = [x]
        for layer, st in zip(model.backbone.layers, states):
            x, _ = cell_forward(layer, x, st)
            xs.append(x)
    return xs


def chunk_backward(
    model: nn.Module,
    ids: torch.Tensor,
    states: list[tuple],
    targets: torch.Tensor,
    carries: list[tuple | None],
    windows: list[Window | None],
    scale: float,
    loss_chunk: int,
) -> tuple[float, list[tuple]]:
    """One time chunk's backward through every layer at once: (summed loss, start-state adjoints).

    Recomputes the chunk with autograd from its start states (one graph for all layers, so each
    layer's input is not recomputed a second time), takes the loss gradient in sub-chunks, then
    pulls it, with each layer's carried end-state adjoint, through the graph in one backward. For
    an attention layer that adjoint is dL/d(keys, values) of every earlier token: what later
    chunks' queries sent back, fed here into the chunk's own keys and values and passed on.
    """
    leaves = [_leaf(st) for st in states]
    ends: list[torch.Tensor] = []
    end_grads: list[torch.Tensor] = []
    with torch.enable_grad():
        x = model.backbone.embeddings(ids)
        for layer, st, carry, window in zip(model.backbone.layers, leaves, carries, windows):
            x, *after = layer.forward_chunk(x, *st, **kernel_args(layer, window))
            if carry is not None:
                ends += after
                end_grads += list(carry)
    loss, dr = head_backward(model, x, targets, scale, loss_chunk)
    torch.autograd.backward([x, *ends], [dr, *end_grads])
    return loss, [_grads(st) for st in leaves]


def adjoint_loss_backward(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    chunk: int,
    window: int | None = None,
    loss_chunk: int = 1024,
    offload: bool | None = None,
    recompute: str = "chunk",
) -> float:
    """Accumulate into .grad what `loss.backward()` gives for the mean next-token CE; return it.

    chunk: tokens per recomputed time chunk (Q). window: truncate each layer's state adjoint to
    that many transitions (None: exact). loss_chunk: tokens per logits sub-chunk. offload: keep
    boundary states in pinned host memory (default: when the model is on a GPU). recompute:
    "chunk" holds one chunk's autograd graph for all layers at once (fastest); "layer" holds one
    layer's at a time and re-runs the chunk's layer inputs once more without autograd (about 1/L
    of the graph memory for L layers, at one more forward).
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    if loss_chunk < 1:
        raise ValueError(f"loss_chunk must be >= 1, got {loss_chunk}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {list(RECOMPUTE)}, got {recompute!r}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    check_family(model, chunk, window)
    device = input_ids.device
    if offload is None:
        offload = device.type == "cuda"
    targets = aligned_labels(input_ids, labels)
    n_tokens = int((targets != -100).sum())
    if n_tokens == 0:
        raise ValueError("no token to predict: need T >= 2 and at least one label != -100")
    bounds = chunk_bounds(input_ids.shape[1], chunk)
    layers = model.backbone.layers
    windows = layer_windows(window, input_ids.shape[1], len(layers))

    saved = forward_states(model, input_ids, bounds, offload)
    carries: list[tuple | None] = [None] * len(layers)
    total = 0.0
    for c in reversed(range(len(bounds))):
        s, e = bounds[c]
        ids = input_ids[:, s:e]
        states = [_fetch(st, device) for st in saved[c]] if offload else saved[c]
        if recompute == "chunk":
            loss, carries = chunk_backward(model, ids, states, targets[:, s:e], carries, windows,
                                           1.0 / n_tokens, loss_chunk)
        else:
            xs = chunk_inputs(model, ids, states)
            loss, dr = head_backward(model, xs[-1], targets[:, s:e], 1.0 / n_tokens, loss_chunk)
            for k in reversed(range(len(layers))):
                dr, carries[k] = cell_backward(layers[k], xs[k], states[k], dr, carries[k],
                                               windows[k])
            embed_backward(model, ids, dr)
        total += loss
        saved[c] = None  # free this chunk's boundary states
    return total / n_tokens
