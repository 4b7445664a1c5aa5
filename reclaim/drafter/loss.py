"""The EAGLE drafter's loss and training steps on the target's own hidden states (TLT / EAGLE).

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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from reclaim.drafter.data import DrafterBuffer, DrafterSample, mix_seed
from reclaim.models.drafter import EagleDrafter
from reclaim.optim import adamw

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
            noise = torch.rand(feats.shape, generator=generator, dtype=torch.float32,
                               device=feats.device if generator is None else generator.device)
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
            noise = torch.Generator().manual_seed(mix_seed(seed, step, 1))
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
