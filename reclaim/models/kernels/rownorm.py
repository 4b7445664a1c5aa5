"""RMSNorm and RoPE for float32 inference on a CPU through `rownorm.c` (one call instead of 6-8
torch ops each); `None` from either means "not taken here, use torch" (training, other dtypes or
devices, under torch.compile, no compiler, `RECLAIM_SMALL_LINEAR=0`, inside `torch_kernels()`)."""

from __future__ import annotations

import ctypes

import torch

from reclaim.models.kernels import cbuild
from reclaim.models.kernels.linear import cpu_inference

_lib: ctypes.CDLL | None | bool = None


def _load() -> ctypes.CDLL | None:
    global _lib
    if _lib is None:
        lib = cbuild.load("rownorm")
        if lib is not None:
            p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
            lib.rms_norm.argtypes = [p, i64, p, p, i64, i64, i64, ctypes.c_float]
            lib.rope.argtypes = [p, p, p, p, i64, i32, i32]
            lib.rms_norm.restype = lib.rope.restype = None
        _lib = lib or False
    return _lib or None


def _taken(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return not torch.compiler.is_compiling() and cpu_inference(x, weight) and _load() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * x / rms(x) over the last dimension, or None where torch should run it."""
    if not (_taken(x, weight) and x.is_contiguous() and weight.is_contiguous()):
        return None
    n = x.shape[-1]
    y = torch.empty_like(x)
    _load().rms_norm(x.data_ptr(), n, weight.data_ptr(), y.data_ptr(), n, x.numel() // n, n, eps)
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotate-half RoPE of x [N, heads, D] with cos, sin [N, 1, D] (bitwise `apply_rope`), or None
    where torch should run it."""
    if not (_taken(x, cos) and x.dim() == 3 and x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
            and cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2])):
        return None
    out = torch.empty_like(x)
    _load().rope(out.data_ptr(), x.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0], x.shape[1], x.shape[2])
    return out
