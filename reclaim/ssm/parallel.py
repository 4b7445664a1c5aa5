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
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from reclaim.models.mamba import LayerState
from reclaim.ssm.adjoint import (aligned_labels, cell_backward, cell_forward, chunk_bounds,
                                 chunk_inputs, embed_backward, forward_states, head_backward)


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
                            loss_chunk: int = 1024) -> float:
    """Exact adjoint with the backward shards of each wave run on `workers` threads.

    Accumulates .grad like loss.backward() of the mean next-token CE; returns the loss. Cells in
    a wave belong to distinct layers, so parameter accumulation never races; head and embedding
    work (the tied weight) stays on the calling thread.
    """
    layers = model.backbone.layers
    lab = aligned_labels(input_ids, labels)
    n_tokens = int((lab != -100).sum())
    bounds = chunk_bounds(input_ids.shape[1], chunk)
    saved, _ = forward_states(model, input_ids, bounds)
    n_layers = len(layers)
    inputs: dict[int, list[torch.Tensor]] = {}  # chunk -> input of every layer (chunks in flight)
    cot: dict[int, torch.Tensor] = {}  # chunk -> cotangent of the next layer's input
    carry: list[LayerState | None] = [None] * n_layers
    total = 0.0

    def run(cell: Cell) -> None:
        k, c = cell.layer, cell.chunk
        cot[c], carry[k] = cell_backward(layers[k], inputs[c][k], saved[c][k], cot[c], carry[k])

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


def _setup(group, input_ids: torch.Tensor, labels: torch.Tensor | None, chunk: int):
    """This rank, world size, neighbours' global ranks, aligned labels, token count, chunks."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    prev, nxt = (None if not 0 <= r < world else
                 dist.get_global_rank(group, r) if group is not None else r
                 for r in (rank - 1, rank + 1))
    lab = aligned_labels(input_ids, labels)
    n_tokens = int((lab != -100).sum())
    return rank, world, prev, nxt, lab, n_tokens, chunk_bounds(input_ids.shape[1], chunk)


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
                                loss_chunk: int = 1024, group=None) -> float:
    """Pipeline over layers: rank r runs layer block r; chunks flow through as micro-batches.

    Forward sends each chunk's residual stream to the next rank; backward sends its cotangent
    back, so the ranks work on different chunks at once (a wavefront over (rank, chunk)).
    Accumulates .grad for the parameters this rank owns (`stage_parameters`); every rank gets
    the loss. Each rank keeps its stage input per chunk (T x d) and its layers' boundary states.
    """
    rank, world, prev, nxt, lab, n_tokens, bounds = _setup(group, input_ids, labels, chunk)
    emb, layers = model.backbone.embeddings, model.backbone.layers
    block = layer_blocks(len(layers), world)[rank]
    first, last = rank == 0, rank == world - 1
    bsz = input_ids.shape[0]
    width = emb.weight.shape[1]
    # A tied embedding/head weight gets gradient on the first and the last rank: sum the two.
    tied = [emb.weight] if model.lm_head.weight is emb.weight else []
    stash = _stash_grads(tied)
    pending: list = []
    states = [layers[k].mixer.zero_state(bsz, emb.weight) for k in block]
    stage_in, saved = [], []
    with torch.no_grad():
        for s, e in bounds:
            x = emb(input_ids[:, s:e]) if first else _recv((bsz, e - s, width), emb.weight,
                                                             prev, group)
            stage_in.append(x)
            saved.append(list(states))
            for i, k in enumerate(block):
                x, states[i] = cell_forward(layers[k], x, states[i])
            if not last:
                _send(x, nxt, group, pending)
    carry: list[LayerState | None] = [None] * len(block)
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
            dx = _recv((bsz, e - s, width), emb.weight, nxt, group)
        for i in reversed(range(len(block))):
            dx, carry[i] = cell_backward(layers[block[i]], xs[i], saved[c][i], dx, carry[i])
        if first:
            embed_backward(model, input_ids[:, s:e], dx)
        else:
            _send(dx, prev, group, pending)
        stage_in[c] = saved[c] = None  # free as the backward passes
    for work, _ in pending:
        work.wait()
    _all_reduce_grads(tied, stash, group)
    loss = torch.tensor([total], dtype=torch.float64)
    dist.broadcast(loss, src=dist.get_global_rank(group, world - 1) if group is not None
                   else world - 1, group=group)
    return loss.item() / n_tokens


def time_sharded_loss_backward(model: nn.Module, input_ids: torch.Tensor,
                               labels: torch.Tensor | None = None, *, chunk: int,
                               loss_chunk: int = 1024, group=None) -> float:
    """Context parallel: rank r owns a time segment (a run of chunks) of every layer.

    Forward goes layer by layer: a rank scans its segment once the previous rank has sent that
    layer's end state (h and conv tail), so layers pipeline across ranks. Backward mirrors it
    with the state adjoint and conv-tail cotangent flowing to the previous rank; parameter
    gradients and the loss are then all-reduced. Every rank passes the full input_ids (it reads
    only its segment); each keeps its segment's layer inputs (K x T/W x d).
    """
    rank, world, prev, nxt, lab, n_tokens, bounds = _setup(group, input_ids, labels, chunk)
    emb, layers = model.backbone.embeddings, model.backbone.layers
    bsz = input_ids.shape[0]
    mine = [bounds[c] for c in time_segments(len(bounds), world)[rank]]
    like = layers[0].mixer.zero_state(bsz, emb.weight)
    params = _unique_parameters(model)
    stash = _stash_grads(params)
    pending: list = []
    with torch.no_grad():
        xs = [emb(input_ids[:, s:e]) for s, e in mine]
        inputs, saved = [], []
        for layer in layers:
            state = like if rank == 0 else LayerState(
                *(_recv(t.shape, t, prev, group) for t in like))
            inputs.append(xs)
            saved.append([])
            ys = []
            for x in xs:
                saved[-1].append(state)
                y, state = cell_forward(layer, x, state)
                ys.append(y)
            if rank < world - 1:
                for t in state:
                    _send(t, nxt, group, pending)
            xs = ys
    total, cot = 0.0, []
    for (s, e), x in zip(mine, xs):
        loss, dx = head_backward(model, x, lab[:, s:e], 1 / n_tokens, loss_chunk)
        total += loss
        cot.append(dx)
    for k in reversed(range(len(layers))):
        carry = None if rank == world - 1 else LayerState(
            *(_recv(t.shape, t, nxt, group) for t in like))
        for j in reversed(range(len(mine))):
            cot[j], carry = cell_backward(layers[k], inputs[k][j], saved[k][j], cot[j], carry)
        if rank > 0:
            for t in carry:
                _send(t, prev, group, pending)
        inputs[k] = saved[k] = None
    for (s, e), dx in zip(mine, cot):
        embed_backward(model, input_ids[:, s:e], dx)
    for work, _ in pending:
        work.wait()
    _all_reduce_grads(params, stash, group)
    loss = torch.tensor([total], dtype=torch.float64)
    dist.all_reduce(loss, group=group)
    return loss.item() / n_tokens
