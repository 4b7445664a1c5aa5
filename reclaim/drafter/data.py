"""Drafter training data: a sample is a sequence the target produced (prompt + its response),
the target's final-norm hidden states over it and a mask of the response tokens.

`collect` turns rollouts into samples with one no-grad target forward each, or a
`HiddenRecorder` as the engine's `on_forward` keeps the hidden states decoding computes anyway
(no extra forward); a `DrafterBuffer` keeps the newest within a token budget and draws each
step's batch from (seed, step), so a resumed run repeats exactly what an uninterrupted one does.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

@dataclass
class DrafterSample:
    """One sequence for drafter training: its tokens, the target's hidden states, response mask."""

    token_ids: torch.Tensor  # [T] int64
    hidden: torch.Tensor  # [T, H] the target's final-norm hidden states, detached
    loss_mask: torch.Tensor  # [T] bool: True at response tokens

    def __post_init__(self) -> None:
        t = self.token_ids.shape[0]
        if self.token_ids.dim() != 1 or self.hidden.shape[0] != t or self.loss_mask.shape != (t,):
            raise ValueError(f"a drafter sample needs token_ids [T], hidden [T, H], loss_mask [T]; got "
                             f"{tuple(self.token_ids.shape)}, {tuple(self.hidden.shape)}, "
                             f"{tuple(self.loss_mask.shape)}")
        if not bool(self.loss_mask[1:].any()):
            raise ValueError("a drafter sample needs a response token after position 0 "
                             "(the loss covers response positions only)")

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


class DrafterBuffer:
    """Samples for drafter training, at most `max_tokens` tokens: adding more drops the oldest."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self._samples: collections.deque[DrafterSample] = collections.deque()

    def add(self, samples: Iterable[DrafterSample]) -> int:
        """Append samples (newest last); returns how many old samples were dropped to fit."""
        dropped = 0
        for s in samples:
            if s.num_tokens > self.max_tokens:
                raise ValueError(f"a sample of {s.num_tokens} tokens exceeds the buffer's budget of "
                                 f"{self.max_tokens} tokens")
            self._samples.append(s)
            self.num_tokens += s.num_tokens
            while self.num_tokens > self.max_tokens:
                self.num_tokens -= self._samples.popleft().num_tokens
                dropped += 1
        return dropped

    def __len__(self) -> int:
        return len(self._samples)

    def __iter__(self):
        return iter(self._samples)

    def __getitem__(self, i: int) -> DrafterSample:
        return self._samples[i]

    def vocab(self) -> torch.Tensor:
        """The distinct token ids in the buffer, sorted."""
        return torch.unique(torch.cat([s.token_ids for s in self._samples]))

    def batch(self, step: int, seed: int, batch_size: int, batch_tokens: int) -> list[DrafterSample]:
        """Step `step`'s batch: samples in an order drawn from (seed, step), taken while at most
        `batch_size` sequences and `batch_tokens` padded tokens (at least one sequence)."""
        if not self._samples:
            raise ValueError("the drafter buffer is empty; add samples (collect) before training")
        g = torch.Generator().manual_seed(mix_seed(seed, step, 0))
        out: list[DrafterSample] = []
        longest = 0
        for i in torch.randperm(len(self._samples), generator=g, device=g.device).tolist():
            s = self._samples[i]
            longest_if = max(longest, s.num_tokens)
            if out and (len(out) >= batch_size or longest_if * (len(out) + 1) > batch_tokens):
                break
            out.append(s)
            longest = longest_if
        return out


def mix_seed(seed: int, step: int, stream: int) -> int:
    """A generator seed for (seed, step, stream), so each step's draws do not depend on history."""
    return (seed * 1_000_003 + step * 7_919 + stream) % (2**63 - 1)


