"""RMSNorm, shared by every model family."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
        if x.dtype == dtype == torch.float32:  # one fused op (the same sums, a third less time a call)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.to(torch.promote_types(x.dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
