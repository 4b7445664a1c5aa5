"""Bamba (the layout of IBM's Bamba-9B and Granite-4.0-H's dense hybrids): every layer is a
Mamba-2 or an attention mixer followed by a SwiGLU MLP, with transformers' `BambaForCausalLM`
parameter names (model.embed_tokens, model.layers.N.{mamba|self_attn}, .feed_forward,
.input_layernorm, .pre_ff_layernorm, model.final_layernorm, lm_head).

A layer is r + mixer(RMSNorm(r)), then + MLP(RMSNorm(.)): one block whose state is its mixer's
(Mamba-2: h and the conv tail; attention: the keys and values of every earlier token, rotated),
so it runs whole, in chunks (the adjoint) or a token at a time as the other SSM families do.
Attention is causal GQA with rotary position embedding on the first half of each head
(Bamba's partial_rotary_factor 0.5), keys kept after rotation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from reclaim.models.llama import apply_rope
from reclaim.models.mamba import RecurrentLM
from reclaim.models.mamba2 import (Mamba2Mixer, SSDLayerShape, from_hf_fields, load_hf_ssm, to_hf_fields,
                                    write_hf_ssm)
from reclaim.models.nemotron_h import ATTENTION, MAMBA, Attention
from reclaim.models.norm import RMSNorm

HF_ARCH = "BambaForCausalLM"
MODEL_TYPE = "bamba"
ROPE_TYPES = ("default",)


@dataclass
class BambaConfig:
    """Shape of a Bamba LM; field names are those of the HF BambaConfig."""

    vocab_size: int = 128000
    tie_word_embeddings: bool = False
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 262144
    attn_layer_indices: list[int] | None = None
    mamba_n_heads: int = 128
    mamba_d_head: int | str = "auto"
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    attention_bias: bool = False
    mlp_bias: bool = False
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    torch_dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: ['silu']")
        if self.mamba_d_head == "auto":
            self.mamba_d_head = self.mamba_expand * self.hidden_size // self.mamba_n_heads
        if self.mamba_d_head * self.mamba_n_heads != self.mamba_expand * self.hidden_size:
            raise ValueError(f"mamba_n_heads ({self.mamba_n_heads}) x mamba_d_head ({self.mamba_d_head}) must be "
                             f"mamba_expand x hidden_size ({self.mamba_expand * self.hidden_size})")
        if self.mamba_n_groups < 1 or self.mamba_n_heads % self.mamba_n_groups:
            raise ValueError(f"mamba_n_heads ({self.mamba_n_heads}) must be a multiple of mamba_n_groups "
                             f"({self.mamba_n_groups})")
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must divide hidden_size "
                             f"({self.hidden_size})")
        bad = sorted(i for i in self.attn_layer_indices or [] if not 0 <= i < self.num_hidden_layers)
        if bad:
            raise ValueError(f"attn_layer_indices {bad} are not layers of a {self.num_hidden_layers}-layer model")
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, **self.rope_parameters}
        if rope["rope_type"] not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope['rope_type']!r}; supported: {list(ROPE_TYPES)}")
        self.rope_parameters = rope
        self.time_step_limit = tuple(float(v) for v in self.time_step_limit)

    @property
    def layers_block_type(self) -> list[str]:
        attn = set(self.attn_layer_indices or [])
        return [ATTENTION if i in attn else MAMBA for i in range(self.num_hidden_layers)]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def mamba_shape(self) -> SSDLayerShape:
        return SSDLayerShape(
            self.hidden_size, self.mamba_n_heads, self.mamba_d_head, self.mamba_d_state, self.mamba_n_groups,
            self.mamba_d_conv, self.mamba_proj_bias, self.mamba_conv_bias, self.rms_norm_eps, self.time_step_limit,
            0.001, 0.1, 1e-4,
        )

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "BambaConfig":
        """Build from an HF config.json dict (a top-level rope_theta is read as older configs
        write it); unknown keys are kept in `extra` for the round trip."""
        d = dict(d)
        if d.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(f"model_type {d['model_type']!r} is not a Bamba config; expected {MODEL_TYPE!r}")
        if "dtype" in d:
            d.setdefault("torch_dtype", d.pop("dtype"))
        rope = dict(d.get("rope_parameters") or {})
        if "rope_theta" in d:
            rope.setdefault("rope_theta", d.pop("rope_theta"))
        d["rope_parameters"] = rope
        return from_hf_fields(cls, d)

    def to_hf(self) -> dict[str, Any]:
        return to_hf_fields(self, MODEL_TYPE, HF_ARCH)


class RotaryAttention(Attention):
    """Causal GQA (biases as attention_bias says) with rotate-half RoPE on the first
    rotary_dim channels of each head, at each token's position in the sequence."""

    def __init__(self, cfg: BambaConfig) -> None:
        super().__init__(cfg, bias=cfg.attention_bias)
        rope = cfg.rope_parameters
        dim = int(cfg.head_dim * rope["partial_rotary_factor"])
        # float32 as transformers computes them
        inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + q.shape[2], device=q.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq.to(q.device)
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        return _rope(q, cos, sin), _rope(k, cos, sin)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Llama's) on x's first cos.shape[-1] channels; the rest pass through."""
    d = cos.shape[-1]
    return torch.cat([apply_rope(x[..., :d], cos, sin), x[..., d:]], -1)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): HF BambaMLP."""

    def __init__(self, cfg: BambaConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BambaLayer(nn.Module):
    """A mixer (Mamba-2 as `mamba`, or attention as `self_attn`) then a SwiGLU MLP, each pre-normed
    and residual; the layer's state is its mixer's."""

    def __init__(self, cfg: BambaConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if kind == MAMBA:
            self.mamba = Mamba2Mixer(cfg.mamba_shape())
        else:
            self.self_attn = RotaryAttention(cfg)
        self.feed_forward = SwiGLU(cfg)

    @property
    def mixer(self) -> nn.Module:
        return self.mamba if self.kind == MAMBA else self.self_attn

    def forward_chunk(self, r: torch.Tensor, *state: torch.Tensor, **kernel: Any) -> tuple[torch.Tensor, ...]:
        """Residual stream r [B, T, H] in, (r out, *state after) out; `kernel` (scan=...) goes to a
        Mamba-2 mixer."""
        out, *after = self.mixer.forward_chunk(self.input_layernorm(r), *state, **kernel)
        r = r + out.to(r.dtype)
        return (r + self.feed_forward(self.pre_ff_layernorm(r)).to(r.dtype), *after)


class BambaBackbone(nn.Module):
    def __init__(self, cfg: BambaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(BambaLayer(cfg, kind) for kind in cfg.layers_block_type)
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def embeddings(self) -> nn.Embedding:  # the names the SSM engines use
        return self.embed_tokens

    @property
    def norm_f(self) -> RMSNorm:
        return self.final_layernorm


class BambaForCausalLM(RecurrentLM):
    """Bamba causal LM with HF parameter names (model.*, lm_head; tied as tie_word_embeddings says)."""

    def __init__(self, cfg: BambaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = BambaBackbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        with torch.no_grad():  # transformers' init: N(0, initializer_range) weights, zero biases
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, std=cfg.initializer_range)
                    if getattr(module, "bias", None) is not None:
                        module.bias.zero_()
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def backbone(self) -> BambaBackbone:  # type: ignore[override]
        return self.model


def load_bamba(path: str | os.PathLike, dtype: torch.dtype | None = None) -> BambaForCausalLM:
    """Load an HF Bamba directory (config.json + safetensors)."""
    return load_hf_ssm(path, BambaConfig, BambaForCausalLM, dtype)


def write_bamba(model: BambaForCausalLM, path: Path) -> None:
    """Write `model` into the existing directory `path` as an HF directory."""
    write_hf_ssm(model, path)


def save_bamba(model: BambaForCausalLM, path: str | os.PathLike) -> Path:
    """Write `model` atomically as an HF directory that transformers' BambaForCausalLM loads."""
    from reclaim.storage import atomic_dir

    return atomic_dir(Path(path), lambda tmp: write_bamba(model, tmp))
