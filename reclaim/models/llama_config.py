"""The Llama-family config and its config.json: `LlamaConfig`, to and from the HF dict, and which
keys outside its fields are refused (those that would change the forward) or kept for the round trip.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

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
# use_mrope: Qwen2.5's config.json says false (multimodal RoPE is Qwen2-VL's).
HARMLESS_VALUES = {"attention_dropout": (0, 0.0), "pruned_heads": ({}, None), "use_mrope": (False, None)}
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
            "LlamaConfig and of the known-harmless keys (reclaim.models.llama_config.HARMLESS_KEYS)"
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
