"""Decoder for the Llama family: Llama (with llama3 RoPE scaling), Mistral, Qwen2 and Qwen3.

Parameter names equal transformers' so HF checkpoints load without a key map. Inference state is
passed in (see cache.py); the forward can return the final hidden states, the residual stream
entering chosen layers (an EAGLE-3 drafter's features), and compute logits only at chosen positions.
The config and its config.json handling are in llama_config.py (`LlamaConfig` is importable here too).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from reclaim.models.cache import AttentionCache, causal_mask, needs_mask
from reclaim.models.kernels import rownorm
from reclaim.models.kernels.linear import Linear
from reclaim.models.llama_config import LlamaConfig
from reclaim.models.norm import RMSNorm


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies, with the llama3 or linear scaling of `rope_scaling` applied."""
    d = cfg.head_dim
    # float32 as in transformers (checkpoints were trained with it); float64 drifts ~1e-4 in the logits.
    # On the CPU also inside a meta-device construction (loading.py rebuilds it there): on meta the
    # pow runs torch's Python decompositions, whose first call imports torch._dynamo (1.4 s).
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device="cpu") / d))
    s = cfg.rope_scaling or {}
    kind = s.get("rope_type", "default")
    if kind == "default":
        pass
    elif kind == "linear":
        inv = inv / s["factor"]
    elif kind == "llama3":
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old / lo, inv / factor, torch.where(wavelen < old / hi, inv, mid))
    else:
        raise ValueError(
            f"unsupported rope_scaling type {kind!r}; supported: ['default', 'linear', 'llama3']"
        )
    return inv.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; x [B, H, T, D], cos/sin [B, 1, T, D] (or the engine's packed rows: x [N, H, D],
    cos/sin [N, 1, D], one C call for float32 inference on a CPU)."""
    y = rownorm.rope(x, cos, sin)
    if y is not None:
        return y
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.window = cfg.sliding_window
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = Linear(h, self.nh * self.hd, bias=cfg.qkv_bias)
        self.k_proj = Linear(h, self.nkv * self.hd, bias=cfg.qkv_bias)
        self.v_proj = Linear(h, self.nkv * self.hd, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.nh * self.hd, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache: AttentionCache | None):
        """x [B, T, H]; cos, sin [B, 1, T, D]. A cache with `attend` (the engine's paged view of
        packed rows, B = 1) stores the new K/V and attends itself."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        b, t, _ = q.shape
        q, k, v = q.view(b, t, self.nh, self.hd), k.view(b, t, self.nkv, self.hd), v.view(b, t, self.nkv, self.hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        attend = getattr(cache, "attend", None)
        if attend is not None:  # [N, heads, D] rows: RoPE over [B * T, 1, D]
            cos, sin = cos.transpose(1, 2).flatten(0, 1), sin.transpose(1, 2).flatten(0, 1)
            q, k = apply_rope(q.flatten(0, 1), cos, sin), apply_rope(k.flatten(0, 1), cos, sin)
            o = attend(self.layer, q, k, v.flatten(0, 1))
            return self.o_proj(o.view(b, t, self.nh * self.hd))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask = None
        if cache is not None:
            k, v, mask = cache.update(self.layer, k, v)
        elif needs_mask(t, 0, self.window):
            mask = causal_mask(t, 0, x.device, self.window)
        # enable_gqa lets each K/V head serve its group of query heads without copying it.
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and t > 1,
                                           enable_gqa=self.nkv != self.nh)
        o = o.transpose(1, 2).reshape(b, t, self.nh * self.hd)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = Linear(h, i, bias=bias)
        self.up_proj = Linear(h, i, bias=bias)
        self.down_proj = Linear(i, h, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Embedding(nn.Embedding):
    """nn.Embedding without the random init of a meta weight (see kernels/linear.py's Linear)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Backbone(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class ForwardOutput(NamedTuple):
    logits: torch.Tensor | None  # [B, T or K, V], float32
    hidden: torch.Tensor | None  # [B, T, H]: final-norm hidden states (the lm_head's input)
    aux: torch.Tensor | None = None  # [B, T, len(aux_layers) * H]: the states entering aux_layers


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM with HF parameter names."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: AttentionCache | None = None,
        *,
        logit_positions: torch.Tensor | None = None,
        return_hidden: bool = False,
        compute_logits: bool = True,
        aux_layers: tuple[int, ...] | None = None,
    ) -> ForwardOutput:
        """Run the decoder over `input_ids` [B, T].

        positions: [B, T] absolute positions (default 0..T-1). cache: see cache.py, built with
        this config's sliding_window; without one attention is causal over the T tokens. logit_positions: [B, K] indices into T at which to
        compute logits (default all). return_hidden: also return the final hidden states.
        aux_layers: also return the residual stream entering each of these layers (0: the
        embeddings; vLLM's EAGLE-3 numbering), concatenated in this order.
        """
        b, t = input_ids.shape
        window = self.config.sliding_window
        if cache is not None and getattr(cache, "sliding_window", None) != window:
            raise ValueError(
                f"the cache applies sliding_window={getattr(cache, 'sliding_window', None)!r} but the "
                f"model's config has sliding_window={window!r}; build the cache with the config's"
            )
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        x = self.model.embed_tokens(input_ids)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        taps = {} if aux_layers is None else check_aux_layers(aux_layers, len(self.model.layers))
        for i, layer in enumerate(self.model.layers):
            if i in taps:
                taps[i] = x
            x = layer(x, cos, sin, cache)
        hidden = self.model.norm(x)
        logits = None
        if compute_logits:
            h = hidden
            if logit_positions is not None:
                idx = logit_positions[..., None].expand(-1, -1, h.shape[-1])
                h = torch.gather(h, 1, idx)
            logits = self.lm_head(h).float()
        aux = None if aux_layers is None else torch.cat([taps[i] for i in aux_layers], dim=-1)
        return ForwardOutput(logits, hidden if return_hidden else None, aux)


def check_aux_layers(aux_layers: tuple[int, ...], num_layers: int) -> dict[int, None]:
    """The distinct layer ids of `aux_layers` (keys of a dict to fill), refusing ids out of range."""
    bad = [i for i in aux_layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers]
    if bad or not aux_layers:
        raise ValueError(f"aux_layers={list(aux_layers)}: each must be a layer id in 0..{num_layers - 1} "
                         "(the state entering that layer; 0 is the embeddings), at least one")
    return dict.fromkeys(aux_layers)
