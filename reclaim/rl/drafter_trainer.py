"""Training an EAGLE drafter on the target's own hidden states (the TLT / EAGLE recipe).

A sample is a sequence the target produced (prompt + its response), the target's final-norm
hidden states f_0..f_{T-1} over it, and a mask of the response tokens. The drafter sees the
pairs (f_i + noise, embed(x_{i+1})) at positions i = 0..T-2 with causal attention and predicts
g_i ~ f_{i+1}; the loss, over positions whose f_{i+1} belongs to the response, is

    reg_weight * SmoothL1(g_i, f_{i+1}) + ce_weight * CE(softmax(head(f_{i+1})), log_softmax(head(g_i)))

with the target's embeddings and LM head frozen (the soft cross-entropy is against the target's
next-token distribution). EAGLE (SafeAILab/EAGLE, train/main.py) weights them 1.0 and 0.1 and adds
uniform noise to the input features, (U[0,1) - 0.5) * 0.2 * 512 / T, which is +-0.1 at its usual
T = 512; here the noise is a fixed U(-feature_noise, feature_noise), 0.1 by default. Two
options: `unroll_steps` > 1 adds passes that feed the drafter's own predictions in place of f
(what chain drafting does after its first token; EAGLE-3's training-time test in its simplest
form), and `ce_vocab` takes the cross-entropy over the buffer's tokens only (SmolLM2's head is
most of a step's cost).

Online use (the RL engine on idle workers): `collect` turns rollouts into samples, or a
`HiddenRecorder` as the engine's `on_forward` keeps the hidden states decoding computes anyway
(no extra forward); a `DrafterBuffer` keeps the newest within a token budget, `train_drafter`
runs optimizer steps on it. Batches and noise are drawn from (seed, step), so a resumed run
repeats exactly what an uninterrupted one does. `OnlineDrafter` puts these together for GRPO
(TLT's adaptive drafter trainer): its drafter is the rollout engine's, recorded through a
`RecordingProposer` (which also sees the accepted draft tokens' states), trained in place
between rollouts and synchronised across torchrun ranks.

Offline use: `reclaim drafter train --config drafter-smollm2` (`train`): the target answers chat
prompts and procedural tasks with the engine, then the drafter trains with a progress bar,
log.jsonl, HF-style checkpoint-{step}/ directories and --resume; the final drafter (the EAGLE
layout) lands in output_dir, and `greedy_acceptance` on held-out prompts gives its tau.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from reclaim.data.tasks import check_source
from reclaim.engine.eagle import EagleProposer
from reclaim.models.cache import DenseCache
from reclaim.models.loading import as_dtype
from reclaim.models.drafter import (
    EagleDrafter, draft_head, load_drafter, most_frequent, new_drafter, save_drafter,
)
from reclaim.optim import adamw
from reclaim.paths import cache_root
from reclaim.checkpoints import CHECKPOINT_PREFIX, checkpoints, trim_log
from reclaim.schedule import SCHEDULES, lr_scheduler

CE_VOCABS = ("full", "buffer")
DRAFTER_TYPES = ("eagle", "eagle3")  # EAGLE-1/2 (this module) and EAGLE-3 (eagle3_trainer.py)


# ---- samples and the buffer --------------------------------------------------------------------

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
        g = torch.Generator().manual_seed(_mix(seed, step, 0))
        out: list[DrafterSample] = []
        longest = 0
        for i in torch.randperm(len(self._samples), generator=g).tolist():
            s = self._samples[i]
            longest_if = max(longest, s.num_tokens)
            if out and (len(out) >= batch_size or longest_if * (len(out) + 1) > batch_tokens):
                break
            out.append(s)
            longest = longest_if
        return out


def _mix(seed: int, step: int, stream: int) -> int:
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


# ---- the loss and the training steps -----------------------------------------------------------

def _pad(batch: Sequence[DrafterSample], device: torch.device, dtype: torch.dtype):
    t = max(s.num_tokens for s in batch)
    h = batch[0].hidden.shape[-1]
    ids = torch.zeros(len(batch), t, dtype=torch.long)
    hidden = torch.zeros(len(batch), t, h, dtype=dtype)
    mask = torch.zeros(len(batch), t, dtype=torch.bool)
    for i, s in enumerate(batch):
        n = s.num_tokens
        ids[i, :n], hidden[i, :n], mask[i, :n] = s.token_ids, s.hidden.to(dtype), s.loss_mask
    return ids.to(device), hidden.to(device), mask.to(device)


def drafter_loss(drafter: EagleDrafter, target: torch.nn.Module, batch: Sequence[DrafterSample], *,
                 feature_noise: float = 0.1, reg_weight: float = 1.0, ce_weight: float = 0.1,
                 ce_vocab: torch.Tensor | None = None, unroll_steps: int = 1,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The EAGLE loss on a batch (see the module docstring) and its parts: reg_loss, ce_loss,
    accuracy (the drafter's top-1 equals the target's, first pass), tokens.

    ce_vocab: token ids the cross-entropy's two distributions are taken over (renormalised), e.g.
    the buffer's tokens (`DrafterBuffer.vocab`); None: the whole vocabulary. A small model's head
    is most of a step's cost, and greedy rollouts' argmax tokens are all in the buffer.
    unroll_steps > 1: after the first pass, each further pass feeds the previous pass's
    predictions g_{i-1} (detached) in place of f_i, as chain drafting does after its first token;
    the loss is the mean over passes."""
    if unroll_steps < 1:
        raise ValueError(f"unroll_steps must be >= 1, got {unroll_steps}")
    p = next(drafter.parameters())
    embed_w, head_w = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    if ce_vocab is not None:
        head_w = head_w[ce_vocab.to(head_w.device)]
    ids, hidden, mask = _pad(batch, p.device, p.dtype)
    b, t = ids.shape
    with torch.no_grad():
        embeds = F.embedding(ids[:, 1:], embed_w)
        feats = hidden[:, :-1]
        if feature_noise:
            noise = torch.rand(feats.shape, generator=generator, dtype=torch.float32)
            feats = feats + ((noise * 2 - 1) * feature_noise).to(feats)
        sel = mask[:, 1:]  # g_i counts where f_{i+1} is a response token's state
        want = hidden[:, 1:][sel]
        target_probs = torch.softmax(F.linear(want, head_w).float(), dim=-1)
    positions = torch.arange(t - 1, device=ids.device).expand(b, -1)
    reg = ce = torch.zeros((), device=p.device)
    for u in range(unroll_steps):
        g_all = drafter(embeds, feats, positions)
        g = g_all[sel]
        reg = reg + F.smooth_l1_loss(g.float(), want.float(), reduction="none").mean(-1).mean() / unroll_steps
        logq = torch.log_softmax(F.linear(g, head_w).float(), dim=-1)
        ce = ce + -(target_probs * logq).sum(-1).mean() / unroll_steps
        if u == 0:
            acc = (logq.argmax(-1) == target_probs.argmax(-1)).float().mean()
        if u + 1 < unroll_steps:  # g_{i-1} stands in for f_i; position 0 keeps the true f_0
            feats = torch.cat([feats[:, :1], g_all[:, :-1].detach()], dim=1)
    loss = reg_weight * reg + ce_weight * ce
    return loss, {"reg_loss": reg.item(), "ce_loss": ce.item(), "accuracy": acc.item(),
                  "tokens": int(sel.sum())}


