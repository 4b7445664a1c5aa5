"""Low-rank adapters for online training: W x + (alpha / r) B A x on chosen projections, with the
base weights frozen. Applied from outside the model; parameter names of the base stay HF's.

    params = apply_lora(model, r=8, alpha=16, target_modules=["q_proj", "v_proj"])
    merged = merged_state_dict(model)   # HF names, adapters folded in: a servable checkpoint
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class LoRALinear(nn.Linear):
    """An nn.Linear (same weight and bias) plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, r: int, alpha: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.scale = alpha / r
        dev, dtype = base.weight.device, base.weight.dtype
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, device=dev, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, device=dev, dtype=dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # peft's init: B = 0, A random

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_A),
                                                              self.lora_B) * self.scale

    def merged_weight(self) -> torch.Tensor:
        return self.weight + self.scale * self.lora_B @ self.lora_A


def apply_lora(model: nn.Module, r: int, alpha: float, target_modules: Sequence[str]
               ) -> list[nn.Parameter]:
    """Freeze `model` and put adapters on every nn.Linear whose name is in target_modules;
    returns the adapter parameters (the only ones that train)."""
    if r < 1:
        raise ValueError(f"lora_r={r}: must be >= 1 (0 means full fine-tuning: do not apply LoRA)")
    for p in model.parameters():
        p.requires_grad_(False)
    found = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in target_modules and isinstance(child, nn.Linear):
                setattr(parent, name, LoRALinear(child, r, alpha))
                found.append(name)
    missing = sorted(set(target_modules) - set(found))
    if missing:
        raise ValueError(f"lora_target_modules {missing} match no nn.Linear in the model; "
                         "Llama-family names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                         "down_proj")
    return [p for n, p in model.named_parameters() if "lora_" in n]


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict under HF names with every adapter folded into its weight."""
    out = {k: v for k, v in model.state_dict().items() if ".lora_" not in k}
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, LoRALinear):
                out[f"{name}.weight"] = m.merged_weight()
    return out


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if ".lora_" in k}
