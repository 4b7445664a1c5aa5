"""RMSNorm, shared by every model family."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from reclaim.models.kernels import rownorm


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 at least and returned in the weight's dtype.

    Same as transformers' LlamaRMSNorm / MambaRMSNorm when input and weight share a dtype; Mamba
    feeds a float32 residual into bf16 weights, and the next projection needs the weight's dtype.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.weight.dtype
        y = rownorm.rms_norm(x, self.weight, self.eps)  # float32 inference on a CPU: one C call
        if y is not None:
            return y
        if x.dtype == dtype == torch.float32:  # one fused op (the same sums, a third less time a call)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.to(torch.promote_types(x.dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm of x * silu(gate), taken over groups of `group_size` channels (Mamba-2's gated norm,
    transformers' MambaRMSNormGated with the gate applied before the norm)."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        if group_size < 1 or dim % group_size:
            raise ValueError(f"the norm's group size ({group_size}) must divide its width ({dim})")
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = group_size, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        x = x.to(dtype) * F.silu(gate.to(dtype))
        g = x.unflatten(-1, (-1, self.group_size))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.flatten(-2).to(self.weight.dtype)