def make_optimizer(drafter: EagleDrafter, lr: float, *, weight_decay: float = 0.0,
                   betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW over the drafter's own weights (EAGLE's betas)."""
    return adamw(list(drafter.parameters()), lr=lr, betas=betas, weight_decay=weight_decay)


def train_drafter(drafter: EagleDrafter, target: torch.nn.Module, buffer: DrafterBuffer, *,
                  steps: int, optimizer: torch.optim.Optimizer | None = None, lr: float = 1e-4,
                  scheduler: Any = None, batch_size: int = 8, batch_tokens: int = 4096,
                  feature_noise: float = 0.1, reg_weight: float = 1.0, ce_weight: float = 0.1,
                  ce_vocab: torch.Tensor | None = None, unroll_steps: int = 1,
                  max_grad_norm: float = 0.5, seed: int = 0, bf16: bool = False,
                  start_step: int = 0,
                  on_step: Callable[[dict[str, Any]], None] | None = None,
                  loss_fn: Callable[[list[DrafterSample]], tuple[torch.Tensor, dict[str, Any]]] | None = None,
                  ) -> list[dict[str, Any]]:
    """Run `steps` optimizer steps (numbered from `start_step`) of the drafter on the buffer; the
    target gets no gradient. Pass the same optimizer (and scheduler) across calls to continue
    training; without one, AdamW at `lr`. bf16: the loss's matmuls under bfloat16 autocast (weights
    and optimizer stay in their dtype; about 2x faster on a CPU with AMX). loss_fn(batch): another
    drafter's loss and its parts (EAGLE-3's) in place of `drafter_loss` and its options. Returns
    one record per step (also given to on_step)."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if optimizer is None:
        optimizer = make_optimizer(drafter, lr)
    mine = {id(q) for q in drafter.parameters()}
    if any(id(q) not in mine for group in optimizer.param_groups for q in group["params"]):
        raise ValueError("the optimizer holds parameters that are not the drafter's; the target "
                         "(embeddings, head) stays frozen")
    was_training = drafter.training
    device = next(drafter.parameters()).device.type
    drafter.train()
    records = []
    try:
        for step in range(start_step, start_step + steps):
            t0 = time.perf_counter()
            batch = buffer.batch(step, seed, batch_size, batch_tokens)
            noise = torch.Generator().manual_seed(_mix(seed, step, 1))
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
                loss, parts = loss_fn(batch) if loss_fn is not None else drafter_loss(
                    drafter, target, batch, feature_noise=feature_noise, reg_weight=reg_weight, ce_weight=ce_weight,
                    ce_vocab=ce_vocab, unroll_steps=unroll_steps, generator=noise)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), max_grad_norm)
            lr_now = optimizer.param_groups[0]["lr"]
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            rec = {"step": step + 1, "loss": loss.item(), **parts, "learning_rate": lr_now,
                   "grad_norm": float(norm), "step_s": time.perf_counter() - t0}
            records.append(rec)
            if on_step is not None:
                on_step(rec)
    finally:
        drafter.train(was_training)
    return records


