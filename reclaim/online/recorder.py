"""Prompt records, and the two ways to get a sample's training loss: reuse a record or recompute.

A record is the prompt's forward run with autograd and its graph kept: the prompt's K/V per layer
and the final hidden state at the last prompt position are graph nodes, and everything the
backward needs is held by the graph (captured through `saved_tensors_hooks`, so it can be measured
and moved to host memory layer by layer). A training forward over the response alone attends to
the recorded K/V; its backward flows on into the prompt's graph, so the gradient equals one
forward over prompt + response (`recompute_loss`, logits on response positions only).

A selective record keeps only the outputs of the matrix products (but the K and V projections')
and attention, under half the bytes (49.8% for SmolLM2), and recomputes the elementwise work in
between and the K/V projections during the backward; still exact.

A record is exact only for the weights that made it: an optimizer step changes the parameters in
place, and the recorder then refuses the record (autograd's own check is off under saved-tensor
hooks, so it keeps one). The planner (trainer.py) never sends one there.

    rec = record_prompt(model, prompt_ids, response_id="r1", version=0)
    loss, n = reuse_loss(model, [rec], [response_ids])      # == recompute_loss(model, [prompt_ids], ...)
    (loss / n).backward()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from reclaim.models.cache import DenseCache
from reclaim.online.transfer import ReloadLog, copier_for

IGNORE = -100  # label of padded positions
HEAD_ROWS = 64  # positions the head and its loss run over at a time (a unit of a sliced step)


class SavedTensor:
    """One tensor autograd saved during a recorded prompt forward, movable to host and back.

    `uses` counts the graph nodes that saved it, so a reloaded copy is dropped after its last use.
    `log` (transfer.ReloadLog) logs the layers brought back and prefetches the next one; it holds
    no link to the record (the graph would hold it in a cycle the garbage collector cannot see
    through). Copies run off the compute stream on CUDA (transfer.Copier).
    """

    def __init__(self, tensor: torch.Tensor, layer: int, log: ReloadLog) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.host: torch.Tensor | None = None
        self.pending: tuple[torch.Tensor, Any] | None = None  # a copy back in flight, its event
        self.device = tensor.device
        self.layer = layer
        self.shared = False  # saved by several layers (RoPE's cos/sin): not one layer's to log
        self.uses = 0
        self.log = log

    def offload(self, host: torch.device) -> None:
        if self.tensor is not None and self.host is None:
            self.host, _ = copier_for(self.device).to_host(self.tensor, host)
            self.tensor = None
            if not self.shared:
                self.log.add(self)

    def prefetch(self) -> None:
        """Start bringing the host copy back (on CUDA, on the side stream)."""
        if self.tensor is None and self.host is not None and self.pending is None:
            self.pending = copier_for(self.device).to_device(self.host, self.device)

    def get(self) -> torch.Tensor:
        self.uses -= 1
        if self.tensor is not None:
            t = self.tensor
        else:
            if not self.shared:
                self.log.reached(self.layer)  # may prefetch the layer below
            self.prefetch()  # no-op when a prefetch is in flight
            t, event = self.pending
            self.pending = None
            t = copier_for(self.device).ready(t, event)
            if self.uses > 0:
                self.tensor = t  # still needed by another node of this layer's backward
        if self.uses == 0:
            self.tensor = self.host = None
        return t


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def unique_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen.setdefault(_storage_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


@dataclass
class PromptRecord:
    """A prompt's forward kept for training: K/V and last hidden state (graph nodes when exact),
    the tensors autograd saved (`saved`, in forward order), and the weights version that made it."""

    response_id: str
    prompt_ids: list[int]
    version: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    last_hidden: torch.Tensor  # [1, 1, H] final-norm hidden state at the last prompt position
    last_logits: torch.Tensor  # [V] detached: what the server samples the first token from
    exact: bool  # recorded with autograd (prefix_grad); False: K/V detached, no graph kept
    device: torch.device
    saved: list[SavedTensor] = field(default_factory=list)
    saved_bytes: int = 0  # activations autograd saved (parameters excluded), distinct storages
    kv_bytes: int = 0  # the K/V and the last hidden state
    where: str = "device"  # or "host" after offload()
    selective: bool = False  # kept only matmul/attention outputs (see record_prompt)
    weight_versions: tuple[int, ...] = ()  # the parameters' in-place versions when recorded
    log: ReloadLog = field(default_factory=ReloadLog)  # offloaded tensors coming back

    @property
    def reloads(self) -> list[int]:
        """Layers brought back, in order (shared tensors left out)."""
        return self.log.used

    @property
    def length(self) -> int:
        return len(self.prompt_ids)

    @property
    def nbytes(self) -> int:
        """Bytes this record holds (saved activations + K/V, shared storages counted once)."""
        return self.saved_bytes + self.kv_bytes

    def offload(self, host: str | torch.device = "cpu") -> None:
        """Move everything to host memory, layer by layer in forward order; the backward brings
        each saved tensor back when its node runs (backward order), K/V when the forward reads them."""
        if self.selective:
            raise ValueError(f"record {self.response_id!r} is selective: its kept tensors live in "
                             "torch's checkpoint cache and cannot be offloaded yet")
        host = torch.device(host)
        for s in self.saved:
            s.offload(host)
        # differentiable copies: the gradient flows back through them into the prompt's graph
        self.keys = [k.to(host, copy=True) for k in self.keys]
        self.values = [v.to(host, copy=True) for v in self.values]
        self.last_hidden = self.last_hidden.to(host, copy=True)
        self.where = "host"

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's prompt K/V ([1, Hkv, P, D]) on the model's device."""
        return self.keys[layer].to(self.device), self.values[layer].to(self.device)

    def hidden(self) -> torch.Tensor:
        return self.last_hidden.to(self.device)

    def detached(self) -> "PromptRecord":
        """The same K/V with gradients stopped at the prompt (a stale or prefix_grad=False use)."""
        return PromptRecord(self.response_id, self.prompt_ids, self.version,
                            [k.detach() for k in self.keys], [v.detach() for v in self.values],
                            self.last_hidden.detach(), self.last_logits, False, self.device,
                            kv_bytes=self.kv_bytes, where=self.where)


