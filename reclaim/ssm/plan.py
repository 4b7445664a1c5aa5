"""`reclaim plan` for `ssm-train`: memory per rank of a long-context SSM run from the model's
config.json alone (meta device, no weights), for any SSM family (Mamba-1, Mamba-2, Nemotron-H).

Per rank, with T tokens per sequence (B sequences), W ranks, Q the chunk, b the training dtype's
bytes, L layers of hidden size h:

- parameters, gradients and AdamW's two moments in the training dtype: whole on every rank by
  time (context parallel) and data parallel ("none"), 1/W under "fsdp" (`reclaim.fsdp.shard_bytes`);
- the tokens a rank trains on: T/W of each sequence by time (the rank with the last segment is the
  worst: it holds every earlier key), all T otherwise;
- by time, the segment's layer inputs, L x T/W x h x b; by data parallel none (each chunk's
  inputs are recomputed from the boundary states);
- boundary states at every chunk start of the rank's tokens, per Mamba layer: h (float32 at
  least) and the conv tail;
- per attention layer, keys and values of every token up to the segment's end, 2 x kv heads x
  head_dim x b per token, and as much again for their gradients carried back;
- one chunk's autograd graph (all layers at once; one layer by time or with adjoint_recompute
  "layer", plus the chunk's layer inputs): per token about 12 x
  the Mamba inner width, 4 x h for attention, 3 x the MLP width, x b; plus attention's mask of
  the chunk against every earlier key, about 3 bytes per (query, key) inside CPU SDPA;
- the logits of one loss sub-chunk and their gradient in float32.

The adjoint's only O(T) terms are the boundary states (T/Q of them) and attention's K/V; no
activation grows with T except by time's segment inputs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from reclaim.plan import Plan

MODES = ("none", "fsdp", "time")


def meta_ssm(config_json: Path) -> torch.nn.Module:
    """The SSM of an HF config.json on the meta device (shapes only); other families refused."""
    from reclaim.models.ssm import FAMILIES, ssm_family

    raw = json.loads(config_json.read_text())
    family = FAMILIES[ssm_family(raw)]
    cfg = family.config.from_mamba_ssm(raw) if "d_model" in raw and "model_type" not in raw \
        else family.config.from_hf(raw)
    with torch.device("meta"):
        return family.model(cfg)


def _layer_parts(model: torch.nn.Module) -> list[tuple[str, Any, int]]:
    """(kind, mixer, SwiGLU width) per layer: mamba, attention or mlp, and the intermediate width
    of the MLP a Bamba layer has after its mixer (0: none)."""
    from reclaim.models.nemotron_h import MLP, Attention

    out = []
    for layer in model.backbone.layers:
        m = layer.mixer
        ff = getattr(layer, "feed_forward", None)
        out.append(("attention" if isinstance(m, Attention) else "mlp" if isinstance(m, MLP) else "mamba", m,
                    0 if ff is None else ff.up_proj.out_features))
    return out


def plan_ssm(cfg: Any, config_json: Path, world_size: int, sharding: str | None = None) -> Plan:
    """Per-rank bytes of SSMTrainConfig `cfg` (adjoint or truncated) on the model of `config_json`."""
    from reclaim.fsdp import shard_bytes

    sharding = sharding or cfg.sharding
    if world_size < 1:
        raise ValueError(f"world size {world_size}: need >= 1")
    if sharding not in MODES:
        raise ValueError(f"sharding {sharding!r}: the plan covers {list(MODES)}")
    if cfg.grad_mode not in ("adjoint", "truncated"):
        raise ValueError(f"grad_mode {cfg.grad_mode!r}: the plan covers the adjoint (adjoint, truncated)")
    model = meta_ssm(config_json)
    b = torch.empty(0, dtype=getattr(torch, cfg.dtype)).element_size()
    shapes = [(tuple(p.shape), b) for p in {id(p): p for p in model.parameters()}.values()]
    full = shard_bytes(shapes, 1)
    mine = shard_bytes(shapes, world_size, 0) if sharding == "fsdp" else full
    batch, length, q = cfg.per_device_train_batch_size, cfg.context_length, cfg.chunk_size
    by_time = sharding == "time"
    tokens = math.ceil(length / world_size) if by_time else length  # this rank's share of a sequence
    h = model.backbone.embeddings.weight.shape[1]
    parts = _layer_parts(model)
    state_b = max(b, 4)
    chunks = math.ceil(tokens / q)
    states = kv = 0
    graph_per_token = []
    for kind, m, swiglu in parts:
        swiglu_graph = 4 * swiglu * b  # gate and up out, silu(gate), their product
        if kind == "mamba":  # h: d_inner x state (Mamba-2: heads x head_dim x state), conv tail
            conv = m.conv1d.in_channels * (m.kernel - 1)
            states += chunks * batch * (m.d_inner * m.n_state * state_b + conv * b)
            graph_per_token.append(12 * m.d_inner * b + swiglu_graph)
        elif kind == "attention":
            kv += batch * length * 2 * m.kv_heads * m.head_dim * b  # worst rank: every earlier key
            graph_per_token.append(4 * h * b + swiglu_graph)
        else:
            graph_per_token.append(3 * m.up_proj.out_features * b)
    n_attention = sum(kind == "attention" for kind, _, _ in parts)
    one_layer = by_time or cfg.adjoint_recompute == "layer"  # by time: always one layer's graph
    graph = batch * min(q, tokens) * (max(graph_per_token) if one_layer else sum(graph_per_token))
    if one_layer and not by_time:  # the chunk's layer inputs, re-run without autograd
        graph += batch * min(q, tokens) * len(parts) * h * b
    mask = batch * min(q, tokens) * length * 3 * (1 if one_layer else n_attention) if n_attention else 0
    vocab = model.lm_head.weight.shape[0]
    rows = {"parameters": mine, "gradients": mine, "optimizer": 2 * mine,
            "segment_inputs": batch * len(parts) * tokens * h * b if by_time else 0,
            "boundary_states": states, "attention_kv": kv, "attention_dkv": kv,
            "chunk_graph": graph, "attention_mask": mask,
            "logits": batch * min(cfg.loss_chunk, tokens) * vocab * 4 * 3}
    return Plan(sharding, world_size, sum(math.prod(s) for s, _ in shapes), rows, 0)
