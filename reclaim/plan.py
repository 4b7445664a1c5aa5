"""`reclaim plan`: a GRPO run's memory per rank, from the model's config.json alone (no weights).

The model is built on the meta device and sharded by the arithmetic of reclaim/fsdp.py
(`shard_bytes`: FSDP2's dim-0 chunks; the first ranks hold the most, so rank 0 is the worst), or
replicated under DDP. What a rank holds (rows, bytes):

- parameters, gradients (same dtype) and AdamW's two moments (same dtype): sharded under fsdp,
  in host memory (0 on the device) with fsdp_cpu_offload;
- the reference model (beta > 0): parameters only, sharded under fsdp;
- the rollout engine's weights: the model in `rollout_dtype` (bfloat16 by default), this rank's
  tensor-parallel shard with `rollout_tensor_parallel_size` N (Megatron's split: q/k/v, gate and
  up by output rows, o and down by input columns, embeddings and LM head by vocabulary rows; norms
  whole), and on rank 0 with an EAGLE drafter at N > 1 the whole embedding and head it drafts with;
- the KV cache: the blocks the engine takes from `kv_cache_bytes` (at most max_num_seqs
  sequences at full length) at the rollout dtype and this rank's 1/N of the K/V heads;
- activations of one training micro-batch of `per_device_train_batch_size` completions, each
  behind its prompt (an upper bound: GRPO packs a prompt once for its completions). T tokens, h
  hidden, I intermediate, kv the K/V width, L layers, b the compute dtype's bytes (2 under bf16):
  without gradient checkpointing L * T * (7h + 2kv + 4I) * b (the tensors a Llama layer keeps
  for its backward); with it L * T * h * b (each layer's input) plus one layer's full set;
- logits: one chunk of `logits_chunk_size` completion positions (rl/logps.py), 16 bytes per
  position and vocabulary entry: four float32 [chunk, vocabulary] tensors alive at once (the
  logits, scaled, their log-softmax, a gradient; measured by tests/test_plan.py);
- gathered: under fsdp, the weights FSDP2 all-gathers in the compute dtype: the root's
  (embeddings, final norm, head: kept from forward to backward) and two decoder layers (the
  running one and the next, prefetched).

A rank does not hold all of it at once. The plan's total is the largest of four phases:
rollout (parameters, optimizer, reference model, rollout weights, KV cache; gradients are freed),
training (everything but with optimizer_offload the moments), the optimizer step (no
activations, logits or gathered weights), and the weight update into the engine (gradients
freed). With enable_sleep_mode the engine sleeps through training and the optimizer step
(Engine.sleep(level=2)): its weights and KV pool are freed then, and come back for the weight
update (when the gradients and activations are gone). param_offload and optimizer_offload
(rl/offload.py) take the parameters and the moments off the device while rolling out, at the price of moving
them out and back each rollout, timed at HOST_BANDWIDTH.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
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


HOST_BANDWIDTH = 25e9  # bytes/s each way between host and device memory (PCIe 4.0 x16, pinned)
PHASES = {
    "rollout": ("parameters", "optimizer", "reference_model", "rollout_weights", "kv_cache"),
    "training": ("parameters", "gradients", "optimizer", "reference_model", "rollout_weights", "kv_cache",
                 "activations", "logits", "gathered"),
    "optimizer_step": ("parameters", "gradients", "optimizer", "reference_model", "rollout_weights", "kv_cache"),
    "weight_update": ("parameters", "optimizer", "reference_model", "rollout_weights", "kv_cache"),
}


@dataclass
class Plan:
    """Bytes per rank of one GRPO run at a world size and parallelism."""

    parallelism: str
    world_size: int
    num_parameters: int
    rows: dict[str, int]  # what -> bytes on the worst rank
    min_kv_bytes: int  # one sequence at the run's full length
    off_device: dict[str, tuple[str, ...]] = field(default_factory=dict)  # phase -> rows in host memory then
    asleep: dict[str, tuple[str, ...]] = field(default_factory=dict)  # phase -> rows freed then (sleep mode)
    offload_bytes: int = 0  # moved to host memory and back, each way, per rollout
    rollout: dict[str, Any] = field(default_factory=dict)  # dtype, tensor_parallel_size, logits_chunk_size

    def phase(self, name: str) -> int:
        """Bytes on the device during phase `name` (one of PHASES)."""
        gone = (*self.off_device.get(name, ()), *self.asleep.get(name, ()))
        return sum(self.rows[k] for k in PHASES[name] if k not in gone)

    @property
    def phases(self) -> dict[str, int]:
        """GRPO's phases (an ssm-train plan, which has no rollout, has none)."""
        return {name: self.phase(name) for name in PHASES} if self.rollout else {}

    @property
    def total(self) -> int:
        """The peak: the largest phase (an ssm-train plan: everything at once)."""
        return max(self.phases.values()) if self.rollout else sum(self.rows.values())

    @property
    def offload_seconds(self) -> float:
        return 2 * self.offload_bytes / HOST_BANDWIDTH

    def fits(self, device_memory: int | None) -> bool | None:
        return None if device_memory is None else self.total <= device_memory

    def to_dict(self, device_memory: int | None) -> dict[str, Any]:
        return {"parallelism": self.parallelism, "world_size": self.world_size,
                "num_parameters": self.num_parameters, "per_rank_bytes": self.rows,
                "phase_bytes": self.phases, "off_device": {k: list(v) for k, v in self.off_device.items()},
                "asleep": {k: list(v) for k, v in self.asleep.items()},
                "total_bytes": self.total, "rollout": self.rollout,
                "offload_bytes_each_way": self.offload_bytes, "offload_seconds": self.offload_seconds,
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
    from reclaim.engine.kv_cache import KVPool, plan_kv_blocks
    from reclaim.fsdp import PARALLELISMS, decoder_layers, shard_bytes
    from reclaim.models.tensor_parallel import check_tensor_parallel

    if world_size < 1:
        raise ValueError(f"world size {world_size}: need >= 1")
    if parallelism not in PARALLELISMS:
        raise ValueError(f"parallelism {parallelism!r} is not one of {list(PARALLELISMS)}")
    model = meta_model(config_json)
    layer_list = decoder_layers(model)  # a model FSDP cannot shard is refused by name
    mc = model.config
    tp = cfg.rollout_tensor_parallel_size
    check_tensor_parallel(mc, tp, name="rollout_tensor_parallel_size", world_size=world_size)  # as grpo refuses it
    train_dtype = mc.torch_dtype if cfg.dtype == "auto" else cfg.dtype
    rollout_dtype = train_dtype if cfg.rollout_dtype == "auto" else cfg.rollout_dtype
    elem, r_elem = dtype_bytes(train_dtype), dtype_bytes(rollout_dtype)
    shapes = [(tuple(p.shape), elem) for p in model.parameters()]
    full = shard_bytes(shapes, 1)
    sharded = parallelism == "fsdp" and world_size > 1
    mine = shard_bytes(shapes, world_size, 0) if parallelism == "fsdp" else full
    on_host = sharded and cfg.fsdp_cpu_offload
    prompt = cfg.max_prompt_length or 0
    length = prompt + cfg.max_completion_length
    kv_width = mc.num_key_value_heads * mc.head_dim
    engine = cfg.engine_config(length)
    kv_dtype = getattr(torch, str(rollout_dtype).removeprefix("torch."))
    shard_cfg = SimpleNamespace(num_hidden_layers=mc.num_hidden_layers, head_dim=mc.head_dim,
                                num_key_value_heads=mc.num_key_value_heads // tp)  # this rank's K/V heads
    per_token = KVPool.bytes_per_token(mc.num_hidden_layers, shard_cfg.num_key_value_heads, mc.head_dim, kv_dtype)
    try:
        blocks = plan_kv_blocks(shard_cfg, kv_cache_bytes=engine.kv_cache_bytes, block_size=engine.block_size,
                                max_model_len=length, max_num_seqs=engine.max_num_seqs, dtype=kv_dtype)
    except ValueError:  # less than one sequence: report() says so
        blocks = engine.kv_cache_bytes // (per_token * engine.block_size)
    kv = (blocks + 1) * engine.block_size * per_token  # and the spare block padding writes to
    b = 2 if cfg.bf16 else elem
    tokens = cfg.per_device_train_batch_size * length
    h, inter, layers = mc.hidden_size, mc.intermediate_size, mc.num_hidden_layers
    layer_full = tokens * (7 * h + 2 * kv_width + 4 * inter) * b
    acts = layers * tokens * h * b + layer_full if cfg.gradient_checkpointing else layers * layer_full
    positions = cfg.per_device_train_batch_size * cfg.max_completion_length
    chunk = positions if cfg.logits_chunk_size is None else min(cfg.logits_chunk_size, positions)
    gathered = 0
    if sharded:
        in_layers = {id(p) for layer in layer_list for p in layer.parameters()}
        root = sum(p.numel() for p in model.parameters() if id(p) not in in_layers)
        biggest = max(sum(p.numel() for p in layer.parameters()) for layer in layer_list)
        gathered = (root + 2 * biggest) * b
    param_device = 0 if on_host else mine
    rows = {"parameters": param_device, "gradients": param_device, "optimizer": 2 * param_device,
            "reference_model": (0 if on_host else mine) if cfg.beta > 0 else 0,
            "rollout_weights": tp_shard_bytes(model, tp, r_elem) + leader_target_bytes(model, tp, cfg, r_elem),
            "kv_cache": kv, "activations": acts,
            "logits": chunk * mc.vocab_size * LOGITS_BYTES, "gathered": gathered}
    rollout_off = tuple(k for k, on in (("parameters", cfg.param_offload), ("optimizer", cfg.optimizer_offload)) if on)
    off = {"rollout": rollout_off, "training": ("optimizer",) if cfg.optimizer_offload else (),
           # with sleep mode the moments go back to host memory before the engine wakes for the update
           "weight_update": ("optimizer",) if cfg.optimizer_offload and cfg.enable_sleep_mode else ()}
    moved = sum(rows[k] for k in rollout_off)
    engine_rows = ("rollout_weights", "kv_cache")  # what the engine frees while asleep
    asleep = {"training": engine_rows, "optimizer_step": engine_rows} if cfg.enable_sleep_mode else {}
    return Plan(parallelism, world_size, sum(math.prod(s) for s, _ in shapes), rows, length * per_token,
                off, asleep, moved, {"dtype": str(rollout_dtype).removeprefix("torch."), "tensor_parallel_size": tp,
                                     "logits_chunk_size": chunk, "sleep_mode": cfg.enable_sleep_mode})


LOGITS_BYTES = 16  # per position and vocabulary entry of a chunk: four float32 tensors at once


def dtype_bytes(name: Any) -> int:
    return torch.empty(0, dtype=getattr(torch, str(name).removeprefix("torch."))).element_size()


# Megatron's split of a decoder over a tensor-parallel group: by output rows (dim 0) or input columns (dim 1).
_ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
_COLUMNS = ("o_proj", "down_proj")


def tp_shard_bytes(model: torch.nn.Module, tp: int, elem: int) -> int:
    """Bytes of rank 0's tensor-parallel shard of `model` at `elem` bytes an element (tied weights once)."""
    total = 0
    for name, p in model.named_parameters():
        owner = name.split(".")[-2]
        shape = list(p.shape)
        if owner in _ROWS:
            shape[0] = -(-shape[0] // tp)
        elif owner in _COLUMNS and len(shape) > 1:
            shape[1] = -(-shape[1] // tp)
        total += math.prod(shape) * elem
    return total


def leader_target_bytes(model: torch.nn.Module, tp: int, cfg: Any, elem: int) -> int:
    """An EAGLE drafter on a TP engine: the leader (rank 0) also holds the whole embedding and LM
    head (one tensor when tied) for it (engine/tensor_parallel.py's LeaderTarget); else 0."""
    from reclaim.engine.speculative import MODEL_METHODS

    if tp == 1 or cfg.speculative.partition(":")[0] not in MODEL_METHODS:
        return 0
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    return (embed.numel() + (0 if head is embed else head.numel())) * elem


def report(p: Plan, device_memory: int | None) -> str:
    """The plan as a table in GB (1e9 bytes): what a rank holds (for GRPO, by phase), with the
    verdict against device_memory."""
    if not p.rollout:  # an ssm-train plan: no engine, no phases
        lines = [f"{p.parallelism} at world size {p.world_size}: {p.num_parameters / 1e9:.2f}B parameters; "
                 "per rank (the worst rank):"]
        lines += [f"  {k:<16} {v / GB:9.2f} GB" for k, v in p.rows.items()]
        lines.append(f"  {'total':<16} {p.total / GB:9.2f} GB")
    else:
        r = p.rollout
        lines = [f"{p.parallelism} at world size {p.world_size}: {p.num_parameters / 1e9:.2f}B parameters; rollout "
                 f"weights in {r['dtype']} at tensor parallel {r['tensor_parallel_size']}, logits in chunks of "
                 f"{r['logits_chunk_size']} positions; per rank (the worst rank), GB:"]
        names = list(PHASES)
        lines.append(f"  {'':<16} {'held':>9} " + " ".join(f"{n:>14}" for n in names))
        for k, v in p.rows.items():
            cells = []
            for n in names:
                cells.append("-" if k not in PHASES[n] else "host" if k in p.off_device.get(n, ())
                             else "asleep" if k in p.asleep.get(n, ()) else f"{v / GB:.2f}")
            lines.append(f"  {k:<16} {v / GB:9.2f} " + " ".join(f"{c:>14}" for c in cells))
        lines.append(f"  {'total':<16} {'':>9} " + " ".join(f"{p.phase(n) / GB:14.2f}" for n in names))
        lines.append(f"  peak {p.total / GB:.2f} GB")
        if p.offload_bytes:
            lines.append(f"  offload: {p.offload_bytes / GB:.2f} GB to host memory and back each rollout, "
                         f"{p.offload_seconds:.1f} s at {HOST_BANDWIDTH / GB:.0f} GB/s")
    if p.rows.get("kv_cache", p.min_kv_bytes) < p.min_kv_bytes:
        lines.append(f"  the KV budget holds less than one sequence at full length ({p.min_kv_bytes / GB:.2f} GB): "
                     "raise engine.kv_cache_bytes")
    if device_memory is not None:
        room = device_memory - p.total
        verdict = "fits" if room >= 0 else "does not fit"
        lines.append(f"{verdict} in {device_memory / GB:.0f} GB per device ({abs(room) / GB:.2f} GB "
                     f"{'to spare' if room >= 0 else 'over'})")
    return "\n".join(lines)
