"""Read a Llama GGUF file (the default model's) into an HF config dict and float32 HF-named tensors.

transformers' GGUF loader reads the file twice through `gguf`'s Python reader (which parses the
49K-entry vocabulary field by field) and rebuilds its tensor-name map once per tensor, most of a
first run's conversion. This reads it once: the header, the metadata, the tensor table, then
each tensor from a memory map, dequantized with numpy (the result is bit-identical to
transformers', tests/models/test_gguf.py).

The layout (ggml's GGUF v2/v3): magic "GGUF", version, tensor and key counts; keys with typed
values; per tensor its name, dims (fastest first), ggml type and offset into the data section,
which starts at the next multiple of `general.alignment` (32 by default). Types read here: F32,
F16, Q8_0 (blocks of 32: an f16 scale and 32 int8) and Q4_1 (blocks of 32: f16 scale d and
minimum m, 16 bytes of nibbles, low nibbles the first 16 values, x = d * q + m). llama.cpp stores
the q and k projections permuted for its rotary layout; they are permuted back to HF's.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
F32, F16, Q4_1, Q8_0 = 0, 1, 3, 8
_BLOCK = {Q4_1: (32, 20), Q8_0: (32, 34)}  # values per block, bytes per block


def _read(f: BinaryIO, fmt: str) -> Any:
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def _string(f: BinaryIO) -> str:
    return f.read(_read(f, "<Q")).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int) -> Any:
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item, n = _read(f, "<I"), _read(f, "<Q")
        if item == _STRING:
            return [_string(f) for _ in range(n)]
        if item in _SCALAR:
            fmt = _SCALAR[item]
            return list(np.frombuffer(f.read(n * struct.calcsize(fmt)), dtype=np.dtype(fmt)))
        return [_value(f, item) for _ in range(n)]
    if kind not in _SCALAR:
        raise ValueError(f"GGUF value type {kind} is not one of {sorted([*_SCALAR, _STRING, _ARRAY])}")
    return _read(f, _SCALAR[kind])


def read_header(path: Path) -> tuple[dict[str, Any], list[tuple[str, list[int], int, int]], int]:
    """(metadata, [(name, dims fastest first, ggml type, offset)], data section start)."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{str(path)!r} is not a GGUF file (no 'GGUF' magic)")
        version = _read(f, "<I")
        if version not in (2, 3):
            raise ValueError(f"{str(path)!r}: GGUF version {version}; allowed: 2, 3")
        n_tensors, n_keys = _read(f, "<Q"), _read(f, "<Q")
        meta = {}
        for _ in range(n_keys):
            key = _string(f)
            meta[key] = _value(f, _read(f, "<I"))
        tensors = []
        for _ in range(n_tensors):
            name = _string(f)
            dims = [_read(f, "<Q") for _ in range(_read(f, "<I"))]
            tensors.append((name, dims, _read(f, "<I"), _read(f, "<Q")))
        align = int(meta.get("general.alignment", 32))
        start = -(-f.tell() // align) * align
    return meta, tensors, start


def _dequantize(raw: np.ndarray, kind: int, count: int) -> np.ndarray:
    if kind == F32:
        return raw.view(np.float32)[:count].copy()
    if kind == F16:
        return raw.view(np.float16)[:count].astype(np.float32)
    if kind not in _BLOCK:
        raise ValueError(f"GGUF tensor type {kind}; this reader dequantizes F32, F16, Q4_1 and Q8_0")
    size, nbytes = _BLOCK[kind]
    blocks = raw[: count // size * nbytes].reshape(-1, nbytes)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    if kind == Q8_0:
        return (d * blocks[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    return (d * q + m).reshape(-1)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary permutation of a q or k projection [heads * dim, in], undone."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (a Llama's tensors)."""
    base, _, suffix = name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _NAMES:
        return f"model.layers.{parts[1]}.{_NAMES[parts[2]]}.{suffix}"
    if base in _TOP:
        return f"{_TOP[base]}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r} is not one of a Llama's ({sorted(_TOP)}, blk.N.{sorted(_NAMES)})")


def llama_config(meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """The HF config.json fields of a GGUF Llama's metadata (`names`: its HF tensor names)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r}; this reader converts 'llama'")
    g = lambda key: meta[f"llama.{key}"]  # noqa: E731
    heads, hidden = int(g("attention.head_count")), int(g("embedding_length"))
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": int(meta["llama.vocab_size"] if "llama.vocab_size" in meta
                          else len(meta["tokenizer.ggml.tokens"])),
        "hidden_size": hidden, "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(g("context_length")),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "lm_head.weight" not in names,
        # transformers' LlamaConfig defaults, which its GGUF loader writes too
        "attention_dropout": 0.0, "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True,
    }
    for key in ("bos", "eos", "unknown", "padding"):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            name = {"unknown": "unk", "padding": "pad"}.get(key, key)
            cfg[f"{name}_token_id"] = int(meta[f"tokenizer.ggml.{key}_token_id"])
    return cfg


def read_llama(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The HF config dict and float32 tensors (HF names, HF layout) of a Llama GGUF file."""
    meta, table, start = read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    names = {hf_name(name) for name, *_ in table}
    cfg = llama_config(meta, names)
    tensors = {}
    for name, dims, kind, offset in table:
        count = int(np.prod(dims))
        size, nbytes = _BLOCK.get(kind, (1, {F32: 4, F16: 2}.get(kind, 0)))
        raw = np.asarray(data[start + offset: start + offset + count // size * nbytes])
        w = _dequantize(raw, kind, count).reshape(list(reversed(dims)))
        key = hf_name(name)
        if key.endswith("q_proj.weight"):
            w = _unpermute(w, cfg["num_attention_heads"])
        elif key.endswith("k_proj.weight"):
            w = _unpermute(w, cfg["num_key_value_heads"])
        tensors[key] = w
    return cfg, tensors