# ---- acceptance: what a greedy chain draft would get ------------------------------------------

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


# ---- online: the rollout engine's drafter trained between rollouts (TLT) -----------------------

class RecordingProposer(EagleProposer):
    """The engine's EAGLE proposer that also hands every hidden state the target computes to a
    HiddenRecorder: prefill, decode and the accepted draft positions, which a verify forward
    computes and `on_forward` (chunk tokens only) does not see."""

    def __init__(self, drafter: EagleDrafter, target: torch.nn.Module, recorder: HiddenRecorder,
                 **tree: int) -> None:
        super().__init__(drafter, target, **tree)
        self.recorder = recorder

    def observe(self, seq_id: str, start: int, token_ids: list[int], hidden: torch.Tensor) -> None:
        self.recorder.observe(seq_id, start, token_ids, hidden)
        super().observe(seq_id, start, token_ids, hidden)


class OnlineDrafter:
    """TLT's adaptive drafter trainer: the rollout engine's EAGLE drafter (trained in place, so
    the engine's proposer drafts with the new weights at once) learns from the hidden states of
    recent rollouts in a bounded buffer; a frozen copy of the starting drafter is kept to compare
    acceptance against. Under torchrun (`sync`) every rank adds the others' samples and takes the
    weights and optimizer state of the rank that trained most, so all draft alike next rollout."""

    def __init__(self, drafter: EagleDrafter, *, buffer_tokens: int, lr: float, max_steps: int,
                 seed: int = 0, eval_samples: int = 4, eval_depth: int = 4) -> None:
        if max_steps < 1 or eval_samples < 0 or eval_depth < 1:
            raise ValueError(f"need max_steps >= 1, eval_samples >= 0, eval_depth >= 1; got {max_steps}, "
                             f"{eval_samples}, {eval_depth}")
        self.drafter = drafter
        self.frozen = copy.deepcopy(drafter).eval().requires_grad_(False)
        self.recorder = HiddenRecorder()
        self.buffer = DrafterBuffer(buffer_tokens)
        self.optimizer = make_optimizer(drafter, lr)
        self.max_steps, self.seed, self.eval_samples, self.eval_depth = max_steps, seed, eval_samples, eval_depth
        self.steps = 0  # optimizer steps of the drafter in use, over the whole run
        self._rolled: EagleDrafter | None = None  # the drafter the current rollout drafts with

    def proposer(self, target: torch.nn.Module) -> RecordingProposer:
        """The engine's drafter (Engine(drafter=...)): proposes with self.drafter, records states."""
        return RecordingProposer(self.drafter, target, self.recorder)

    def begin_rollout(self) -> None:
        """Keep a copy of the drafter this rollout drafts with (for `evaluate`, after it trained)."""
        if self.eval_samples:
            self._rolled = copy.deepcopy(self.drafter).eval()

    @property
    def rolled(self) -> EagleDrafter | None:
        """The drafter as it was when the current rollout began (None before one, or without eval)."""
        return self._rolled

    def collect(self, outputs: Sequence[Any]) -> list[DrafterSample]:
        """Samples of the rollout's finished requests (RequestOutputs); their states are dropped.
        A one-token completion leaves no response position to learn from and is skipped."""
        keep = [(o.request_id, o.prompt_token_ids, o.token_ids) for o in outputs if len(o.token_ids) >= 2]
        samples = self.recorder.samples(keep) if keep else []
        for o in outputs:
            self.recorder.drop(o.request_id)
        return samples

    def train(self, samples: Sequence[DrafterSample], target: torch.nn.Module,
              stop: Callable[[], bool] | None = None) -> list[dict[str, Any]]:
        """Add samples to the buffer, then train up to max_steps steps, checking `stop` (the
        slowest worker is done) before each; returns the steps' records."""
        self.buffer.add(samples)
        records: list[dict[str, Any]] = []
        if not len(self.buffer):
            return records
        vocab = self.buffer.vocab()
        while len(records) < self.max_steps and not (stop is not None and stop()):
            records += train_drafter(self.drafter, target, self.buffer, steps=1, optimizer=self.optimizer,
                                     seed=self.seed, start_step=self.steps + len(records), ce_vocab=vocab)
        self.steps += len(records)
        self.drafter.eval()
        return records

    def sync(self, world: Any, rank_samples: Sequence[Sequence[DrafterSample]], rank_steps: Sequence[int]) -> int:
        """After every rank's `train`: add the other ranks' samples (rank_samples[r], rank order)
        and give every rank the drafter of the one that trained most (its weights and optimizer
        state); returns that rank."""
        for r, samples in enumerate(rank_samples):
            if r != world.rank:
                self.buffer.add(samples)
        src = max(range(len(rank_steps)), key=rank_steps.__getitem__)
        if world.size > 1 and rank_steps[src]:
            world.broadcast_tensors(self.drafter.parameters(), src)
            self.optimizer.load_state_dict(world.broadcast(
                self.optimizer.state_dict() if world.rank == src else None, src))
        self.steps += rank_steps[src] - rank_steps[world.rank]  # all ranks started the rollout level
        return src

    def evaluate(self, samples: Sequence[DrafterSample], target: torch.nn.Module) -> dict[str, float]:
        """Greedy chain replay (`greedy_acceptance`, eval_depth tokens) on the first eval_samples
        samples of the rollout: tau of the drafter that drafted it (before training on it) and of
        the frozen starting drafter."""
        picked = list(samples[:self.eval_samples])
        if not picked or self._rolled is None:
            return {}
        online = greedy_acceptance(self.rolled, target, picked, self.eval_depth)
        frozen = greedy_acceptance(self.frozen, target, picked, self.eval_depth)
        return {"drafter/tau_online": online["tau"], "drafter/tau_frozen": frozen["tau"]}

    def save(self, directory: Path) -> None:
        """directory/drafter (the EAGLE layout) and directory/drafter_state.pt (optimizer, steps)."""
        save_drafter(self.drafter, directory / "drafter")
        torch.save({"optimizer": self.optimizer.state_dict(), "steps": self.steps}, directory / "drafter_state.pt")

    def load(self, directory: Path, target: torch.nn.Module) -> None:
        """The drafter and its optimizer as `save` wrote them (the frozen copy stays the start)."""
        with torch.no_grad():
            self.drafter.load_state_dict(load_drafter(directory / "drafter", target).state_dict())
        state = torch.load(directory / "drafter_state.pt")
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = state["steps"]


