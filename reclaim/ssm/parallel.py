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
import torch.nn.functional as F
from torch import nn

State = tuple[torch.Tensor, torch.Tensor]  # (h [B, D, N], conv tail [B, D, d_conv - 1])


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


def chunk_bounds(length: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of each time chunk; the last may be short."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return [(s, min(length, s + chunk)) for s in range(0, length, chunk)]


# ---- the model's parts, through its small public interface ----------------------------------

def _parts(model: nn.Module):
    bb = model.backbone
    return bb.embeddings, bb.layers, bb.norm_f, model.lm_head


def aligned_labels(input_ids: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    """Labels per position (position t predicts labels[t + 1]); the last position is ignored."""
    labels = input_ids if labels is None else labels
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], 1)


def zero_state(model: nn.Module, batch: int, like: torch.Tensor) -> State:
    """Empty recurrent state of one layer (what every layer starts the sequence from)."""
    cfg = model.config
    d_inner = cfg.intermediate_size
    return (like.new_zeros(batch, d_inner, cfg.state_size),
            like.new_zeros(batch, d_inner, cfg.conv_kernel - 1))


def cell_forward(layer: nn.Module, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
    """One shard's forward without autograd: (layer output, state at the chunk's end)."""
    with torch.no_grad():
        y, h, conv = layer.forward_chunk(x, *state)
    return y, (h, conv)


def cell_backward(layer: nn.Module, x: torch.Tensor, state: State, dy: torch.Tensor,
                  dstate: State | None) -> tuple[torch.Tensor, State]:
    """One shard's backward: recompute with autograd, pull (dy, end-state adjoint) through it.

    Accumulates the layer's parameter gradients; returns (dL/dx, adjoint of the start state).
    """
    x = x.detach().requires_grad_()
    h0, conv0 = (s.detach().requires_grad_() for s in state)
    with torch.enable_grad():
        y, h1, conv1 = layer.forward_chunk(x, h0, conv0)
        outs, grads = [y], [dy]
        if dstate is not None:
            outs += [h1, conv1]
            grads += list(dstate)
        torch.autograd.backward(outs, grads)
    return x.grad, (h0.grad, conv0.grad)


def head_backward(model: nn.Module, r: torch.Tensor, labels: torch.Tensor, scale: float,
                  loss_chunk: int) -> tuple[float, torch.Tensor]:
    """Summed CE of the final residual r against labels, in sub-chunks; returns (sum, dL/dr).

    Gradients are of `scale * sum`, accumulated into norm_f and lm_head.
    """
    _, _, norm_f, lm_head = _parts(model)
    r = r.detach().requires_grad_()
    total = 0.0
    for s, e in chunk_bounds(r.shape[1], loss_chunk):
        with torch.enable_grad():
            logits = lm_head(norm_f(r[:, s:e]))
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            loss = F.cross_entropy(logits.flatten(0, 1), labels[:, s:e].flatten(),
                                   ignore_index=-100, reduction="sum")
            (loss * scale).backward()
        total += loss.item()
    return total, r.grad if r.grad is not None else torch.zeros_like(r)


def embed_backward(model: nn.Module, ids: torch.Tensor, dr: torch.Tensor) -> None:
    """Accumulate the embedding gradient for one chunk of token ids."""
    emb = _parts(model)[0]
    with torch.enable_grad():
        torch.autograd.backward(emb(ids), dr)


def _forward_states(model, input_ids, bounds) -> list[list[State]]:
    """Pass 1 without autograd: each layer's state at the start of every chunk."""
    emb, layers, _, _ = _parts(model)
    states = [zero_state(model, input_ids.shape[0], emb.weight) for _ in layers]
    saved = []
    for s, e in bounds:
        saved.append(list(states))
        x = emb(input_ids[:, s:e])
        for k, layer in enumerate(layers):
            x, states[k] = cell_forward(layer, x, states[k])
    return saved


def wavefront_loss_backward(model: nn.Module, input_ids: torch.Tensor,
                            labels: torch.Tensor | None = None, *, chunk: int, workers: int = 2,
                            loss_chunk: int = 1024) -> float:
    """Exact adjoint with the backward shards of each wave run on `workers` threads.

    Accumulates .grad like loss.backward() of the mean next-token CE; returns the loss. Cells in
    a wave belong to distinct layers, so parameter accumulation never races; head and embedding
    work (the tied weight) stays on the calling thread.
    """
    emb, layers, _, _ = _parts(model)
    with torch.no_grad():
        lab = aligned_labels(input_ids, labels)
        n_tokens = int((lab != -100).sum())
        bounds = chunk_bounds(input_ids.shape[1], chunk)
        saved = _forward_states(model, input_ids, bounds)
    n_layers = len(layers)
    inputs: dict[int, list[torch.Tensor]] = {}  # chunk -> input of every layer (chunks in flight)
    cot: dict[int, torch.Tensor] = {}  # chunk -> cotangent of the next layer's input
    carry: list[State | None] = [None] * n_layers
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
                    with torch.no_grad():
                        xs = [emb(input_ids[:, s:e])]
                        for k, layer in enumerate(layers):
                            xs.append(cell_forward(layer, xs[-1], saved[c][k])[0])
                    inputs[c] = xs
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


def stage_parameters(model: nn.Module, rank: int, world: int) -> list[nn.Parameter]:
    """The parameters rank `rank` owns in the layer-sharded pipeline (build its optimizer on them)."""
    emb, layers, norm_f, lm_head = _parts(model)
    block = layer_blocks(len(layers), world)[rank]
    mods = [layers[k] for k in block]
    if rank == 0:
        mods.append(emb)
    if rank == world - 1:
        mods += [norm_f, lm_head]
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
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    emb, layers, _, _ = _parts(model)
    block = layer_blocks(len(layers), world)[rank]
    first, last = rank == 0, rank == world - 1
    prev, nxt = (dist.get_global_rank(group, r) if group is not None else r
                 for r in (rank - 1, rank + 1))
    bsz = input_ids.shape[0]
    with torch.no_grad():
        lab = aligned_labels(input_ids, labels)
        n_tokens = int((lab != -100).sum())
    bounds = chunk_bounds(input_ids.shape[1], chunk)
    width = emb.weight.shape[1]
    # A tied embedding/head weight gets gradient on the first and the last rank: sum the two.
    tied = [emb.weight] if _parts(model)[3].weight is emb.weight else []
    stash = _stash_grads(tied)
    pending: list = []
    states = [zero_state(model, bsz, emb.weight) for _ in block]
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
    carry: list[State | None] = [None] * len(block)
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
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    emb, layers, _, _ = _parts(model)
    prev, nxt = (dist.get_global_rank(group, r) if group is not None else r
                 for r in (rank - 1, rank + 1))
    bsz = input_ids.shape[0]
    with torch.no_grad():
        lab = aligned_labels(input_ids, labels)
        n_tokens = int((lab != -100).sum())
    bounds = chunk_bounds(input_ids.shape[1], chunk)
    mine = [bounds[c] for c in time_segments(len(bounds), world)[rank]]
    like = zero_state(model, bsz, emb.weight)
    params = _unique_parameters(model)
    stash = _stash_grads(params)
    pending: list = []
    with torch.no_grad():
        xs = [emb(input_ids[:, s:e]) for s, e in mine]
        inputs, saved = [], []
        for layer in layers:
            state = like if rank == 0 else tuple(
                _recv(t.shape, t, prev, group) for t in like)
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
        carry = None if rank == world - 1 else tuple(
            _recv(t.shape, t, nxt, group) for t in like)
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
