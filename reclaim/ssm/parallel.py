"""Adjoint shards run in parallel: a wavefront in one process, and over torch.distributed by layer
(pipeline) or by time (context parallel). Every variant gives exactly the chunked adjoint's
gradient, which is exactly backprop's.

A shard is one layer k over one time chunk c. Its backward needs the cotangent of its output from
(k+1, c) and the state adjoint (mu, conv-tail cotangent) from (k, c+1); shards with the same
(K-1-k) + (C-1-c) are independent: the backward wavefront. Schedules are plain data (`waves`,
`layer_blocks`, `time_segments`) so they can be checked alone.

Distributed variants keep O(T d) activations per rank (stage inputs or segment residual streams),
never the O(T d N) scan states. Point-to-point sends are asynchronous and every rank follows one
global order of shards, so no schedule can deadlock.

Both distributed variants take `window` (truncated adjoint, T-bar) and then equal the single-process
`adjoint_loss_backward(..., window=W)`. By layer, a rank owns whole layers over all chunks, so one
`window.Window` per owned layer runs locally. By time, a layer's Window on rank r needs the exact
state adjoint of the W tokens after its segment and the running dt-sum there, which rank r+1
holds: rank r+1 sends them (`Window.handoff`) with the carry.

For training by layer (`reclaim ssm-train --sharding layer` under torchrun) a rank keeps only its
block (`free_other_stages`), optimizes `stage_parameters`, clips by the global norm
(`clip_grad_norm_global`, a tied weight counted once) and lends its block to rank 0 for a checkpoint
(`gathered_weights`). By time and data parallel every rank holds the whole model.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from reclaim.models.mamba import LayerState
from reclaim.models.nemotron_h import KVState
from reclaim.ssm.adjoint import (aligned_labels, cell_backward, cell_forward, check_family,
                                 chunk_bounds, chunk_inputs, embed_backward, forward_states,
                                 head_backward, keep_state, layer_kernel, layer_windows,
                                 prefix_view)
from reclaim.ssm.window import Window


@dataclass(frozen=True)
class Cell:
    """One shard: layer `layer` over time chunk `chunk`."""

    layer: int
    chunk: int


def waves(n_layers: int, n_chunks: int) -> list[list[Cell]]:
    """Backward wavefront: wave w holds the cells with (K-1-k) + (C-1-c) = w, top layer first."""
    out = []
    for w in range(n_layers + n_chunks - 1):
        out.append([Cell(k, c) for k in reversed(range(n_layers))
                    if 0 <= (c := n_chunks - 1 - (w - (n_layers - 1 - k))) < n_chunks])
    return out


def _split(n: int, parts: int, what: str) -> list[range]:
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} {what} over {parts} ranks; need 1 <= ranks <= {n}")
    bounds = [n * i // parts for i in range(parts + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]


def layer_blocks(n_layers: int, world: int) -> list[range]:
    """Contiguous layer blocks, one per rank (sizes differ by at most one)."""
    return _split(n_layers, world, "layers")


def time_segments(n_chunks: int, world: int) -> list[range]:
    """Contiguous runs of chunks, one time segment per rank."""
    return _split(n_chunks, world, "chunks")


def wavefront_loss_backward(model: nn.Module, input_ids: torch.Tensor,
                            labels: torch.Tensor | None = None, *, chunk: int, workers: int = 2,
                            window: int | None = None, loss_chunk: int = 1024) -> float:
    """The chunked adjoint (exact, or truncated to `window`) with the backward shards of each
    wave run on `workers` threads.

    Accumulates .grad like loss.backward() of the mean next-token CE; returns the loss. Cells in
    a wave belong to distinct layers, so parameter accumulation never races; head and embedding
    work (the tied weight) stays on the calling thread.
    """
    layers = model.backbone.layers
    lab = aligned_labels(input_ids, labels)
    n_tokens = int((lab != -100).sum())
    bounds = chunk_bounds(input_ids.shape[1], chunk)
    saved = forward_states(model, input_ids, bounds)
    n_layers = len(layers)
    inputs: dict[int, list[torch.Tensor]] = {}  # chunk -> input of every layer (chunks in flight)
    cot: dict[int, torch.Tensor] = {}  # chunk -> cotangent of the next layer's input
    carry: list[LayerState | None] = [None] * n_layers
    # A layer's cells run last chunk first, as its Window needs.
    windows = layer_windows(window, input_ids.shape[1], n_layers)
    total = 0.0

    def run(cell: Cell) -> None:
        k, c = cell.layer, cell.chunk
        cot[c], carry[k] = cell_backward(layers[k], inputs[c][k], saved[c][k], cot[c], carry[k],
                                         windows[k])

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for wave in waves(n_layers, len(bounds)):
            for cell in wave:
                if cell.layer == n_layers - 1:  # chunk enters: recompute its layer inputs, head
                    c = cell.chunk
                    s, e = bounds[c]
                    inputs[c] = xs = chunk_inputs(model, input_ids[:, s:e], saved[c])
                    loss, cot[c] = head_backward(model, xs.pop(), lab[:, s:e], 1 / n_tokens,
                                                 loss_chunk)
                    total += loss
            list(pool.map(run, wave))
            for cell in wave:
                if cell.layer == 0:  # chunk leaves
                    s, e = bounds[cell.chunk]
                    embed_backward(model, input_ids[:, s:e], cot.pop(cell.chunk))
                    del inputs[cell.chunk]
    return total / n_tokens


# ---- torch.distributed ------------------------------------------------------------------------

def _recv(shape, like: torch.Tensor, src: int, group) -> torch.Tensor:
    buf = like.new_empty(shape)
    dist.recv(buf, src=src, group=group)
    return buf


def _send(t: torch.Tensor, dst: int, group, pending: list) -> None:
    t = t.contiguous()
    pending.append((dist.isend(t, dst=dst, group=group), t))  # keep t alive until sent


def _unique_parameters(model: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in model.parameters()}.values())


def _stash_grads(params: list[nn.Parameter]) -> list[torch.Tensor | None]:
    """Take the gradients accumulated so far, so a reduction sums only this call's part."""
    stash = [p.grad for p in params]
    for p in params:
        p.grad = None
    return stash


