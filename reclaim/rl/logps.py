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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

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
                     entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [N, C] of each completion's tokens under `model` given its prompt (logits /
    temperature), and the entropies there if asked; C is the longest completion, shorter rows
    padded with 0. Logits are computed only at the positions that predict completion tokens."""
    device = next(model.parameters()).device
    config = getattr(model, "module", model).config  # under DDP the policy is model.module
    packed = pack(prompt_ids, completion_ids, row_budget(config))
    cache = GivenMask(packed_mask(packed, config.sliding_window).to(device), config.sliding_window)
    logits = model(packed.ids.to(device), packed.positions.to(device), cache,
                   logit_positions=packed.slots.to(device)).logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    slot_logps = logp_all.gather(-1, packed.targets.to(device)[..., None]).squeeze(-1)
    gather = packed.gather.to(device)

    def per_completion(slot_values: torch.Tensor) -> torch.Tensor:  # [G, K] -> [N, C], 0 past each end
        return torch.cat([slot_values.flatten(), slot_values.new_zeros(1)])[gather]

    logps = per_completion(slot_logps)
    ent = None
    if entropy:
        with torch.no_grad():
            ent = per_completion(-(logp_all.exp() * logp_all).sum(-1))
    return logps, ent


def completion_mask(completion_ids: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """[N, C] float: 1 at each completion's tokens, 0 at padding."""
    c_max = max(len(c) for c in completion_ids)
    lens = torch.tensor([len(c) for c in completion_ids])
    return (torch.arange(c_max)[None] < lens[:, None]).float().to(device)