def record_prompt(model: torch.nn.Module, prompt_ids: Sequence[int], *, response_id: str,
                  version: int, prefix_grad: bool = True, selective: bool = False) -> PromptRecord:
    """Run the prompt's forward and keep what a later training step needs.

    prefix_grad=True (exact): with autograd, graph kept, every saved tensor captured per layer.
    selective=True (exact, under half the bytes): keep only the outputs of the matrix products (K/V
    projections' aside) and attention; the backward recomputes the rest (Megatron's selective
    recomputation, through torch's selective activation checkpointing). Not offloadable yet.
    prefix_grad=False: under no_grad; only K/V and the last hidden state, so the gradient stops
    at the prompt (cheaper, not exact).
    """
    if len(prompt_ids) == 0:
        raise ValueError(f"response {response_id!r}: cannot record an empty prompt")
    params = list(model.parameters())
    device = params[0].device
    if prefix_grad and not any(p.requires_grad for p in params):
        raise ValueError("prefix_grad=True needs parameters that require grad; the model has none")
    ids = torch.tensor([list(prompt_ids)], device=device)
    window = model.config.sliding_window

    def forward(ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cache = DenseCache(window)
        out = model(ids, cache=cache, return_hidden=True, compute_logits=False)
        n = len(cache.keys)
        # clone: a slice would keep the whole [1, P, H] hidden state alive
        return (out.hidden[:, -1:].clone(), *(cache.keys[i] for i in range(n)),
                *(cache.values[i] for i in range(n)))

    rec = PromptRecord(response_id, list(prompt_ids), version, [], [], torch.empty(0),
                       torch.empty(0), prefix_grad, device, selective=prefix_grad and selective,
                       weight_versions=tuple(p._version for p in params))
    held: list[torch.Tensor] = []
    with torch.inference_mode(False):  # the engine may call this from its inference-mode loop
        ids = ids.clone()
        if not prefix_grad:
            with torch.no_grad():
                outs = forward(ids)
        elif selective:
            outs, held = _selective(model, forward, ids)
        else:
            with torch.enable_grad(), _capture(model, rec):
                outs = forward(ids)
            held = [s.tensor for s in rec.saved]
    n = (len(outs) - 1) // 2
    rec.last_hidden, rec.keys, rec.values = outs[0], list(outs[1:1 + n]), list(outs[1 + n:])
    with torch.no_grad(), torch.inference_mode(False):
        rec.last_logits = model.lm_head(rec.last_hidden).float()[0, 0]
    kv = rec.keys + rec.values + [rec.last_hidden]
    rec.kv_bytes = unique_bytes(kv)
    rec.saved_bytes = unique_bytes(held + kv) - rec.kv_bytes
    return rec


def _kept_ops() -> set:
    """Matrix products and fused attention: what a selective record keeps the outputs of."""
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    return {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default} | {
        getattr(aten, n).default for n in names if hasattr(aten, n)}


def _kv_weights(model: torch.nn.Module) -> set[int]:
    """Storages of the K and V projections' weights: their products are recomputed, not kept."""
    return {_storage_key(m.weight) for name, m in model.named_modules()
            if name.rsplit(".", 1)[-1] in ("k_proj", "v_proj") and hasattr(m, "weight")}


def _selective(model: torch.nn.Module, forward, ids: torch.Tensor
               ) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]:
    """`forward(ids)` under selective activation checkpointing; its outputs and the tensors kept.

    Kept: the outputs of the matrix products and attention, except the K and V projections'
    (recomputed in the backward: with grouped-query attention they are the smallest products, and
    the record holds the K/V after them anyway), which brings the record under half of what
    autograd saves."""
    from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                        create_selective_checkpoint_contexts)

    kept_ops = _kept_ops()
    kv = _kv_weights(model)

    def policy(ctx, op, *args, **kwargs):
        if op not in kept_ops or any(isinstance(a, torch.Tensor) and _storage_key(a) in kv for a in args):
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    made = []

    def context():
        made.append(create_selective_checkpoint_contexts(policy))
        return made[-1]

    with torch.enable_grad():
        outs = checkpoint(forward, ids, use_reentrant=False, context_fn=context)
    # torch keeps the saved outputs in the caching mode's storage ({op: {i: wrapper or tuple}});
    # read it to count the record's bytes (a private layout: a torch upgrade shows up in the tests)
    kept = []
    for per_op in made[0][0].storage.values():
        for v in per_op.values():
            for x in v if isinstance(v, (tuple, list)) else (v,):
                x = getattr(x, "val", x)
                if isinstance(x, torch.Tensor):
                    kept.append(x)
    return outs, kept