@torch.no_grad()
def collect(target: torch.nn.Module, prompts_ids: Sequence[Sequence[int]],
            responses_ids: Sequence[Sequence[int]], *, store: str | torch.device = "cpu") -> list[DrafterSample]:
    """Samples from rollouts: one no-grad target forward per prompt + response for its hidden
    states, kept on `store`; the loss mask covers the response."""
    if len(prompts_ids) != len(responses_ids):
        raise ValueError(f"{len(prompts_ids)} prompts but {len(responses_ids)} responses")
    device = next(target.parameters()).device
    samples = []
    for prompt, response in zip(prompts_ids, responses_ids):
        if not prompt or not response:
            raise ValueError("collect needs a non-empty prompt and response for every sequence")
        ids = torch.tensor([list(prompt) + list(response)], device=device)
        hidden = target(ids, return_hidden=True, compute_logits=False).hidden[0]
        mask = torch.zeros(ids.shape[1], dtype=torch.bool)
        mask[len(prompt):] = True
        samples.append(DrafterSample(ids[0].cpu(), hidden.to(store), mask))
    return samples


class HiddenRecorder:
    """An engine `on_forward` hook that keeps each request's hidden states as the engine
    computes them (no extra forward). A recomputed position (preemption) replaces the old one; a
    prompt prefix the engine shared from another request's cache is filled from that request's
    recorded states (same tokens, same positions: same states). `drop` a request when done."""

    def __init__(self, store: str | torch.device = "cpu") -> None:
        self.store = store
        self._parts: dict[str, list[tuple[int, list[int], torch.Tensor]]] = collections.defaultdict(list)

    def __call__(self, records: list) -> None:
        for r in records:
            self.observe(r.request_id, r.start, r.token_ids, r.hidden)

    def observe(self, request_id: str, start: int, token_ids: Sequence[int], hidden: torch.Tensor) -> None:
        """Keep the states [len(token_ids), H] of positions start, start + 1, ... (a drafter's `observe`)."""
        self._parts[request_id].append((start, list(token_ids), hidden.detach().to(self.store, copy=True)))

    def drop(self, request_id: str) -> None:
        """Forget a request's states."""
        self._parts.pop(request_id, None)

    def _assemble(self, request_id: str, ids: list[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The request's recorded states over its tokens `ids` (None if nothing was recorded)
        and which positions they cover."""
        parts = self._parts.get(request_id, [])
        seen = torch.zeros(len(ids), dtype=torch.bool)
        if not parts:
            return None, seen
        hidden = torch.empty(len(ids), parts[0][2].shape[-1], dtype=parts[0][2].dtype, device=self.store)
        for start, _, h in parts:
            n = max(0, min(h.shape[0], len(ids) - start))
            hidden[start:start + n], seen[start:start + n] = h[:n], True
        return hidden, seen

    def samples(self, requests: Sequence[tuple[str, Sequence[int], Sequence[int]]]) -> list[DrafterSample]:
        """Samples of finished requests, given as (request id, prompt ids, response ids): each is
        prompt + response without its last token (the target never ran it: it was sampled and
        the request ended). A prompt prefix the engine shared from another request's cache is
        filled from the requests here whose tokens agree with it from position 0."""
        full = {rid: list(p) + list(r)[:-1] for rid, p, r in requests}
        out = []
        for rid, prompt, _ in requests:
            ids = full[rid]
            hidden, seen = self._assemble(rid, ids)
            if hidden is None:
                raise ValueError(f"no hidden states were recorded for request {rid!r}; pass the "
                                 "recorder as the engine's on_forward")
            for other, theirs in full.items():  # a shared prefix: from requests that computed it
                if bool(seen.all()):
                    break
                agree = next((i for i, (a, b) in enumerate(zip(ids, theirs)) if a != b), min(len(ids), len(theirs)))
                if other == rid or agree == 0:
                    continue
                h, s = self._assemble(other, theirs[:agree])
                if h is not None:
                    fill = s & ~seen[:agree]
                    hidden[:agree][fill] = h[fill]
                    seen[:agree] |= fill
            if not bool(seen.all()):
                raise ValueError(f"request {rid!r}: hidden states of positions "
                                 f"{(~seen).nonzero().flatten().tolist()[:8]} were not recorded (nor "
                                 "by a request given with it that shares them)")
            mask = torch.zeros(len(ids), dtype=torch.bool)
            mask[len(prompt):] = True
            out.append(DrafterSample(torch.tensor(ids), hidden, mask))
        return out
