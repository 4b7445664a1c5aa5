"""Log-probs of completions under a model, each distinct prompt run once for all its completions.

A GRPO micro-batch holds several completions of the same prompt. Right-padding each prompt +
completion to the longest row (TRL's layout) runs the prompt once per completion and every row
out to the longest completion: on SmolLM2 with a 64-token prompt and 8 completions of 21-108
tokens that is 1,376 token positions for 476 real ones. Here each distinct prompt is one row,
followed by its completions back to back; a mask lets a completion's token see the prompt and its
own earlier tokens only, and the completion's positions continue from the prompt's as in its own
row. The log-probs are those of separate rows (fp32 summation order aside) and the prompt's
gradient is the sum over its completions, as autograd gives for separate rows.

Attention is dense over a row (T^2 query-key pairs for T tokens), so long completions would make
it the larger cost: a row takes completions only up to `row_budget` tokens (where the dense
attention costs a quarter of the linear layers: 768 for SmolLM2, 6,600 for Llama-3-8B) and a
prompt with more completions than fit gets several rows, each starting with it.

The LM head runs in chunks of `chunk_size` completion positions (TRL's and Liger's answer to a
152K vocabulary): the decoder's final hidden states are taken at the positions that predict a
completion token, and each chunk of them goes through the head, the log-softmax and the gather on
its own, under activation checkpointing, so the backward recomputes one chunk's logits at a time.
A [tokens, vocabulary] tensor is never whole, forward or backward: at Qwen2.5's 152K vocabulary
32K completion tokens would take 20 GB of float32 logits and as much again for their
log-softmax. The price is the head's forward run twice for the gradient (Liger avoids it by
fusing the loss's gradient into the chunk; GRPO's loss only needs the log-probs, [N, C]).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from reclaim.models.cache import GivenMask


@dataclass
class Packed:
    """Rows of [prompt, completion, completion, ...], one per distinct prompt, padded to the longest.

    ids, positions, segment: [G, T]; segment is 0 on the prompt, k on the k-th completion (from 1)
    and -1 on padding. slots: [G, K] indices into T of the positions whose logits predict a
    completion token; targets: [G, K] those tokens; slot_valid: [G, K]. gather: [N, C] index into
    the flattened slots (G * K = a zero) giving completion n's log-prob of its token c."""

    ids: torch.Tensor
    positions: torch.Tensor
    segment: torch.Tensor
    slots: torch.Tensor
    targets: torch.Tensor
    slot_valid: torch.Tensor
    gather: torch.Tensor


def row_budget(config: Any) -> int:
    """Tokens in a packed row at which its dense attention costs a quarter of the linear layers
    (4 * heads * head_dim FLOPs a query-key pair against 2 FLOPs a weight per token)."""
    h, q = config.hidden_size, config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    weights = 2 * h * q + 2 * h * kv + 3 * h * config.intermediate_size
    return weights // (8 * q)


