"""Where inference runs: `--device` resolved and checked, the dtype each device gets by default,
and the KV cache a GPU's memory share holds (vLLM's --gpu-memory-utilization).

'auto' is CUDA when there is one, else the CPU. The default dtype ('auto') is float32 on a CPU
and the checkpoint's own on CUDA (its config.json torch_dtype; bfloat16 when that is float32 or
unknown: float32 wastes half a GPU's bandwidth and its tensor cores). On CUDA, float32 matrix
products may use TF32 (`prepare`), as vLLM and transformers' users get by default.
"""

from __future__ import annotations

import torch

GIB = 1 << 30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
# Kept free beside weights and KV cache for activations, logits and the allocator's slack.
ACTIVATION_RESERVE = GIB


def available() -> list[str]:
    """The devices this machine offers: cpu, then each CUDA device."""
    return ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def resolve_device(name: str | torch.device | None) -> torch.device:
    """The device `name` means ('auto' or None: CUDA when there is one, else the CPU); ValueError,
    naming it and what this machine has, for a device that does not exist here."""
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {name!r} is not a device; available here: {', '.join(available())} "
                         "(or auto)") from e
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device {name!r}: the engine runs on cpu or cuda; available here: "
                         f"{', '.join(available())} (or auto)")
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: CUDA is not available (torch {torch.__version__}, "
                         f"{'a CPU-only build' if torch.version.cuda is None else 'no GPU visible'}); "
                         f"available here: {', '.join(available())}")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                         f"available here: {', '.join(available())}")
    return device


def resolve_dtype(dtype: str | None, device: torch.device, checkpoint_dtype: str | None = None) -> str:
    """The dtype name the engine loads weights and KV cache in: `dtype` as given, or for 'auto'
    (None) float32 on a CPU and the checkpoint's half precision on CUDA."""
    if dtype not in (None, "auto"):
        return dtype
    if device.type == "cpu":
        return "float32"
    return checkpoint_dtype if checkpoint_dtype in ("bfloat16", "float16") else "bfloat16"


def prepare(device: torch.device) -> None:
    """Settings an inference device wants: TF32 for float32 products on CUDA."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def check_utilization(value: float | None) -> None:
    """Refuse a --gpu-memory-utilization outside (0, 1], by name."""
    if value is not None and not (isinstance(value, (int, float)) and 0 < value <= 1):
        raise ValueError(f"gpu_memory_utilization={value!r}; allowed: a share of the GPU's memory in (0, 1]")


def kv_budget(device: torch.device, utilization: float, weight_bytes: int) -> int:
    """KV cache bytes when weights and cache together may take `utilization` of the GPU's
    memory: that share of its total, less what other processes hold now, the weights and
    ACTIVATION_RESERVE. ValueError when nothing is left for the cache."""
    check_utilization(utilization)
    free, total = torch.cuda.mem_get_info(device)
    budget = int(utilization * total) - (total - free) - weight_bytes - ACTIVATION_RESERVE
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} of {device}'s {total / GIB:.3g} GiB leaves no room for "
            f"a KV cache: other processes hold {(total - free) / GIB:.3g} GiB, the weights need "
            f"{weight_bytes / GIB:.3g} GiB and activations {ACTIVATION_RESERVE / GIB:.3g} GiB; raise it, or "
            "give --kv-cache-memory")
    return budget