class _capture:
    """saved_tensors_hooks that wrap every saved activation in a SavedTensor tagged with its layer
    (parameters and buffers stay as they are: they are not the record's bytes)."""

    def __init__(self, model: torch.nn.Module, rec: PromptRecord) -> None:
        # not the record itself: every graph node keeps these hooks, and the record holds the
        # graph, a cycle through C++ that the garbage collector cannot see (it would never free)
        self.model, self.saved, self.log = model, rec.saved, rec.log
        self.own = {_storage_key(p) for p in model.parameters()} | {
            _storage_key(b) for b in model.buffers()}
        self.layer = -1  # -1: embedding; len(layers): final norm
        self.seen: dict[tuple, SavedTensor] = {}

    def _at(self, i: int):
        def hook(module, args):
            self.layer = i
        return hook

    def pack(self, t: torch.Tensor):
        if not t.is_floating_point():
            return t  # token ids: a few bytes, not worth moving
        ptr = _storage_key(t)
        if ptr in self.own:
            return (t, t._version)  # hooks turn off autograd's own in-place check: keep ours
        key = (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        s = self.seen.get(key)
        if s is None:
            # detached: a saved output holds its own grad_fn, and the node holding it would then
            # hold itself through C++ references the garbage collector cannot see (the record, its
            # graph and its bytes would never be freed)
            s = self.seen[key] = SavedTensor(t.detach(), self.layer, self.log)
            self.saved.append(s)
        s.shared |= s.layer != self.layer
        s.uses += 1
        return s

    @staticmethod
    def unpack(x):
        if isinstance(x, SavedTensor):
            return x.get()
        if isinstance(x, torch.Tensor):
            return x
        t, version = x
        if t._version != version:
            raise RuntimeError(
                "a prompt record's graph was used after its weights were modified in place (an "
                "optimizer step): a record is exact only for the weights version that made it")
        return t

    def __enter__(self):
        layers = self.model.model.layers
        self.handles = [m.register_forward_pre_hook(self._at(i)) for i, m in enumerate(layers)]
        self.handles.append(self.model.model.norm.register_forward_pre_hook(self._at(len(layers))))
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        for h in self.handles:
            h.remove()
        self.seen.clear()
        # the hooks hold self.pack, and self the saved tensors: a cycle that would keep every
        # activation of the record alive after it is dropped, until the garbage collector runs
        # (meanwhile each new record faulted in fresh pages: a recorded prefill ran 1.2x slower)
        self.hooks = self.saved = None


class PrefixCache:
    """Attention cache for a batch of responses that continue recorded prompts of any lengths.

    Row b's prompt K/V fill key slots 0..P_b-1 (padded to the longest prompt); the T new tokens
    follow at slots Pmax.., at positions P_b.., valid up to the row's own length. Masks apply
    causality and the model's sliding window on absolute positions.
    """

    def __init__(self, records: Sequence[PromptRecord], new_lengths: Sequence[int], t: int,
                 sliding_window: int | None) -> None:
        self.records, self.sliding_window = list(records), sliding_window
        device = records[0].device
        plen = torch.tensor([r.length for r in records], device=device)
        self.pmax = int(plen.max())
        prompt_pos = torch.arange(self.pmax, device=device).expand(len(records), -1)
        new = torch.arange(t, device=device)
        key_pos = torch.cat([prompt_pos, plen[:, None] + new], dim=1)  # [B, S]
        valid = torch.cat([prompt_pos < plen[:, None],
                           new[None] < torch.tensor(list(new_lengths), device=device)[:, None]], 1)
        self.positions = plen[:, None] + new  # [B, T]: where the new tokens sit
        q, k = self.positions[:, :, None], key_pos[:, None, :]
        ok = valid[:, None, :] & (k <= q)
        if sliding_window is not None:
            ok &= k > q - sliding_window
        self.mask = ok[:, None]  # [B, 1, T, S]

    def update(self, layer, k, v):
        pk, pv = [], []
        for r in self.records:
            rk, rv = r.kv(layer)
            pad = self.pmax - r.length
            pk.append(F.pad(rk, (0, 0, 0, pad)) if pad else rk)
            pv.append(F.pad(rv, (0, 0, 0, pad)) if pad else rv)
        keys = torch.cat([pk[0] if len(pk) == 1 else torch.cat(pk), k], dim=2)
        values = torch.cat([pv[0] if len(pv) == 1 else torch.cat(pv), v], dim=2)
        return keys, values, self.mask


def _pad(rows: Sequence[Sequence[int]], value: int, device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], device=device)