def _rows(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
          budget: int | None) -> list[tuple[tuple[int, ...], list[int]]]:
    """(prompt, completion indices) per row: a prompt's completions in order, a new row (the
    prompt again) when the next would take the row past `budget` tokens (None: no limit)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for n, p in enumerate(prompt_ids):
        if not len(p):
            raise ValueError(f"prompt {n} is empty; a completion's first log-prob needs a prompt token")
        groups.setdefault(tuple(p), []).append(n)
    rows = []
    for prompt, members in groups.items():
        row, size = [], len(prompt)
        for n in members:
            if row and budget is not None and size + len(completion_ids[n]) > budget:
                rows.append((prompt, row))
                row, size = [], len(prompt)
            row.append(n)
            size += len(completion_ids[n])
        rows.append((prompt, row))
    return rows


def pack(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
         budget: int | None = None) -> Packed:
    """The packed layout of (prompt, completion) pairs: equal prompts share a row, of at most
    `budget` tokens unless one completion alone needs more (None: no limit)."""
    rows = _rows(prompt_ids, completion_ids, budget)
    n_rows, c_max = len(rows), max((len(c) for c in completion_ids), default=0)
    layouts = []
    for prompt, members in rows:
        ids, pos, seg, slots, targets = list(prompt), list(range(len(prompt))), [0] * len(prompt), [], []
        for k, n in enumerate(members, start=1):
            comp = list(completion_ids[n])
            start = len(ids)
            if comp:  # the prompt's last position predicts the first token, then each token the next
                slots += [len(prompt) - 1, *range(start, start + len(comp) - 1)]
            targets += comp
            ids += comp
            pos += range(len(prompt), len(prompt) + len(comp))
            seg += [k] * len(comp)
        layouts.append((ids, pos, seg, slots, targets, members))
    t = max(len(x[0]) for x in layouts)
    k_max = max(max(len(x[3]) for x in layouts), 1)
    out = Packed(ids=torch.zeros(n_rows, t, dtype=torch.long), positions=torch.zeros(n_rows, t, dtype=torch.long),
                 segment=torch.full((n_rows, t), -1, dtype=torch.long),
                 slots=torch.zeros(n_rows, k_max, dtype=torch.long), targets=torch.zeros(n_rows, k_max, dtype=torch.long),
                 slot_valid=torch.zeros(n_rows, k_max, dtype=torch.bool),
                 gather=torch.full((len(completion_ids), c_max), n_rows * k_max, dtype=torch.long))
    for g, (ids, pos, seg, slots, targets, members) in enumerate(layouts):
        out.ids[g, :len(ids)] = torch.tensor(ids)
        out.positions[g, :len(pos)] = torch.tensor(pos)
        out.segment[g, :len(seg)] = torch.tensor(seg)
        out.slots[g, :len(slots)] = torch.tensor(slots, dtype=torch.long)
        out.targets[g, :len(targets)] = torch.tensor(targets, dtype=torch.long)
        out.slot_valid[g, :len(slots)] = True
        at = g * k_max
        for n in members:
            c = len(completion_ids[n])
            out.gather[n, :c] = torch.arange(at, at + c)
            at += c
    return out


def packed_mask(packed: Packed, window: int | None = None) -> torch.Tensor:
    """[G, 1, T, T] (True = attend): a token sees earlier positions of its own segment and of the
    prompt (the last `window` positions of them with a sliding window). Padding sees padding and
    the prompt, so no softmax row is empty; no real token sees padding."""
    seg, pos = packed.segment, packed.positions
    sq, sk = seg[:, :, None], seg[:, None, :]
    pq, pk = pos[:, :, None], pos[:, None, :]
    ok = ((sk == 0) | (sk == sq)) & (pk <= pq)
    if window is not None:
        ok &= pk > pq - window
    return ok[:, None]


def completion_logps(model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]],
                     completion_ids: Sequence[Sequence[int]], temperature: float = 1.0,
                     entropy: bool = False, chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [N, C] of each completion's tokens under `model` given its prompt (logits /
    temperature), and the entropies there if asked; C is the longest completion, shorter rows
    padded with 0. Logits are computed only at the positions that predict completion tokens,
    `chunk_size` of them at a time (None: all at once)."""
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None (all positions at once), got {chunk_size}")
    device = next(model.parameters()).device
    inner = getattr(model, "module", model)  # under DDP the policy is model.module
    config = inner.config
    packed = pack(prompt_ids, completion_ids, row_budget(config))
    cache = GivenMask(packed_mask(packed, config.sliding_window).to(device), config.sliding_window)
    ids, positions, slots = packed.ids.to(device), packed.positions.to(device), packed.slots.to(device)
    targets = packed.targets.to(device)
    if chunk_size is None:
        logits = model(ids, positions, cache, logit_positions=slots).logits / temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        slot_logps = logp_all.gather(-1, targets[..., None]).squeeze(-1)
        slot_ent = None
        if entropy:
            with torch.no_grad():
                slot_ent = -(logp_all.exp() * logp_all).sum(-1)
    else:
        hidden = model(ids, positions, cache, return_hidden=True, compute_logits=False).hidden
        valid = packed.slot_valid.flatten().nonzero().squeeze(-1).to(device)
        at = slots.flatten()[valid]  # the valid slots' positions in [G * T]
        rows = valid // slots.shape[1]
        h = hidden[rows, at]  # [M, H]: only the positions that predict a completion token
        lp, ent = chunked_head_logps(h, inner.lm_head.weight, targets.flatten()[valid], temperature,
                                     chunk_size, entropy)
        slot_logps = lp.new_zeros(slots.numel()).index_put((valid,), lp)
        slot_ent = None if ent is None else ent.new_zeros(slots.numel()).index_put((valid,), ent)
    gather = packed.gather.to(device)

    def per_completion(slot_values: torch.Tensor) -> torch.Tensor:  # [G, K] or [G * K] -> [N, C], 0 past each end
        return torch.cat([slot_values.flatten(), slot_values.new_zeros(1)])[gather]

    return per_completion(slot_logps), None if slot_ent is None else per_completion(slot_ent)


def chunked_head_logps(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor,
                       temperature: float, chunk_size: int, entropy: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(hidden @ head_weight.T / temperature) at `targets` [M] (and the entropies if
    asked) for hidden [M, H], `chunk_size` rows at a time; with autograd on, each chunk's logits
    are recomputed in the backward instead of kept."""
    grad = torch.is_grad_enabled() and (hidden.requires_grad or head_weight.requires_grad)
    lps, ents = [], []
    for s in range(0, hidden.shape[0], chunk_size):
        args = (hidden[s:s + chunk_size], head_weight, targets[s:s + chunk_size], temperature, entropy)
        lp, ent = checkpoint(_head_logps, *args, use_reentrant=False) if grad else _head_logps(*args)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = hidden.new_zeros(0, dtype=torch.promote_types(hidden.dtype, torch.float32))
        return empty, empty if entropy else None
    return torch.cat(lps), torch.cat(ents) if entropy else None


def _head_logps(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk: its logits (float32 at least, as the model's forward returns them), their
    log-softmax at the targets and, without gradient, their entropies."""
    logits = F.linear(h, weight)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp = torch.log_softmax(logits, dim=-1)
    ent = None
    if entropy:
        with torch.no_grad():
            ent = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), ent


def completion_mask(completion_ids: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """[N, C] float: 1 at each completion's tokens, 0 at padding."""
    c_max = max(len(c) for c in completion_ids)
    lens = torch.tensor([len(c) for c in completion_ids])
    return (torch.arange(c_max)[None] < lens[:, None]).float().to(device)
