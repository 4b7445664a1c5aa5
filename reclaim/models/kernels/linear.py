"""Linear layers that decode fast on a CPU: `small_linear.c` for a few rows, torch otherwise.

`Linear` is an `nn.Linear` (same parameters, same state dict, autograd as before) whose forward
sends inference over at most `SMALL_ROWS` rows of float32 on a CPU to the C kernel: a decode step,
a speculative verify row, a drafter step. The kernel reads a packed copy of each weight (panels of
48 output columns, `packed`), made on the weight's first few-row product and made again after the
weight changes: its storage, its version counter (every in-place op moves it, `copy_` included),
or any torch optimizer's step over it (a fused AdamW does not move the counter). It doubles the
memory of the weights a CPU decodes with; `forget_packed` drops it. A write the counter does not
see (`weight.data.copy_(...)`) must call `forget_packed` itself.

Float32 inference over more rows on a CPU (a prefill, a batch's verify rows together) runs oneDNN's
matmul, about twice MKL's sgemm there with one thread. Anything else (training, other dtypes and
devices) runs `F.linear` as before.

The kernel is compiled on first use (cbuild.py). Without a compiler, on another OS, or with
`RECLAIM_SMALL_LINEAR=0`, few rows run `F.linear`; `status()` says which and why.
`RECLAIM_SMALL_LINEAR=0` turns oneDNN off too. Inside `torch_kernels()` this thread runs `F.linear`
everywhere (a baseline on transformers' kernels).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from reclaim.models.kernels import cbuild

# Rows up to which the kernel beats MKL and oneDNN on SmolLM2's shapes (measured by
# `reclaim bench engine`: benchmarks/engine.md).
SMALL_ROWS = 16
_lib: ctypes.CDLL | None = None
_why_not: str | None = None  # set once loading failed or was switched off
_local = threading.local()  # .off: depth of torch_kernels() on this thread


def _load() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use; None where it cannot be had."""
    global _lib, _why_not
    if _lib is not None or _why_not is not None:
        return _lib
    lib = cbuild.load("small_linear")
    if lib is None:
        _why_not = cbuild.why_not("small_linear")
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_long
    lib.small_linear.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, ctypes.c_int]
    lib.pack_weights.argtypes = [p, p, i64, i64, ctypes.c_int]
    lib.small_linear.restype = lib.pack_weights.restype = None
    _lib = lib
    return lib


def status() -> str:
    """'on', or why the kernel is not used."""
    return "on" if _load() is not None else f"off: {_why_not}"


@contextmanager
def torch_kernels() -> Iterator[None]:
    """Run F.linear everywhere on this thread inside (the kernels transformers runs)."""
    _local.off = getattr(_local, "off", 0) + 1
    try:
        yield
    finally:
        _local.off -= 1


def cpu_inference(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Float32 on a CPU, no gradient wanted, no autocast, outside `torch_kernels()`."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.numel() > 0
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and not torch.is_autocast_enabled("cpu")  # autocast asks for its own dtype
        and not getattr(_local, "off", 0)
    )


def _few_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Few enough rows for the kernel, and a weight whose changes can be seen (an inference tensor,
    made under torch.inference_mode, has no version counter: its packed copy could go stale)."""
    return x.numel() <= SMALL_ROWS * x.shape[-1] and not weight.is_inference() and _load() is not None


# oneDNN where torch has it, unless RECLAIM_SMALL_LINEAR=0 turns reclaim's kernel choice off.
_ONEDNN = torch.backends.mkldnn.is_available() and os.environ.get("RECLAIM_SMALL_LINEAR", "1") != "0"


def eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `small_linear` would take this product: float32 inference on a CPU over at most
    SMALL_ROWS rows."""
    return cpu_inference(x, weight) and _few_rows(x, weight)


def onednn_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` sends this product to oneDNN: float32 inference on a CPU that `small_linear`
    does not take, where torch has oneDNN and RECLAIM_SMALL_LINEAR is not 0."""
    return _ONEDNN and cpu_inference(x, weight) and not _few_rows(x, weight)


PANEL = 48  # output columns per panel of the packed weights (small_linear.c's P)


def packed(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] packed for the kernel ([ceil(N / 48), K, 48], zeros past N), cached on the
    tensor and packed again once its storage or version changed."""
    key = (weight.data_ptr(), weight._version, tuple(weight.shape))
    have = getattr(weight, "_reclaim_packed", None)
    if have is not None and have[0] == key:
        return have[1]
    n, k = weight.shape
    w = weight.detach().contiguous()
    wp = torch.empty((n + PANEL - 1) // PANEL, k, PANEL, dtype=torch.float32)
    _load().pack_weights(w.data_ptr(), wp.data_ptr(), n, k, torch.get_num_threads())
    weight._reclaim_packed = (key, wp)
    return wp


def forget_packed(weights: Iterable[torch.Tensor]) -> int:
    """Drop the packed copies of `weights` (the next product packs again); returns the bytes freed."""
    freed = 0
    for w in weights:
        have = w.__dict__.pop("_reclaim_packed", None)
        freed += 0 if have is None else have[1].nbytes
    return freed


def _stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After any optimizer's step: its parameters' packed copies are stale. A fused AdamW (what
    reclaim's trainers run) writes the weights without moving their version counters."""
    forget_packed(p for group in optimizer.param_groups for p in group["params"])


register_optimizer_step_post_hook(_stepped)


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias through the kernel (call `eligible` first); x [..., K], weight [N, K]."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the small_linear kernel is {status()}")
    # Called ~200 times a decode step: no reshapes, a copy only for inputs that are not dense.
    k, n = x.shape[-1], weight.shape[0]
    x = x if x.is_contiguous() else x.contiguous()
    b = None if bias is None else bias.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    lib.small_linear(x.data_ptr(), k, packed(weight).data_ptr(), None if b is None else b.data_ptr(),
                     y.data_ptr(), n, x.numel() // k, n, k, torch.get_num_threads())
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through `small_linear` or oneDNN where they are eligible (checked once: this
    runs for every layer's product). Under torch.compile, float32 CPU inference is one opaque
    op (`reclaim::cpu_linear`) that chooses at run time, so the graph does not depend on the
    row count."""
    if torch.compiler.is_compiling():
        if (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and not torch.is_grad_enabled()
                and (_ONEDNN or _load() is not None)):
            return torch.ops.reclaim.cpu_linear(x, weight, bias)
        return F.linear(x, weight, bias)
    if cpu_inference(x, weight):
        if _few_rows(x, weight):
            return small_linear(x, weight, bias)
        if _ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@torch.library.custom_op("reclaim::cpu_linear", mutates_args=())
def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear`'s float32 CPU inference as one op for compiled graphs: the few-row kernel,
    oneDNN or F.linear by the row count at run time."""
    if _few_rows(x, weight):
        return small_linear(x, weight, bias)
    if _ONEDNN:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@cpu_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear that runs float32 inference on a CPU through `small_linear` (few rows) or oneDNN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def reset_parameters(self) -> None:
        """No random init of a meta weight (a shape a checkpoint fills, models/loading.py): there
        init runs torch's Python decompositions, whose first call imports torch._dynamo (1.4 s of
        every `reclaim generate` and server start)."""
        if not self.weight.is_meta:
            super().reset_parameters()
