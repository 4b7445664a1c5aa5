"""Decoder for the Llama family: Llama (with llama3 RoPE scaling), Mistral, Qwen2 and Qwen3.

Parameter names equal transformers' so HF checkpoints load without a key map. Inference state is
passed in (see cache.py); the forward can return the final hidden states, the residual stream
entering chosen layers (an EAGLE-3 drafter's features), and compute logits only at chosen positions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from reclaim.models.cache import AttentionCache, causal_mask, needs_mask
from reclaim.models.kernels.linear import Linear
from reclaim.models.norm import RMSNorm

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# config.json keys outside LlamaConfig's fields that do not change the forward, whatever their
# value: provenance, load and output switches of transformers, token ids, generation defaults
# (reclaim samples per request) and init. pretraining_tp > 1 only split matmuls in training.
HARMLESS_KEYS = frozenset({
    "_name_or_path", "_commit_hash", "_attn_implementation", "architectures", "auto_map",
    "transformers_version", "use_cache", "return_dict", "output_attentions", "output_hidden_states",
    "torchscript", "use_bfloat16", "tf_legacy_loss", "id2label", "label2id", "problem_type",
    "finetuning_task", "task_specific_params", "tokenizer_class", "prefix",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "tie_encoder_decoder", "unk_token_id", "sep_token_id",
    "decoder_start_token_id", "max_length", "min_length", "do_sample", "early_stopping",
    "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
    "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "initializer_range", "pretraining_tp",
})
# Keys that are harmless only at these values (anything else changes the model and is refused).
# attention_dropout: transformers drops attention weights only in training; reclaim trains this
# model too and has no attention dropout, so only 0 is honoured. pruned_heads: none pruned.
HARMLESS_VALUES = {"attention_dropout": (0, 0.0), "pruned_heads": ({}, None)}
# Resolved into `sliding_window` by LlamaConfig.from_hf (Qwen's per-layer window switches).
WINDOW_KEYS = ("use_sliding_window", "max_window_layers", "layer_types")


@dataclass
class LlamaConfig:
    """Shape of a Llama-family decoder; field names are those of the HF config.json."""

    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # Every layer attends to the last `sliding_window` positions (None: all). from_hf resolves
    # Mistral's default (4096) and Qwen's use_sliding_window / max_window_layers into it.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: {sorted(ARCHITECTURES)}"
            )
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.model_type == "qwen2":
            self.attention_bias = True  # Qwen2 always has q/k/v biases (and none on o_proj)
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: ['silu']")
        if self.sliding_window is not None and (
            isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int)
            or self.sliding_window < 1
        ):
            raise ValueError(f"sliding_window={self.sliding_window!r}; allowed: an int >= 1 or None")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias and self.model_type != "qwen2"

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "LlamaConfig":
        """Build from a config.json dict. Other keys are kept in `extra` for the round trip when
        they cannot change the forward; one that would (at its value) is refused by name."""
        d = dict(d)
        rope = d.pop("rope_parameters", None)  # transformers >= 5 spelling of rope settings
        if rope and "rope_theta" in rope:
            d.setdefault("rope_theta", rope["rope_theta"])
            if rope.get("rope_type", "default") != "default":
                d.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
            elif set(rope) - {"rope_theta", "rope_type"}:
                raise ValueError(f"rope_parameters={rope!r}: default RoPE takes only rope_theta")
        if "dtype" in d:
            d.setdefault("torch_dtype", d.pop("dtype"))
        if d.get("rope_scaling") is not None and "type" in d["rope_scaling"]:
            d["rope_scaling"] = dict(d["rope_scaling"])
            d["rope_scaling"].setdefault("rope_type", d["rope_scaling"].pop("type"))
        names = set(cls.__dataclass_fields__) - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names}
        if "model_type" not in known:
            raise ValueError("config.json has no 'model_type'; cannot tell the architecture")
        refuse_unknown_keys(extra)
        known["sliding_window"] = resolve_sliding_window(d, cls.num_hidden_layers)
        return cls(**known, extra=extra)

    def to_hf(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        d = {**extra, **d}
        d["architectures"] = [ARCHITECTURES[self.model_type]]
        if self.model_type == "qwen2":
            d.pop("attention_bias")
        if self.model_type in ("qwen2", "qwen3") and self.sliding_window is not None:
            # Qwen's own switches, set so that transformers applies the window to every layer
            d.update(use_sliding_window=True, max_window_layers=0)
            d.pop("layer_types", None)
        return d


def refuse_unknown_keys(extra: dict[str, Any]) -> None:
    """Raise naming every config key the decoder does not implement at its value."""
    bad = {k: v for k, v in extra.items()
           if k not in HARMLESS_KEYS and k not in WINDOW_KEYS
           and not (k in HARMLESS_VALUES and v in HARMLESS_VALUES[k])}
    if bad:
        detail = ", ".join(f"{k}={v!r}" for k, v in sorted(bad.items()))
        raise ValueError(
            f"config.json sets {detail}, which reclaim's Llama-family decoder does not implement; "
            f"allowed at these values: {sorted(HARMLESS_VALUES)}, and any value of the fields of "
            "LlamaConfig and of the known-harmless keys (reclaim.models.llama.HARMLESS_KEYS)"
        )


def resolve_sliding_window(d: dict[str, Any], default_layers: int) -> int | None:
    """The one window every layer uses, as transformers would apply it for this config.json.

    Mistral's default is 4096 when the key is absent; Qwen2/3 use the window only with
    use_sliding_window, and then only on layers >= max_window_layers (or as `layer_types` says).
    A window on some layers but not others, or one Llama's transformers class would ignore, is
    refused rather than run differently.
    """
    kind = d["model_type"]
    window = d.get("sliding_window", 4096 if kind == "mistral" else None)
    layer_types = d.get("layer_types")
    if kind == "llama" and window is not None:
        raise ValueError(
            f"sliding_window={window!r} on model_type 'llama', whose transformers class ignores it; "
            "set it to null, or use model_type 'mistral' for a windowed model"
        )
    if kind in ("qwen2", "qwen3"):
        if not d.get("use_sliding_window", False):
            window = None
        elif window is not None and layer_types is None:
            n, first = d.get("num_hidden_layers", default_layers), d.get("max_window_layers", 28)
            if 0 < first < n:
                raise ValueError(
                    f"use_sliding_window=True with max_window_layers={first} of {n} layers puts a "
                    "window on some layers only; reclaim applies one attention kind to every layer"
                )
            window = window if first == 0 else None
        if window is not None and layer_types is not None and set(layer_types) == {"full_attention"}:
            window = None
    want = "full_attention" if window is None else "sliding_attention"
    if layer_types is not None and set(layer_types) != {want}:
        raise ValueError(
            f"layer_types={layer_types!r} with sliding_window={window!r}: reclaim applies one "
            f"attention kind to every layer, here {want!r}"
        )
    return window


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies, with the llama3 or linear scaling of `rope_scaling` applied."""
    d = cfg.head_dim
    # float32 as in transformers (checkpoints were trained with it); float64 drifts ~1e-4 in the logits
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
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
    """Rotate-half RoPE; x [B, H, T, D], cos/sin [B, 1, T, D]."""
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

    def forward(self, x, cos, sin, cache: AttentionCache | None, packing: Packing | None = None):
        """x [B, T, H], or [N, H] with `packing`: a ragged batch's real tokens only (the
        projections skip the padding; attention runs on the padded [B, T])."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if packing is not None:
            q, k, v = packing.pad(q), packing.pad(k), packing.pad(v)
        b, t, _ = q.shape
        q, k, v = q.view(b, t, self.nh, self.hd), k.view(b, t, self.nkv, self.hd), v.view(b, t, self.nkv, self.hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
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
        return self.o_proj(o if packing is None else packing.pack(o))


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

    def forward(self, x, cos, sin, cache, packing: Packing | None = None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, packing)
        return x + self.mlp(self.post_attention_layernorm(x))


class Packing(NamedTuple):
    """A ragged batch's real tokens: `index` [N] of the B*T padded positions. Every layer but
    attention runs on the N real tokens (a verify row of 8 beside decode rows of 1 costs 8 + 1
    tokens, not 16); attention pads them back."""

    index: torch.Tensor
    b: int
    t: int

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [N, ...]"""
        return x.reshape(self.b * self.t, *x.shape[2:]).index_select(0, self.index)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, T, ...], zeros at the padding."""
        out = x.new_zeros(self.b * self.t, *x.shape[1:]).index_copy_(0, self.index, x)
        return out.view(self.b, self.t, *x.shape[1:])


class Backbone(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
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
        real = getattr(cache, "src_idx", None)  # a paged view of ragged rows: its real tokens
        packing = None if real is None else Packing(real, b, t)
        x = self.model.embed_tokens(input_ids if packing is None else packing.pack(input_ids))
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        taps = {} if aux_layers is None else check_aux_layers(aux_layers, len(self.model.layers))
        for i, layer in enumerate(self.model.layers):
            if i in taps:
                taps[i] = x
            x = layer(x, cos, sin, cache, packing)
        hidden = self.model.norm(x)
        if packing is not None:
            hidden, taps = packing.pad(hidden), {i: packing.pad(h) for i, h in taps.items()}
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
