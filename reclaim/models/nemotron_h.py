"""Nemotron-H: a hybrid decoder of Mamba-2, attention and MLP layers, with transformers'
`NemotronHForCausalLM` parameter names (model.*, lm_head).

Every layer is r + mixer(RMSNorm(r)); `layers_block_type` says which mixer each layer has:
"linear_attention" (a Mamba-2 mixer, `mamba2.Mamba2Mixer`), "full_attention" (causal GQA without
positional encoding, as Nemotron-H's) or "mlp" (down(relu(up(x))^2)). MoE layers are refused by
name. Each layer's state is passed in and handed back as in the Mamba models: (h, conv tail) for
Mamba-2, the keys and values of every earlier token for attention, nothing for an MLP; so a
sequence runs whole, in chunks (adjoint training) or a token at a time (generation).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from reclaim.models.chunk_attention import chunk_attention
from reclaim.models.mamba import RecurrentLM
from reclaim.models.mamba2 import (Mamba2Mixer, SSDLayerShape, from_hf_fields, load_hf_ssm, to_hf_fields,
                                    write_hf_ssm)
from reclaim.models.norm import RMSNorm

HF_ARCH = "NemotronHForCausalLM"
MODEL_TYPE = "nemotron_h"
MAMBA, ATTENTION, MLP_LAYER = "linear_attention", "full_attention", "mlp"
LAYER_TYPES = (MAMBA, ATTENTION, MLP_LAYER)
# Older names and the one-character pattern of earlier Nemotron-H configs.
LEGACY = {"mamba": MAMBA, "attention": ATTENTION}
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP_LAYER, "E": "moe"}
ACTIVATIONS = ("relu2",)


class KVState(NamedTuple):
    """An attention layer's state: keys and values of every earlier token [B, kv heads, S, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor


class NoState(NamedTuple):
    """An MLP layer carries nothing from one token to the next."""


@dataclass
class NemotronHConfig:
    """Shape of a Nemotron-H LM; field names are those of the HF NemotronHConfig."""

    vocab_size: int = 131072
    hidden_size: int = 4096
    layers_block_type: list[str] = field(default_factory=lambda: [MAMBA, ATTENTION, MLP_LAYER])
    tie_word_embeddings: bool = False
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 21504
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    ssm_state_size: int = 128
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    mamba_hidden_act: str = "silu"
    n_groups: int = 8
    conv_kernel: int = 4
    expand: int = 2
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    time_step_floor: float = 1e-4
    use_conv_bias: bool = True
    chunk_size: int = 128
    use_bias: bool = False
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    rescale_prenorm_residual: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    torch_dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.layers_block_type = [LEGACY.get(t, t) for t in self.layers_block_type]
        bad = sorted({t for t in self.layers_block_type if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"unsupported layer types {bad}; supported: {list(LAYER_TYPES)}")
        if not self.layers_block_type:
            raise ValueError("layers_block_type is empty: a model needs at least one layer")
        if self.mlp_hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported mlp_hidden_act {self.mlp_hidden_act!r}; supported: {list(ACTIVATIONS)}")
        if self.mamba_hidden_act != "silu":
            raise ValueError(f"unsupported mamba_hidden_act {self.mamba_hidden_act!r}; supported: ['silu']")
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.n_groups < 1 or self.mamba_num_heads % self.n_groups:
            raise ValueError(f"mamba_num_heads ({self.mamba_num_heads}) must be a multiple of "
                             f"n_groups ({self.n_groups})")
        self.time_step_limit = tuple(float(v) for v in self.time_step_limit)

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layers_block_type)

    def mamba_shape(self) -> SSDLayerShape:
        """What this model's Mamba-2 mixers are built from."""
        return SSDLayerShape(
            self.hidden_size, self.mamba_num_heads, self.mamba_head_dim, self.ssm_state_size,
            self.n_groups, self.conv_kernel, self.use_bias, self.use_conv_bias, self.layer_norm_epsilon,
            self.time_step_limit, self.time_step_min, self.time_step_max, self.time_step_floor,
        )

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "NemotronHConfig":
        """Build from an HF config.json dict (layers_block_type or the older hybrid_override_pattern);
        unknown keys are kept in `extra` for the round trip."""
        d = dict(d)
        if d.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(f"model_type {d['model_type']!r} is not a Nemotron-H config; expected {MODEL_TYPE!r}")
        if "dtype" in d:
            d.setdefault("torch_dtype", d.pop("dtype"))
        if d.get("layers_block_type") is None and "hybrid_override_pattern" in d:
            pattern = d.pop("hybrid_override_pattern")
            unknown = sorted(set(pattern) - set(PATTERN))
            if unknown:
                raise ValueError(f"hybrid_override_pattern has unknown characters {unknown}; known: {list(PATTERN)}")
            d["layers_block_type"] = [PATTERN[c] for c in pattern]
        if d.get("layers_block_type") is None:
            raise ValueError("config.json names no layers: neither layers_block_type nor hybrid_override_pattern")
        return from_hf_fields(cls, d, drop=("model_type", "architectures", "num_hidden_layers"))

    def to_hf(self) -> dict[str, Any]:
        """The HF config.json dict."""
        return to_hf_fields(self, MODEL_TYPE, HF_ARCH, num_hidden_layers=self.num_hidden_layers)


