"""Tiny random Llama-family models (all four families) and random prompt/response token ids."""

from __future__ import annotations

import torch

from reclaim.models.llama import LlamaConfig, LlamaForCausalLM

TINY = dict(
    model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=1,
)
# Mistral with a window shorter than the samples, so the window's masks are exercised
FAMILIES = {"llama": {}, "mistral": {"sliding_window": 6}, "qwen2": {}, "qwen3": {}}


def tiny_model(family: str = "llama", seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A tiny random model of `family`, float32, parameters requiring grad."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY, "model_type": family, **FAMILIES[family], **overrides})
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper logits than nn.Linear's default init
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model


def token_lists(lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, TINY["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def grads(model) -> torch.Tensor:
    """Every trainable parameter's gradient, flattened into one vector."""
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())