# ---- `reclaim drafter train` -------------------------------------------------------------------

@dataclass
class DrafterTrainConfig:
    """`reclaim drafter train`: the target answers prompts, the drafter learns its hidden states.

    Names follow transformers' TrainingArguments where they exist. Load one with
    `reclaim.config.load_config(DrafterTrainConfig, path_or_name, overrides)`.
    """

    output_dir: str = "runs/drafter"
    drafter_type: str = "eagle"  # eagle (EAGLE-1/2) | eagle3 (its own fields: Eagle3TrainConfig)
    model: str | None = None  # the target's HF directory; None: the bundled SmolLM2-135M-Instruct
    dtype: str = "float32"
    device: str = "cpu"
    # Data: the target's own answers to these prompts (chat template applied).
    prompts: str = "mixed"  # chat | tasks | mixed | rg:<reasoning-gym dataset> | a file: one prompt per line or JSON lines {"prompt"}
    num_prompts: int = 128
    eval_prompts: int = 16  # held out (drawn after the training prompts): greedy tau at the end
    max_new_tokens: int = 96
    temperature: float = 0.0  # 0: greedy answers
    generation_batch_size: int = 32  # sequences the engine runs at once
    rollout_chunk: int = 256  # training prompts answered, then saved, at a time (resume continues from there)
    # The training answers' dtype (None: dtype): bfloat16 answers 2.5x faster on a CPU with AMX;
    # the drafter then learns that model's hidden states. Held-out answers always use dtype.
    rollout_dtype: str | None = None
    buffer_tokens: int = 1_000_000
    # Optimisation.
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    max_grad_norm: float = 0.5
    max_steps: int = 300
    per_device_train_batch_size: int = 8  # sequences per step
    max_batch_tokens: int = 4096  # padded tokens per step
    warmup_steps: int = 0  # > 0 wins over warmup_ratio, as in transformers
    warmup_ratio: float = 0.0
    lr_scheduler_type: str = "cosine"
    bf16: bool = False  # the loss under bfloat16 autocast, as transformers' TrainingArguments.bf16
    feature_noise: float = 0.1
    unroll_steps: int = 2  # passes feeding the drafter's own predictions (chain drafting's later tokens)
    ce_vocab: str = "buffer"  # full | buffer: the cross-entropy over the buffer's tokens (cheaper)
    # The drafter's own vocabulary at inference (EAGLE-3's d2t): the N most frequent training
    # tokens, so a draft token scores N head rows, not the whole vocabulary (0: all). Set after the
    # held-out evaluation, which scores the whole vocabulary.
    draft_vocab_size: int = 0
    reg_loss_weight: float = 1.0
    ce_loss_weight: float = 0.1
    num_speculative_tokens: int = 4  # the held-out evaluation's draft length
    seed: int = 42
    logging_steps: int = 10
    save_steps: int = 0  # 0: save only at the end
    save_total_limit: int | None = None
    resume_from_checkpoint: bool = False

    def __post_init__(self) -> None:
        if self.drafter_type not in DRAFTER_TYPES:
            raise ValueError(f"drafter_type {self.drafter_type!r} is not one of {list(DRAFTER_TYPES)}")
        if self.lr_scheduler_type not in SCHEDULES:
            raise ValueError(f"lr_scheduler_type {self.lr_scheduler_type!r} is not one of {list(SCHEDULES)}")
        check_source(self.prompts)
        if self.rollout_dtype is not None:
            as_dtype(self.rollout_dtype)  # names the value and what is allowed
        for name in ("num_prompts", "max_new_tokens", "generation_batch_size", "rollout_chunk", "buffer_tokens",
                     "max_steps", "per_device_train_batch_size", "max_batch_tokens", "logging_steps",
                     "num_speculative_tokens", "unroll_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_prompts", "warmup_steps", "save_steps", "temperature", "feature_noise",
                     "learning_rate", "weight_decay", "reg_loss_weight", "ce_loss_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.ce_vocab not in CE_VOCABS:
            raise ValueError(f"ce_vocab {self.ce_vocab!r} is not one of {list(CE_VOCABS)}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")

    @property
    def num_warmup_steps(self) -> int:
        """transformers' rule: warmup_steps if set, else ceil(warmup_ratio * max_steps)."""
        return self.warmup_steps if self.warmup_steps > 0 else math.ceil(self.warmup_ratio * self.max_steps)


def save_checkpoint(out: Path, step: int, drafter: EagleDrafter, optimizer, scheduler,
                    state: dict[str, Any], save: Callable[[Any, Path], Path] = save_drafter) -> Path:
    """checkpoint-{step}/: the drafter in its layout (`save`: EAGLE's by default), optimizer,
    scheduler and trainer_state.json, written atomically."""
    from reclaim.storage import atomic_dir

    def write(tmp: Path) -> None:
        save(drafter, tmp)  # first, while tmp is still empty (saving replaces it)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")

    return atomic_dir(out / f"{CHECKPOINT_PREFIX}{step}", write)


def _place_final(drafter: EagleDrafter, out: Path, save: Callable[[Any, Path], Path] = save_drafter) -> None:
    """The final drafter's config.json and weights in output_dir itself (beside the logs), the
    config last so a directory with one holds complete weights."""
    staged = save(drafter, out / ".final-drafter")
    for name in sorted(os.listdir(staged), key=lambda n: n == "config.json"):
        os.replace(staged / name, out / name)
    shutil.rmtree(staged, ignore_errors=True)


def _answer(engine: Any, recorder: HiddenRecorder, prompts: Sequence[list[int]],
            params: Sequence[Any]) -> list[DrafterSample | None]:
    """The engine's answers to `prompts` as samples (None for a one-token answer: no response
    position to learn from), the recorder emptied of them afterwards."""
    outs = engine.generate(list(prompts), list(params))
    got: list[DrafterSample | None] = [None] * len(outs)
    keep = [i for i, o in enumerate(outs) if len(o.token_ids) >= 2]
    samples = recorder.samples([(outs[i].request_id, outs[i].prompt_token_ids, outs[i].token_ids) for i in keep])
    for i, x in zip(keep, samples):
        got[i] = x
    for o in outs:
        recorder.drop(o.request_id)
    return got


def _rollouts(cfg: DrafterTrainConfig, target: torch.nn.Module, tokenizer: Any, out: Path,
              log: Callable[[str], None], train: bool = True) -> tuple[list[DrafterSample], list[DrafterSample]]:
    """Samples of the target answering the training prompts (at cfg.temperature, by the target
    cast to cfg.rollout_dtype if set; none without `train`) and the held-out ones (greedy, by the
    target itself, for the acceptance replay), hidden states recorded as the engine runs. The
    training prompts are answered in parts of cfg.rollout_chunk, each saved to
    output_dir/rollouts/ as it completes: a run started again with resume_from_checkpoint reads
    the parts back and answers only what is missing."""
    from reclaim.data.tasks import make_prompts
    from reclaim.engine.engine import Engine
    from reclaim.engine.request import SamplingParams
    from reclaim.models.tokenizer import encode_chat

    parts = out / "rollouts"
    if not cfg.resume_from_checkpoint and parts.exists():
        shutil.rmtree(parts)  # a fresh run answers afresh
    parts.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        raise ValueError(f"the target {cfg.model!r} has no tokenizer files; the prompts need its chat template")
    texts = make_prompts(cfg.prompts, cfg.num_prompts + cfg.eval_prompts, cfg.seed)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in texts]
    max_len = min(max(len(p) for p in prompts) + cfg.max_new_tokens, target.config.max_position_embeddings)

    def engine_of(model: torch.nn.Module) -> tuple[Any, HiddenRecorder]:
        recorder = HiddenRecorder()
        return Engine(model, tokenizer, max_num_seqs=cfg.generation_batch_size, on_forward=recorder,
                      max_model_len=max_len, seed=cfg.seed), recorder

    def read(path: Path) -> list[DrafterSample | None]:
        return [None if d is None else DrafterSample(**d) for d in torch.load(path)]

    def save(path: Path, got: list[DrafterSample | None]) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save([None if x is None else dataclasses.asdict(x) for x in got], tmp)
        os.replace(tmp, path)  # a part on disk is complete

    own = as_dtype(cfg.rollout_dtype) in (None, next(target.parameters()).dtype)
    gen_model = target if own else copy.deepcopy(target).to(as_dtype(cfg.rollout_dtype))
    engine, recorder = None, None
    train_s: list[DrafterSample] = []
    t0, tokens = time.perf_counter(), 0
    for k, start in enumerate(range(0, cfg.num_prompts if train else 0, cfg.rollout_chunk)):
        stop = min(start + cfg.rollout_chunk, cfg.num_prompts)
        path = parts / f"part-{k:05d}.pt"
        if path.exists():
            got = read(path)
        else:
            if engine is None:
                engine, recorder = engine_of(gen_model)
            params = [SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_new_tokens,
                                     seed=cfg.seed + i) for i in range(start, stop)]
            got = _answer(engine, recorder, prompts[start:stop], params)
            save(path, got)
            tokens += sum(x.num_tokens - len(prompts[start + i]) + 1 for i, x in enumerate(got) if x is not None)
            log(f"target answered {stop} of {cfg.num_prompts} training prompts: {tokens} answer tokens "
                f"in {time.perf_counter() - t0:.1f} s this run")
        train_s += [x for x in got if x is not None]
    eval_s: list[DrafterSample] = []
    if cfg.eval_prompts:
        if (parts / "eval.pt").exists():
            got = read(parts / "eval.pt")
        else:
            if not own or engine is None:
                engine, recorder = engine_of(target)
            got = _answer(engine, recorder, prompts[cfg.num_prompts:],
                          [SamplingParams(temperature=0.0, max_tokens=cfg.max_new_tokens)] * cfg.eval_prompts)
            save(parts / "eval.pt", got)
        eval_s = [x for x in got if x is not None]
    return train_s, eval_s