def reuse_loss(model: torch.nn.Module, records: Sequence[PromptRecord],
               responses: Sequence[Sequence[int]]) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over the response tokens, and their count.

    Runs only the response tokens (all but the last, which predicts nothing trained) in one padded
    batch attending to the records' K/V; the first response token is scored from the recorded
    last hidden state. Backward reaches the prompt positions through the records' graphs.
    """
    if len(records) != len(responses) or not records:
        raise ValueError(f"{len(records)} records for {len(responses)} responses; need equal, >= 1")
    for r, resp in zip(records, responses):
        if len(resp) == 0:
            raise ValueError(f"response {r.response_id!r} is empty; nothing to train on")
    params = list(model.parameters())
    for r in records:
        if r.exact and r.weight_versions != tuple(p._version for p in params):
            raise RuntimeError(
                f"record {r.response_id!r} was made before the weights were modified in place (an "
                "optimizer step): a record is exact only for the weights version that made it; "
                "use record.detached() for an inexact step")
    device = records[0].device
    h = torch.cat([r.hidden() for r in records])  # [B, 1, H]
    lengths = [len(resp) - 1 for resp in responses]
    t = max(lengths)
    if t > 0:
        ids = _pad([resp[:-1] for resp in responses], 0, device)
        cache = PrefixCache(records, lengths, t, model.config.sliding_window)
        hidden = model(ids, cache.positions, cache, return_hidden=True, compute_logits=False).hidden
        h = torch.cat([h, hidden], dim=1)
    # the head over [last prompt position, response positions] of every sample at once: a few
    # large weight-gradient products instead of a rank-1 one per sample (as slow as a full one on CPU)
    return head_loss(model, h, _pad(responses, IGNORE, device)), sum(len(resp) for resp in responses)


def head_loss(model: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
              rows: int = HEAD_ROWS) -> torch.Tensor:
    """Summed cross-entropy of the head's logits at the labelled positions of `hidden` [B, T, H]
    (labels [B, T], IGNORE where none), the head run over `rows` positions at a time: padding is
    never scored, the logits of only one chunk are live beyond what backward keeps, and training
    run in slices (online/slices.py) can stop between chunks of the head, forward and backward."""
    keep = labels.flatten() != IGNORE
    h, y = hidden.flatten(0, 1)[keep], labels.flatten()[keep]
    loss = hidden.new_zeros((), dtype=torch.float32)
    for i in range(0, len(y), rows):
        logits = model.lm_head(h[i:i + rows]).float()
        loss = loss + F.cross_entropy(logits, y[i:i + rows], reduction="sum")
    return loss


def recompute_loss(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                   responses: Sequence[Sequence[int]]) -> tuple[torch.Tensor, int]:
    """The baseline: one right-padded forward over prompt + response, logits only at the
    positions that predict response tokens. Same return as `reuse_loss`."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses; need equal, >= 1")
    for p, resp in zip(prompts, responses):
        if len(p) == 0 or len(resp) == 0:
            raise ValueError(f"prompt of {len(p)} and response of {len(resp)} tokens; both need >= 1")
    device = next(model.parameters()).device
    ids = _pad([list(p) + list(r) for p, r in zip(prompts, responses)], 0, device)
    at = _pad([range(len(p) - 1, len(p) + len(r) - 1) for p, r in zip(prompts, responses)], 0, device)
    hidden = model(ids, return_hidden=True, compute_logits=False).hidden
    hidden = torch.gather(hidden, 1, at[..., None].expand(-1, -1, hidden.shape[-1]))
    return head_loss(model, hidden, _pad(responses, IGNORE, device)), sum(len(r) for r in responses)


def reuse_gradient_errors(model: torch.nn.Module, prompt_ids: Sequence[int],
                          response_ids: Sequence[int], modes: dict[str, dict]) -> dict[str, float]:
    """Relative error of one sample's whole gradient when it reuses a record made with each of
    `modes` ({name: record_prompt keyword arguments}) against recomputing the prompt. Leaves the
    gradients cleared."""
    params = [p for p in model.parameters() if p.requires_grad]

    def gradient(loss_n: tuple[torch.Tensor, int]) -> torch.Tensor:
        loss, n = loss_n
        (loss / n).backward()
        g = torch.cat([p.grad.flatten() for p in params])
        model.zero_grad(set_to_none=True)
        return g

    model.zero_grad(set_to_none=True)
    want = gradient(recompute_loss(model, [prompt_ids], [response_ids]))
    out = {}
    for name, kw in modes.items():
        rec = record_prompt(model, prompt_ids, response_id=name, version=0, **kw)
        out[name] = float((gradient(reuse_loss(model, [rec], [response_ids])) - want).norm() / want.norm())
    return out
