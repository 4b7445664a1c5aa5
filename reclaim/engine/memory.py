"""Will a model fit? Its weight and KV-cache bytes against the device's free memory, checked from
config.json and the safetensors headers before any weight is read."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from reclaim.engine.kv_cache import GIB, KVPool, plan_kv_blocks
from reclaim.models.llama_config import LlamaConfig
from reclaim.models.loading import IGNORED_KEY, SafetensorsSource


def weight_bytes(path: Path, dtype: torch.dtype) -> int:
    """Bytes the weights at `path` take once loaded in `dtype` (every tensor is cast), from the
    safetensors headers alone."""
    source = SafetensorsSource(path)  # reads headers only
    return dtype.itemsize * sum(math.prod(source.shape(k)) for k in source if not IGNORED_KEY.search(k))


def free_memory(device: torch.device | str) -> int | None:
    """Free bytes on `device`: CUDA's free memory, or on the CPU the RAM available to this process
    (MemAvailable, capped by a cgroup limit); None for device types it cannot tell."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:  # MemAvailable counts reclaimable page cache, which MemFree does not
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            free = min(free, int(limit) - used)
    except (OSError, ValueError):
        pass
    return free


@dataclass
class MemoryPlan:
    """What loading a model for the engine will take, and what the device has."""

    weight_bytes: int
    kv_bytes: int
    num_blocks: int
    free_bytes: int | None  # None: not known for this device type, not checked


def check_fits(
    path: Path, cfg: LlamaConfig, *, dtype: torch.dtype, device: torch.device | str,
    kv_cache_bytes: int, block_size: int, max_model_len: int, max_num_seqs: int,
) -> MemoryPlan:
    """The memory plan for serving the model at `path`; raises ValueError before anything loads
    when the KV budget cannot hold one `max_model_len` sequence or weights plus KV cache exceed
    the device's free memory."""
    num_blocks = plan_kv_blocks(cfg, kv_cache_bytes=kv_cache_bytes, block_size=block_size,
                                max_model_len=max_model_len, max_num_seqs=max_num_seqs, dtype=dtype)
    per_token = KVPool.bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype)
    plan = MemoryPlan(weight_bytes(path, dtype), num_blocks * block_size * per_token, num_blocks,
                      free_memory(device))
    if plan.free_bytes is not None and plan.weight_bytes + plan.kv_bytes > plan.free_bytes:
        min_kv = -(-max_model_len // block_size) * block_size * per_token
        if plan.weight_bytes + min_kv <= plan.free_bytes:
            hint = f"lower the KV cache memory to at most {(plan.free_bytes - plan.weight_bytes) / GIB:.3g} GiB"
        else:
            hint = "use a smaller dtype, a shorter max_model_len, or a device with more memory"
        raise ValueError(
            f"{path} does not fit on {torch.device(device)}: weights {plan.weight_bytes / GIB:.3g} GiB "
            f"({str(dtype).removeprefix('torch.')}) + KV cache {plan.kv_bytes / GIB:.3g} "
            f"GiB ({num_blocks} blocks of {block_size} tokens) need "
            f"{(plan.weight_bytes + plan.kv_bytes) / GIB:.3g} GiB, but only "
            f"{plan.free_bytes / GIB:.3g} GiB is free; {hint}"
        )
    return plan

