"""GRPO's loss, as TRL's GRPOTrainer computes it: group-relative advantages and the clipped
token-level ratio loss with an optional k3 KL to a reference."""

from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")


def group_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                     scale_rewards: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's sum_then_normalize: (advantages, rewards, std) for rewards [N, F] in groups of
    num_generations consecutive rows. A row every function left None gets advantage 0 and is
    left out of its group's mean and std."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights[None]).nansum(dim=1)
    rewards[unscorable] = torch.nan
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    adv = rewards - mean
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), rewards, std


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sample std (Bessel) ignoring NaNs, as TRL's nanstd."""
    mean = torch.nanmean(x, dim=dim, keepdim=dim is not None)
    var = torch.nanmean((x - mean) ** 2, dim=dim)
    count = (~torch.isnan(x)).sum(dim=dim) if dim is not None else (~torch.isnan(x)).sum()
    return (var * count / (count - 1)).sqrt()


def grpo_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, loss_type: str,
              epsilon_low: float, epsilon_high: float, beta: float = 0.0, old_logps: torch.Tensor | None = None,
              ref_logps: torch.Tensor | None = None, use_bias_correction_kl: bool = True,
              max_completion_length: int | None = None, num_items_in_batch: float | None = None,
              gradient_accumulation_steps: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's loss, as TRL's GRPOTrainer computes it (token-level importance ratio).

    logps, old_logps, ref_logps, mask: [B, C]; advantages [B]. old_logps None: the ratio is 1
    (num_iterations = 1). With beta > 0 each token adds beta * k3 KL to the reference,
    exp(ref - logp) - (ref - logp) - 1, times the ratio if use_bias_correction_kl. The loss is
    already divided for gradient accumulation: summed over the step's micro-batches it is the
    step's loss. grpo: mean over sequences of each one's token mean; bnpo: the micro-batch's token
    mean; dr_grpo: token sum / (B * max_completion_length); dapo: token sum / num_items_in_batch,
    the completion tokens of the whole step. Also returns masked sums for metrics: kl,
    low/high/region clipping, and the token count."""
    adv = advantages[:, None]
    old = logps.detach() if old_logps is None else old_logps
    coef_1 = torch.exp(logps - old)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps (the reference model's log-probs)")
        per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
        per_token = per_token + beta * per_token_kl
    masked = per_token * mask
    if loss_type == "grpo":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / gradient_accumulation_steps
    elif loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0) / gradient_accumulation_steps
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type 'dr_grpo' needs max_completion_length")
        loss = masked.sum() / (per_token.size(0) * max_completion_length) / gradient_accumulation_steps
    elif loss_type == "dapo":
        if num_items_in_batch is None:
            raise ValueError("loss_type 'dapo' needs num_items_in_batch (completion tokens of the step)")
        loss = masked.sum() / max(float(num_items_in_batch), 1.0)
    else:
        raise ValueError(f"loss_type {loss_type!r} is not one of {list(LOSS_TYPES)}")
    with torch.no_grad():
        low = ((coef_1 < 1 - epsilon_low) & (adv < 0)).float()
        high = ((coef_1 > 1 + epsilon_high) & (adv > 0)).float()
        sums = {"tokens": mask.sum(), "clip_low": (low * mask).sum(), "clip_high": (high * mask).sum(),
                "clip_region": (((low + high) > 0).float() * mask).sum()}
        if beta != 0.0:
            sums["kl"] = (per_token_kl * mask).sum()
    return loss, sums