def _all_reduce_grads(params: list[nn.Parameter], stash: list[torch.Tensor | None],
                      group) -> None:
    """Sum this call's gradients over ranks (one flat buffer), then add back the stashed ones."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p, old in zip(params, stash):
        g = flat[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
        p.grad = g if old is None else old + g


def _setup(group, input_ids: torch.Tensor, labels: torch.Tensor | None, chunk: int,
           window: int | None):
    """This rank, world size, neighbours' global ranks, aligned labels, token count, chunks."""
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    prev, nxt = (None if not 0 <= r < world else
                 dist.get_global_rank(group, r) if group is not None else r
                 for r in (rank - 1, rank + 1))
    lab = aligned_labels(input_ids, labels)
    n_tokens = int((lab != -100).sum())
    return rank, world, prev, nxt, lab, n_tokens, chunk_bounds(input_ids.shape[1], chunk)


def _global(group, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


def _recv_window(size: int, n: int, h: torch.Tensor, src: int, group) -> Window:
    """Receive a `Window.handoff()` of n tokens (dt sums in float64). The state h is [B, D, N]
    (Mamba-1: a decay per channel and state) or [B, heads, head_dim, N] (Mamba-2: per head), and
    the Window's mu per token [D, N] or [heads, head_dim * N]."""
    bsz, d = h.shape[:2]
    mu = _recv((bsz, n, d, h[0, 0].numel()), h, src, group)
    r64 = h.new_empty(0, dtype=torch.float64)
    r = _recv((bsz, n, d), r64, src, group)
    return Window.resume(size, mu, r, _recv((bsz, d), r64, src, group))


def stage_parameters(model: nn.Module, rank: int, world: int) -> list[nn.Parameter]:
    """The parameters rank `rank` owns in the layer-sharded pipeline (build its optimizer on them)."""
    bb = model.backbone
    block = layer_blocks(len(bb.layers), world)[rank]
    mods = [bb.layers[k] for k in block]
    if rank == 0:
        mods.append(bb.embeddings)
    if rank == world - 1:
        mods += [bb.norm_f, model.lm_head]
    return list({id(p): p for m in mods for p in m.parameters()}.values())


def layer_sharded_loss_backward(model: nn.Module, input_ids: torch.Tensor,
                                labels: torch.Tensor | None = None, *, chunk: int,
                                window: int | None = None, loss_chunk: int = 1024,
                                group=None) -> float:
    """Pipeline over layers: rank r runs layer block r; chunks flow through as micro-batches.

    Forward sends each chunk's residual stream to the next rank; backward sends its cotangent
    back, so the ranks work on different chunks at once (a wavefront over (rank, chunk)).
    Accumulates .grad for the parameters this rank owns (`stage_parameters`); every rank gets
    the loss. Each rank keeps its stage input per chunk (T x d) and its layers' boundary states.
    Only this rank's stage is read, so the other layers may be freed (`free_other_stages`).
    """
    rank, world, prev, nxt, lab, n_tokens, bounds = _setup(group, input_ids, labels, chunk, window)
    emb, layers = model.backbone.embeddings, model.backbone.layers
    block = layer_blocks(len(layers), world)[rank]
    first, last = rank == 0, rank == world - 1
    bsz = input_ids.shape[0]
    like = layers[block[0]].norm.weight  # an owned tensor: dtype, device and width of the stream
    width = like.shape[0]
    # A tied embedding/head weight gets gradient on the first and the last rank: sum the two.
    tied = model.lm_head.weight is emb.weight and world > 1 and (first or last)
    stash = _stash_grads([emb.weight] if tied else [])
    pending: list = []
    states = [layers[k].mixer.zero_state(bsz, like) for k in block]
    stage_in, saved = [], []
    with torch.no_grad():
        for s, e in bounds:
            x = emb(input_ids[:, s:e]) if first else _recv((bsz, e - s, width), like, prev, group)
            stage_in.append(x)
            saved.append(list(states))
            for i, k in enumerate(block):
                x, states[i] = cell_forward(layers[k], x, states[i])
            if not last:
                _send(x, nxt, group, pending)
    carry: list[LayerState | None] = [None] * len(block)
    windows = layer_windows(window, input_ids.shape[1], len(block))
    total = 0.0
    for c in reversed(range(len(bounds))):
        s, e = bounds[c]
        xs = [stage_in[c]]
        for i, k in enumerate(block):
            xs.append(cell_forward(layers[k], xs[-1], saved[c][i])[0])
        if last:
            loss, dx = head_backward(model, xs[-1], lab[:, s:e], 1 / n_tokens, loss_chunk)
            total += loss
        else:
            dx = _recv((bsz, e - s, width), like, nxt, group)
        for i in reversed(range(len(block))):
            dx, carry[i] = cell_backward(layers[block[i]], xs[i], saved[c][i], dx, carry[i],
                                         windows[i])
        if first:
            embed_backward(model, input_ids[:, s:e], dx)
        else:
            _send(dx, prev, group, pending)
        stage_in[c] = saved[c] = None  # free as the backward passes
    for work, _ in pending:
        work.wait()
    if tied:
        _sum_tied(emb.weight, stash[0], _global(group, world - 1 if first else 0), first, group)
    loss = torch.tensor([total], dtype=torch.float64, device=input_ids.device)  # nccl: on the GPU
    dist.broadcast(loss, src=_global(group, world - 1), group=group)
    return loss.item() / n_tokens


def _sum_tied(weight: nn.Parameter, old: torch.Tensor | None, peer: int, first: bool,
              group) -> None:
    """First and last rank swap their parts of a tied weight's gradient; both add them in the
    same order, so the two copies stay bit-identical."""
    mine = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    theirs = torch.empty_like(mine)
    work = dist.isend(mine, dst=peer, group=group)
    dist.recv(theirs, src=peer, group=group)
    work.wait()
    g = mine + theirs if first else theirs + mine
    weight.grad = g if old is None else old + g


def time_sharded_loss_backward(model: nn.Module, input_ids: torch.Tensor,
                               labels: torch.Tensor | None = None, *, chunk: int,
                               window: int | None = None, loss_chunk: int = 1024,
                               group=None) -> float:
    """Context parallel: rank r owns a time segment (a run of chunks) of every layer.

    Forward goes layer by layer: a rank runs its segment once the previous rank has sent that
    layer's state at the segment start (Mamba: h and conv tail; attention: the keys and values of
    every earlier token; an MLP: nothing), so layers pipeline across ranks. Backward mirrors it
    with the state's adjoint flowing to the previous rank (Mamba: mu and the conv-tail cotangent;
    attention: dK/dV of every earlier token, each rank adding its queries' part before passing it
    on, so it reaches the rank that made those keys); parameter gradients and the loss are then
    all-reduced. Every rank passes the full input_ids (it reads only its segment); each keeps its
    segment's layer inputs (K x T/W x d) and, per attention layer, the keys and values up to its
    segment end. With `window`, each Mamba layer's truncation state comes from the next rank along
    with the carry (`Window.handoff`).
    """
    rank, world, prev, nxt, lab, n_tokens, bounds = _setup(group, input_ids, labels, chunk, window)
    check_family(model, chunk, window)
    emb, layers = model.backbone.embeddings, model.backbone.layers
    bsz = input_ids.shape[0]
    mine = [bounds[c] for c in time_segments(len(bounds), world)[rank]]
    start, end = mine[0][0], mine[-1][1]
    zero = model.zero_states(bsz)  # per layer: the state's type, dtype and shape (but length)
    params = _unique_parameters(model)
    stash = _stash_grads(params)
    pending: list = []
    with torch.no_grad():
        xs = [emb(input_ids[:, s:e]) for s, e in mine]
        inputs, saved = [], []
        for layer, like in zip(layers, zero):
            state = like if rank == 0 else _recv_state(like, start, prev, group)
            inputs.append(xs)
            kept, ys = [], []
            for x in xs:
                kept.append(keep_state(state))
                y, state = cell_forward(layer, x, state)
                ys.append(y)
            saved.append([prefix_view(st, state) for st in kept])
            if rank < world - 1:
                for t in state:
                    _send(t, nxt, group, pending)
            xs = ys
    total, cot = 0.0, []
    for (s, e), x in zip(mine, xs):
        loss, dx = head_backward(model, x, lab[:, s:e], 1 / n_tokens, loss_chunk)
        total += loss
        cot.append(dx)
    length = input_ids.shape[1]
    after = min(window or 0, length - end)  # tokens a Window here needs from rank + 1
    windows = [win if layer_kernel(layer) is not None else None  # attention, MLP: exact
               for layer, win in zip(layers, layer_windows(window, length, len(layers)))]
    for k, win in reversed(list(enumerate(windows))):
        carry = None
        if rank < world - 1:
            carry = _recv_state(zero[k], end, nxt, group)
            if win is not None:
                win = _recv_window(win.size, after, zero[k][0], nxt, group)
        for j in reversed(range(len(mine))):
            cot[j], carry = cell_backward(layers[k], inputs[k][j], saved[k][j], cot[j], carry, win)
        if rank > 0:
            for t in (*carry, *(win.handoff() if win is not None else ())):
                _send(t, prev, group, pending)
        inputs[k] = saved[k] = None
    for (s, e), dx in zip(mine, cot):
        embed_backward(model, input_ids[:, s:e], dx)
    for work, _ in pending:
        work.wait()
    _all_reduce_grads(params, stash, group)
    loss = torch.tensor([total], dtype=torch.float64, device=input_ids.device)  # nccl: on the GPU
    dist.all_reduce(loss, group=group)
    return loss.item() / n_tokens


def _recv_state(like: tuple, position: int, src: int, group) -> tuple:
    """A layer state (or its adjoint) at `position` tokens, shaped as `like` (a zero state), whose
    keys and values, if it has them, then span the `position` earlier tokens."""
    grow = isinstance(like, KVState)
    return like._make(_recv((*t.shape[:2], position, *t.shape[3:]) if grow else t.shape, t, src,
                            group) for t in like)


# ---- training helpers: what a rank holds, how gradients and weights meet ------------------------

def free_other_stages(model: nn.Module, rank: int, world: int) -> None:
    """Drop the tensors of every parameter outside this rank's stage (they become empty), so a
    rank holds only its block; parameter objects and names stay, for `gathered_weights`."""
    keep = {id(p) for p in stage_parameters(model, rank, world)}
    for p in _unique_parameters(model):
        if id(p) not in keep:
            p.data = p.data.new_empty(0)


def counted_elsewhere(model: nn.Module, rank: int, world: int) -> list[nn.Parameter]:
    """Stage parameters whose gradient norm another rank counts: a tied embedding/head weight,
    held by the first and the last rank, is counted on the first."""
    tied = model.lm_head.weight is model.backbone.embeddings.weight
    return [model.lm_head.weight] if tied and world > 1 and rank == world - 1 else []


def clip_grad_norm_global(params: list[nn.Parameter], max_norm: float, group=None, *,
                          uncounted: list[nn.Parameter] = ()) -> float:
    """clip_grad_norm_ over parameters split across ranks; returns the global norm.

    params: this rank's parameters, all scaled; uncounted: those among them another rank counts.
    All-reduces the squared norms, so every rank scales by the same factor.
    """
    skip = {id(p) for p in uncounted}
    grads = [p.grad for p in params if p.grad is not None]
    like = grads[0] if grads else params[0]
    sq = torch.zeros((), dtype=like.dtype, device=like.device)
    for p in params:
        if p.grad is not None and id(p) not in skip:
            sq = sq + torch.linalg.vector_norm(p.grad).square()
    dist.all_reduce(sq, group=group)
    norm = sq.sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch's clip_grad_norm_ factor
    for g in grads:
        g.mul_(scale)
    return norm.item()


def average_gradients(params: list[nn.Parameter], loss: float, group=None) -> float:
    """Data parallel: replace .grad of params by its mean over ranks; returns the mean loss."""
    world = dist.get_world_size(group)
    _all_reduce_grads(params, [None] * len(params), group)
    for p in params:
        p.grad = p.grad / world
    total = torch.tensor([loss], dtype=torch.float64, device=params[0].device)
    dist.all_reduce(total, group=group)
    return total.item() / world


@contextmanager
def gathered_weights(model: nn.Module, rank: int, world: int, group=None) -> Iterator[bool]:
    """Lend every stage's weights to rank 0 for the duration (e.g. writing a checkpoint).

    All ranks enter; rank 0's freed parameters hold the others' tensors (on the CPU) inside the
    block and are freed again after. Yields whether this rank holds the full model.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    mine = {names[id(p)]: p.detach().cpu() for p in stage_parameters(model, rank, world)}
    parts: list | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, parts, dst=_global(group, 0), group=group)
    if rank != 0:
        yield False
        return
    full = {k: v for part in parts for k, v in part.items()}
    lent = {n: (p, p.data) for n, p in model.named_parameters() if p.numel() == 0 and n in full}
    for n, (p, _) in lent.items():
        p.data = full[n].to(p.dtype)
    try:
        yield True
    finally:
        for p, empty in lent.values():
            p.data = empty