def _start(cfg: DrafterTrainConfig) -> tuple[Path, torch.nn.Module, Any]:
    """output_dir made, the frozen target and its tokenizer loaded; a resume with nothing saved refused."""
    from reclaim.models.loading import load_model

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    target, tokenizer = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
    target.requires_grad_(False)
    if cfg.resume_from_checkpoint and not (checkpoints(out) or (out / "rollouts").exists()):
        raise ValueError(f"resume_from_checkpoint is set but {str(out)!r} has neither a "
                         f"{CHECKPOINT_PREFIX}* directory nor saved rollouts")
    return out, target, tokenizer


def fit(cfg: DrafterTrainConfig, out: Path, *, new: Callable[[], Any], load: Callable[[Path], Any],
        save: Callable[[Any, Path], Path], run: Callable[..., Any], keys: Sequence[str],
        progress: bool = True) -> tuple[Any, list[dict[str, Any]], float]:
    """cfg.max_steps optimizer steps of a drafter made by `new()`, or resumed from output_dir's last
    checkpoint (`load`): AdamW, cfg's schedule, a progress bar, log.jsonl (means of `keys` every
    logging_steps) and checkpoint-{step}/ (`save`) every save_steps. run(drafter, optimizer,
    scheduler, start_step, on_step) runs the steps. Returns the drafter, the log history and the
    training seconds."""
    from tqdm import tqdm

    step, history = 0, []
    log_path = out / "log.jsonl"
    found = checkpoints(out) if cfg.resume_from_checkpoint else []
    last = found[-1] if found else None
    if last is not None:
        state = json.loads((last / "trainer_state.json").read_text())
        step, history = state["global_step"], state["log_history"]
        drafter = load(last)
        trim_log(log_path, step)
    else:
        torch.manual_seed(cfg.seed)
        drafter = new()
        if log_path.exists():
            log_path.unlink()  # a fresh run starts a fresh log
    opt = make_optimizer(drafter, cfg.learning_rate, weight_decay=cfg.weight_decay,
                         betas=(cfg.adam_beta1, cfg.adam_beta2))
    sched = lr_scheduler(opt, cfg.lr_scheduler_type, warmup_steps=cfg.num_warmup_steps,
                         total_steps=cfg.max_steps)
    if last is not None:
        opt.load_state_dict(torch.load(last / "optimizer.pt"))
        sched.load_state_dict(torch.load(last / "scheduler.pt"))
    config_dict = dataclasses.asdict(cfg)
    (out / "train_config.json").write_text(json.dumps(config_dict, indent=2) + "\n")

    bar = tqdm(total=cfg.max_steps, initial=step, disable=not progress, desc="drafter train")
    window: list[dict[str, Any]] = []

    def on_step(rec: dict[str, Any]) -> None:
        window.append(rec)
        bar.update(1)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=f"{rec['accuracy']:.2f}")
        s = rec["step"]
        if s % cfg.logging_steps == 0 or s == cfg.max_steps:
            avg = {k: sum(r[k] for r in window) / len(window) for k in keys}
            entry = {"step": s, **avg, "learning_rate": rec["learning_rate"],
                     "tokens": sum(r["tokens"] for r in window)}
            history.append(entry)
            with open(log_path, "a") as f:
                f.write(json.dumps(entry) + "\n")
            window.clear()
        if (cfg.save_steps and s % cfg.save_steps == 0) or s == cfg.max_steps:
            state = {"global_step": s, "max_steps": cfg.max_steps, "log_history": history,
                     "config": config_dict}
            save_checkpoint(out, s, drafter, opt, sched, state, save)
            if cfg.save_total_limit:
                for old in checkpoints(out)[:-cfg.save_total_limit]:
                    shutil.rmtree(old, ignore_errors=True)

    t_train = time.perf_counter()
    run(drafter, opt, sched, step, on_step)
    bar.close()
    return drafter, history, time.perf_counter() - t_train


