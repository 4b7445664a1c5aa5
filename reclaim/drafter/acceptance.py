"""What a greedy chain draft would get: the drafter replayed over the target's greedy answers."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from reclaim.drafter.data import DrafterSample
from reclaim.models.cache import DenseCache
from reclaim.models.drafter import EagleDrafter, draft_head

def _truncate(cache: DenseCache, n: int) -> None:
    for d in (cache.keys, cache.values):
        for layer in list(d):
            d[layer] = d[layer][:, :, :n]


@torch.no_grad()
def greedy_acceptance(drafter: EagleDrafter, target: torch.nn.Module, samples: Iterable[DrafterSample],
                      num_speculative_tokens: int = 4, *,
                      features: Callable[[DrafterSample], torch.Tensor] = lambda s: s.hidden,
                      head: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]] | None = None,
                      ) -> dict[str, float]:
    """Replay greedy chain speculation over samples whose responses are the target's greedy
    output: at each verify the drafter proposes k tokens from the true states so far (feeding
    its own predictions after the first), the leading ones equal to the response are accepted,
    plus the target's bonus token. Drafts come from the drafter's draft vocabulary when it has
    one, as the engine's. `features` (the drafter's input states of a sample) and `head` (draft
    logits and their target ids from the drafter's states) default to EAGLE-1/2's: the final
    hidden states and the target's head rows. Returns verifies, accepted and tau = tokens per verify."""
    k = num_speculative_tokens
    embed = target.model.embed_tokens
    if head is None:
        rows, row_ids = draft_head(drafter, target)
        head = lambda g: (F.linear(g, rows), row_ids)  # noqa: E731
    p = next(drafter.parameters())
    was_training = drafter.training
    drafter.eval()
    verifies = accepted = 0
    for s in samples:
        ids, hidden = s.token_ids.to(p.device), features(s).to(p.device, p.dtype)
        t = s.num_tokens
        n = int(s.loss_mask.float().argmax())  # the first response token: sampled at prefill
        cache, fed = DenseCache(drafter.config.sliding_window), 0

        def feed(tokens: torch.Tensor, feats: torch.Tensor, start: int) -> torch.Tensor:
            pos = torch.arange(start, start + tokens.shape[0], device=p.device)[None]
            return drafter(embed(tokens[None]), feats[None], pos, cache)[0, -1]

        while n < t - 1:
            g = feed(ids[fed + 1:n + 1], hidden[fed:n], fed)  # pairs (f_i, x_{i+1}), i < n
            fed = n
            draft, m = [], min(k, t - 1 - n)
            for j in range(m):
                logits, vocab = head(g)
                tok = logits.argmax()
                tok = tok if vocab is None else vocab[tok]
                draft.append(int(tok))
                if j + 1 < m:
                    g = feed(tok[None], g[None], n + j)
            _truncate(cache, n)
            a = 0
            while a < len(draft) and draft[a] == int(ids[n + 1 + a]):
                a += 1
            verifies += 1
            accepted += a
            n += a + 1
    drafter.train(was_training)
    return {"verifies": verifies, "accepted": accepted,
            "tau": (accepted + verifies) / verifies if verifies else 0.0}
