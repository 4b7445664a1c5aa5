"""`reclaim plan`: a GRPO run's memory per rank, from the model's config.json alone (no weights).

The model is built on the meta device and sharded by the arithmetic of reclaim/fsdp.py
(`shard_bytes`: FSDP2's dim-0 chunks; the first ranks hold the most, so rank 0 is the worst), or
replicated under DDP. Per rank:

- parameters, gradients (same dtype) and AdamW's two moments (same dtype): sharded under fsdp;
- the reference model (beta > 0): parameters only, sharded under fsdp;
- the rollout engine's weights: the full model in `dtype` on every rank (each rank rolls out its
  share; rollouts keep the training dtype);
- the KV cache: the engine's `kv_cache_bytes` budget (it must hold one sequence at the run's full
  length, which the plan checks);
- activations of one training micro-batch of `per_device_train_batch_size` completions, each
  behind its prompt (an upper bound: GRPO packs a prompt once for its completions). T tokens, h
  hidden, I intermediate, kv the K/V width, L layers, b the compute dtype's bytes (2 under bf16):
  without gradient checkpointing L * T * (7h + 2kv + 4I) * b (the tensors a Llama layer keeps
  for its backward); with it L * T * h * b (each layer's input) plus one layer's full set; plus
  the logits at the completion positions, C * vocab * (b + 4) (the logits and their float32
  log-softmax).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MODELS_DIR = Path(__file__).parent / "configs" / "models"
GB = 1e9


def model_config_path(name_or_path: str) -> Path:
    """An HF config.json: a path (a file or a model directory) or a bundled shape by name."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        return p
    bundled = MODELS_DIR / f"{name_or_path}.json"
    if bundled.is_file():
        return bundled
    names = sorted(f.stem for f in MODELS_DIR.glob("*.json"))
    raise ValueError(f"model config {name_or_path!r} is neither a config.json (or a directory with one) nor a "
                     f"bundled shape; bundled: {names}")


@dataclass
class Plan:
    """Bytes per rank of one GRPO run at a world size and parallelism."""

    parallelism: str
    world_size: int
    num_parameters: int
    rows: dict[str, int]  # what -> bytes on the worst rank
    min_kv_bytes: int  # one sequence at the run's full length

    @property
    def total(self) -> int:
        return sum(self.rows.values())

    def fits(self, device_memory: int | None) -> bool | None:
        return None if device_memory is None else self.total <= device_memory

    def to_dict(self, device_memory: int | None) -> dict[str, Any]:
        return {"parallelism": self.parallelism, "world_size": self.world_size,
                "num_parameters": self.num_parameters, "per_rank_bytes": self.rows, "total_bytes": self.total,
                "min_kv_bytes": self.min_kv_bytes, "device_memory_bytes": device_memory,
                "fits": self.fits(device_memory)}


def meta_model(config_json: Path) -> torch.nn.Module:
    """The model of an HF config.json on the meta device (shapes only)."""
    from reclaim.models.llama import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_hf(json.loads(config_json.read_text()))
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def plan(cfg: Any, config_json: Path, world_size: int, parallelism: str) -> Plan:
    """The per-rank bytes of GRPOConfig `cfg` on the model of `config_json` (see the module doc)."""
    from reclaim.fsdp import PARALLELISMS, decoder_layers, shard_bytes

    if world_size < 1:
        raise ValueError(f"world size {world_size}: need >= 1")
    if parallelism not in PARALLELISMS:
        raise ValueError(f"parallelism {parallelism!r} is not one of {list(PARALLELISMS)}")
    model = meta_model(config_json)
    decoder_layers(model)  # a model FSDP cannot shard is refused by name
    mc = model.config
    dtype = mc.torch_dtype if cfg.dtype == "auto" else cfg.dtype
    elem = torch.empty(0, dtype=getattr(torch, str(dtype).removeprefix("torch."))).element_size()
    shapes = [(tuple(p.shape), elem) for p in model.parameters()]
    full = shard_bytes(shapes, 1)
    mine = shard_bytes(shapes, world_size, 0) if parallelism == "fsdp" else full
    prompt = cfg.max_prompt_length or 0
    length = prompt + cfg.max_completion_length
    kv_width = mc.num_key_value_heads * mc.head_dim
    kv_token = 2 * mc.num_hidden_layers * kv_width * elem
    engine = cfg.engine_config(length)
    b = 2 if cfg.bf16 else elem
    tokens = cfg.per_device_train_batch_size * length
    h, inter, layers = mc.hidden_size, mc.intermediate_size, mc.num_hidden_layers
    layer_full = tokens * (7 * h + 2 * kv_width + 4 * inter) * b
    acts = layers * tokens * h * b + layer_full if cfg.gradient_checkpointing else layers * layer_full
    logits = cfg.per_device_train_batch_size * cfg.max_completion_length * mc.vocab_size * (b + 4)
    rows = {"parameters": mine, "gradients": mine, "optimizer": 2 * mine,
            "reference_model": mine if cfg.beta > 0 else 0, "rollout_weights": full,
            "kv_cache": engine.kv_cache_bytes, "activations": acts, "logits": logits}
    return Plan(parallelism, world_size, sum(math.prod(s) for s, _ in shapes), rows, length * kv_token)


def report(p: Plan, device_memory: int | None) -> str:
    """The plan as a table in GB (1e9 bytes), with the verdict against device_memory."""
    lines = [f"{p.parallelism} at world size {p.world_size}: {p.num_parameters / 1e9:.2f}B parameters; "
             "per rank (the worst rank):"]
    lines += [f"  {k:<16} {v / GB:9.2f} GB" for k, v in p.rows.items()]
    lines.append(f"  {'total':<16} {p.total / GB:9.2f} GB")
    if p.rows.get("kv_cache", p.min_kv_bytes) < p.min_kv_bytes:  # an ssm-train plan has no engine
        lines.append(f"  the KV budget holds less than one sequence at full length ({p.min_kv_bytes / GB:.2f} GB): "
                     "raise engine.kv_cache_bytes")
    if device_memory is not None:
        room = device_memory - p.total
        verdict = "fits" if room >= 0 else "does not fit"
        lines.append(f"{verdict} in {device_memory / GB:.0f} GB per device ({abs(room) / GB:.2f} GB "
                     f"{'to spare' if room >= 0 else 'over'})")
    return "\n".join(lines)