def train(cfg: DrafterTrainConfig, *, progress: bool = True,
          log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run `reclaim drafter train` per cfg; returns a summary (steps, last record, held-out tau,
    seconds). The final drafter is in cfg.output_dir (config.json + model.safetensors)."""
    if cfg.drafter_type != "eagle":
        raise ValueError(f"drafter_type {cfg.drafter_type!r} trains with reclaim.rl.eagle3_trainer.train_eagle3; "
                         "this trains 'eagle' (EAGLE-1/2)")
    t_start = time.perf_counter()
    out, target, tokenizer = _start(cfg)
    train_samples, held_out = _rollouts(cfg, target, tokenizer, out, log)
    buffer = DrafterBuffer(cfg.buffer_tokens)
    buffer.add(train_samples)

    def run(drafter, opt, sched, step, on_step):
        train_drafter(drafter, target, buffer, steps=cfg.max_steps - step, optimizer=opt, scheduler=sched,
                      batch_size=cfg.per_device_train_batch_size, batch_tokens=cfg.max_batch_tokens,
                      feature_noise=cfg.feature_noise, reg_weight=cfg.reg_loss_weight,
                      ce_weight=cfg.ce_loss_weight, max_grad_norm=cfg.max_grad_norm, seed=cfg.seed,
                      ce_vocab=buffer.vocab() if cfg.ce_vocab == "buffer" else None,
                      unroll_steps=cfg.unroll_steps, bf16=cfg.bf16,
                      start_step=step, on_step=on_step)

    drafter, history, train_s = fit(cfg, out, new=lambda: new_drafter(target), load=lambda p: load_drafter(p, target),
                                    save=save_drafter, run=run, progress=progress,
                                    keys=("loss", "reg_loss", "ce_loss", "accuracy", "grad_norm", "step_s"))
    _place_final(drafter, out)
    summary: dict[str, Any] = {"steps": cfg.max_steps, "train_s": train_s,
                               "last": history[-1] if history else None,
                               "train_sequences": len(buffer), "train_tokens": buffer.num_tokens}
    if held_out:
        summary["eval"] = {"prompts": len(held_out), "num_speculative_tokens": cfg.num_speculative_tokens,
                           **greedy_acceptance(drafter, target, held_out, cfg.num_speculative_tokens)}
    if cfg.draft_vocab_size:
        drafter.draft_ids = most_frequent([s.token_ids.tolist() for s in buffer], cfg.draft_vocab_size,
                                          target.config.vocab_size).to(next(drafter.parameters()).device)
        _place_final(drafter, out)
        summary["draft_vocab_size"] = int(drafter.draft_ids.numel())
    summary["total_s"] = time.perf_counter() - t_start
    (out / "eval.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# ---- the bundled model's drafter ---------------------------------------------------------------

DEFAULT_DRAFTER_CONFIG = "drafter-smollm2"
TRAIN_INFO = "train_info.json"


def default_drafter_path() -> Path:
    """Where the bundled model's drafter is cached (it may not be there yet)."""
    from reclaim.models.loading import default_model_dir

    return cache_root() / "drafters" / default_model_dir().name


def default_drafter_dir(log: Callable[[str], None] = print, progress: bool = True) -> Path:
    """The bundled model's EAGLE drafter, `$RECLAIM_CACHE/drafters/<model>`: trained on first use
    with the bundled drafter-smollm2 config (its train_info.json says how long that took and the
    held-out tau), found there afterwards."""
    import tempfile

    from reclaim.config import load_config
    from reclaim.models.loading import default_model_dir
    from reclaim.storage import build_once

    model_dir = default_model_dir()
    where = default_drafter_path()

    def build(out: Path) -> None:
        log(f"training an EAGLE drafter for {model_dir.name} on first use ({DEFAULT_DRAFTER_CONFIG}); "
            f"it is cached in {where}")
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            cfg = load_config(DrafterTrainConfig, DEFAULT_DRAFTER_CONFIG,
                              {"model": str(model_dir), "output_dir": tmp, "save_steps": 0})
            summary = train(cfg, progress=progress, log=log)
            for name in sorted(os.listdir(tmp), key=lambda n: n == "config.json"):
                if name in ("config.json", "model.safetensors", "log.jsonl"):
                    shutil.copy2(Path(tmp) / name, out / name)
        (out / TRAIN_INFO).write_text(json.dumps({**summary, "config": DEFAULT_DRAFTER_CONFIG}, indent=2) + "\n")
        ev = summary.get("eval", {})
        log(f"drafter trained in {summary['total_s']:.0f} s (held-out greedy tau {ev.get('tau', float('nan')):.2f})")

    return build_once(where, build)
