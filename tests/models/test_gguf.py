"""reclaim's GGUF reader (models/gguf.py) against transformers' GGUF loader: the same config and
bit-identical float32 tensors, on a tiny Llama written with `gguf`'s own writer in every tensor
type it reads (F32, F16, Q8_0, Q4_1), and (slow) on the default model's file."""

import numpy as np
import pytest
import torch

from reclaim.models.gguf import read_llama
from reclaim.models.llama_config import LlamaConfig

HEADS, KV, HIDDEN, FF, LAYERS, VOCAB = 4, 2, 64, 96, 2, 128


def _write_tiny(path, types) -> None:
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,), "output.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        head = HIDDEN // HEADS
        shapes |= {f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                   f"blk.{i}.attn_q.weight": (HEADS * head, HIDDEN), f"blk.{i}.attn_k.weight": (KV * head, HIDDEN),
                   f"blk.{i}.attn_v.weight": (KV * head, HIDDEN), f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
                   f"blk.{i}.ffn_gate.weight": (FF, HIDDEN), f"blk.{i}.ffn_up.weight": (FF, HIDDEN),
                   f"blk.{i}.ffn_down.weight": (HIDDEN, FF)}
    for n, (name, shape) in enumerate(shapes.items()):
        x = rng.standard_normal(shape).astype(np.float32)
        kind = T.F32 if len(shape) == 1 else types[n % len(types)]
        data = x if kind == T.F32 else quants.quantize(x, kind)
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _transformers(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """transformers' GGUF load, and the config.json reclaim wrote from it before its own reader:
    transformers' config less what describes the load and the generic defaults, as our LlamaConfig."""
    from transformers import AutoModelForCausalLM, PretrainedConfig

    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True,
                                              dtype=torch.float32)
    drop = ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version")
    raw = {k: v for k, v in hf.config.to_dict().items() if k not in drop}
    generic, ours = PretrainedConfig().to_dict(), set(LlamaConfig.__dataclass_fields__)
    raw = {k: v for k, v in raw.items() if k in ours or k not in generic or v != generic[k]}
    return LlamaConfig.from_hf(raw).to_hf(), hf.state_dict()


def _same(path) -> None:
    cfg, ours = read_llama(path)
    want_cfg, want = _transformers(path)
    if cfg["tie_word_embeddings"]:
        want.pop("lm_head.weight")  # the embedding's, tied
    assert set(ours) == set(want)
    for k, v in ours.items():
        assert torch.equal(torch.from_numpy(np.ascontiguousarray(v)), want[k]), k
    got = LlamaConfig.from_hf(cfg).to_hf()
    assert got.pop("torch_dtype") is None and want_cfg.pop("torch_dtype") == "float32"  # set from the weights on write
    assert got == want_cfg


def test_a_tiny_llama_in_every_type_reads_as_transformers_reads_it(tmp_path):
    from gguf import GGMLQuantizationType as T

    path = tmp_path / "tiny.gguf"
    _write_tiny(path, [T.Q4_1, T.Q8_0, T.F16, T.F32])
    _same(path)


def test_what_it_cannot_read_is_refused_by_name(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(32))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_llama(bad)
    from gguf import GGMLQuantizationType as T

    q4_0 = tmp_path / "q4_0.gguf"
    _write_tiny(q4_0, [T.Q4_0])
    with pytest.raises(ValueError, match="GGUF tensor type 2; this reader dequantizes F32, F16, Q4_1 and Q8_0"):
        read_llama(q4_0)


@pytest.mark.slow
def test_the_default_model_reads_as_transformers_reads_it():
    from reclaim.models.loading import default_gguf

    _same(default_gguf())
