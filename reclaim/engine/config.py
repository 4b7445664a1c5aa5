"""One engine config: how big the engine is and how it decodes (vLLM's EngineArgs, by its names).

`Engine(model, tokenizer, EngineConfig(...))` builds from it (keyword fields override it),
`reclaim serve` generates its engine options from these fields (`--max-num-seqs`, ...; a field's
help is its `help` metadata) and reads them from a YAML file with `--engine-config` through
`load_config`, and the benchmarks and GRPO build their engines from one. Each field is checked
here, with the value and what is allowed named.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30
DEFAULT_KV_CACHE_BYTES = GIB
# What happens to running requests' cached K/V when weights change: recompute it with the new
# weights (exact: no token is conditioned on old-weights K/V), or keep it (cheaper, mixes versions).
KV_ON_WEIGHT_UPDATE = ("recompute", "keep")
HEAD_KERNELS = ("auto", "linear")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class EngineConfig:
    """The engine's size and decoding; None takes the model's (or the engine's) own value."""

    max_num_seqs: int = _opt(64, "Most sequences in the running batch.")
    max_num_batched_tokens: int = _opt(2048, "Most tokens per engine step (decodes first, then prefill "
                                       "chunks in what is left).")
    max_model_len: int | None = _opt(None, "Context length (default: the model's).")
    num_blocks: int | None = _opt(None, "KV-cache blocks (default: sized from the KV cache budget).")
    block_size: int = _opt(16, "Tokens per KV-cache block.")
    # the flag takes GiB (as --kv-cache-memory of generate and chat); the field is bytes
    kv_cache_bytes: int = _opt(DEFAULT_KV_CACHE_BYTES, "KV cache budget in GiB (default 1); it must hold one "
                               "max-model-len sequence, and weights plus it must fit the device.",
                               flag="--kv-cache-memory", flag_type=float, from_flag=lambda gib: int(gib * GIB))
    device: str | None = _opt(None, "Torch device: auto (CUDA when there is one, else cpu), cpu, cuda or "
                              "cuda:N (default: the model's; serve: auto).")
    dtype: str = _opt("auto", "Weights and KV cache: auto (float32 on a CPU, the checkpoint's bfloat16 or "
                      "float16 on CUDA), float32, bfloat16 or float16 (the weights are loaded in it; an "
                      "engine over a loaded model uses the model's).")
    gpu_memory_utilization: float | None = _opt(None, "CUDA: the share of the GPU's memory weights and KV "
                                                "cache may take (vLLM's; 0.9 when no KV cache memory is given); "
                                                "the KV cache gets what the weights leave.")
    seed: int = _opt(0, "Seed of the generator unseeded requests draw from.")
    head: str = _opt("auto", "LM-head kernel: auto (reclaim's on CPU float32) or linear (F.linear).")
    kv_on_weight_update: str = _opt("recompute", "Running requests' cached K/V after a weight update: "
                                    "recompute (exact) or keep.")
    compile: bool = _opt(False, "torch.compile the decode forward (one graph for every batch size; on CUDA "
                         "with CUDA graphs, mode reduce-overhead); a compile failure runs eagerly with a warning.")
    tensor_parallel_size: int = _opt(1, "Ranks the model's attention and MLP heads, K/V cache and LM head are "
                                     "split over (tensor parallel; above 1 under torchrun, one process per rank).")
    speculative: Any = _opt(None, "A SpeculativeConfig, or None for plain decoding.", cli=False)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_bytes", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}; allowed: an integer >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks={self.num_blocks!r}; allowed: an integer >= 1, or None (sized by the engine)")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r}; allowed: a share of the "
                             "GPU's memory in (0, 1]")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len!r}; allowed: an integer >= 2, or None (the model's)")
        for name, allowed in (("dtype", DTYPES), ("head", HEAD_KERNELS),
                              ("kv_on_weight_update", KV_ON_WEIGHT_UPDATE)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}; allowed: {list(allowed)}")

    def replace(self, **fields: Any) -> "EngineConfig":
        """A copy with `fields` changed; an unknown name is refused, the allowed ones listed."""
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"unknown engine field(s) {unknown}; allowed: {[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **fields)


def cli_fields() -> list[dataclasses.Field]:
    """The fields `serve` offers as options (all but those marked cli=False)."""
    return [f for f in dataclasses.fields(EngineConfig) if f.metadata.get("cli", True)]


def file_fields(path: str | None) -> dict[str, Any]:
    """The fields an engine-config YAML file (`--engine-config` of the benches) sets, each checked
    by name and value through load_config; {} for no file. A bench lays them over its own engine
    defaults, and its per-point fields (batch size, speculative method, kernel) over them."""
    if path is None:
        return {}
    import yaml

    from reclaim.config import load_config, read_config_text

    cfg = load_config(EngineConfig, path)
    names = list(yaml.safe_load(read_config_text(path)[1]) or {})
    allowed = [f.name for f in cli_fields()]
    for name in names:
        if name not in allowed:  # speculative: a bench sets it from its own options
            raise ValueError(f"{name} is not set in {path} (the bench's options set it); allowed: {allowed}")
    return {name: getattr(cfg, name) for name in names}