class Attention(nn.Module):
    """Causal grouped-query attention over the keys and values of every earlier token (no positional
    encoding, as Nemotron-H's); HF NemotronHAttention parameters (no biases)."""

    def __init__(self, cfg: NemotronHConfig, bias: bool = False) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.heads * hd, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.heads * hd, h, bias=bias)

    def zero_state(self, batch: int, like: torch.Tensor) -> KVState:
        """No earlier token: empty keys and values."""
        empty = like.new_zeros(batch, self.kv_heads, 0, self.head_dim)
        return KVState(empty, empty.clone())

    def rotate(self, q: torch.Tensor, k: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positional encoding of the chunk's queries and keys ([B, heads, T, D], at positions
        start, start + 1, ...): none for Nemotron-H; keys are kept as this returns them."""
        return q, k

    def forward_chunk(
        self, u: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attend from normed input u [B, T, H] to (k0, v0) and this chunk; returns (out, k1, v1)."""
        b, t, _ = u.shape
        q = self.q_proj(u).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(u).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(u).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotate(q, k, k0.shape[2])
        k0, v0 = k0.to(k.dtype), v0.to(v.dtype)
        k1, v1 = torch.cat([k0, k], 2), torch.cat([v0, v], 2)
        # Query i (position s + i) sees keys 0 .. s + i: chunk_attention runs that without a
        # [t, s + t] mask on a CPU, and with no earlier key as is_causal.
        y = chunk_attention(q, k0, v0, k, v, self.head_dim**-0.5)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1)), k1, v1


class MLP(nn.Module):
    """down(relu(up(x))^2): HF NemotronHMLP with relu2."""

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def zero_state(self, batch: int, like: torch.Tensor) -> NoState:
        return NoState()

    def forward_chunk(self, u: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.down_proj(F.relu(self.up_proj(u)).square()),)


class HybridBlock(nn.Module):
    """Pre-norm residual block around one mixer of the kind its layer type names."""

    def __init__(self, cfg: NemotronHConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        if kind == MAMBA:
            self.mixer: nn.Module = Mamba2Mixer(cfg.mamba_shape())
        elif kind == ATTENTION:
            self.mixer = Attention(cfg)
        else:
            self.mixer = MLP(cfg)

    def forward_chunk(self, r: torch.Tensor, *state: torch.Tensor, **kernel: Any) -> tuple[torch.Tensor, ...]:
        """Residual stream r [B, T, H] in, (r out, *state after) out. `kernel` (scan=...) goes to a
        Mamba-2 mixer."""
        out, *after = self.mixer.forward_chunk(self.norm(r), *state, **kernel)
        return (r + out.to(r.dtype), *after)


class HybridBackbone(nn.Module):
    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridBlock(cfg, kind) for kind in cfg.layers_block_type)
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class NemotronHForCausalLM(RecurrentLM):
    """Nemotron-H causal LM with HF parameter names (model.*, lm_head)."""

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = HybridBackbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Never tied, whatever tie_word_embeddings says: transformers' Nemotron-H ties nothing and
        # saves both tensors (the flag is kept for the round trip).
        self._init_like_hf(cfg)

    @property
    def backbone(self) -> HybridBackbone:  # type: ignore[override]
        """The decoder (HF names it `model`); the name the SSM engines use."""
        return self.model

    @torch.no_grad()
    def _init_like_hf(self, cfg: NemotronHConfig) -> None:
        # transformers' init: N(0, initializer_range) linear weights and embeddings, zero biases;
        # Mamba's A_log, D and dt_bias come from the mixer.
        std = cfg.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
        if cfg.rescale_prenorm_residual:
            for layer in self.model.layers:
                out = {MAMBA: "out_proj", ATTENTION: "o_proj", MLP_LAYER: "down_proj"}[layer.kind]
                getattr(layer.mixer, out).weight /= math.sqrt(cfg.num_hidden_layers)


# ---- checkpoints -------------------------------------------------------------------------------


# The files name the decoder `backbone.` (NVIDIA's checkpoints, and what transformers writes); its
# modules name it `model.`.
FILE_PREFIX, MODULE_PREFIX = "backbone.", "model."


def to_module_name(key: str) -> str:
    """A checkpoint key as this model's (and transformers') parameter name."""
    return MODULE_PREFIX + key.removeprefix(FILE_PREFIX) if key.startswith(FILE_PREFIX) else key


def to_file_name(key: str) -> str:
    """A parameter name as checkpoint files spell it."""
    return FILE_PREFIX + key.removeprefix(MODULE_PREFIX) if key.startswith(MODULE_PREFIX) else key


def load_nemotron_h(path: str | os.PathLike, dtype: torch.dtype | None = None) -> NemotronHForCausalLM:
    """Load an HF Nemotron-H directory (config.json + safetensors)."""
    return load_hf_ssm(path, NemotronHConfig, NemotronHForCausalLM, dtype, to_module_name)


def write_nemotron_h(model: NemotronHForCausalLM, path: Path) -> None:
    """Write `model` into the existing directory `path` as an HF directory."""
    write_hf_ssm(model, path, rename=to_file_name)


def save_nemotron_h(model: NemotronHForCausalLM, path: str | os.PathLike) -> Path:
    """Write `model` atomically as an HF directory that transformers' NemotronHForCausalLM loads."""
    from reclaim.storage import atomic_dir

    return atomic_dir(Path(path), lambda tmp: write_nemotron_h(model, tmp))
