"""The KV cache gets what it is given: as many blocks as the budget holds (never more), a clear
error when the budget cannot hold one full-length sequence, and a model that does not fit the
device is refused from its headers, before a weight is read."""

import pytest
import torch

from reclaim.engine import memory
from reclaim.engine.kv_cache import GIB, KVPool, plan_kv_blocks
from reclaim.engine.memory import check_fits, free_memory, weight_bytes
from reclaim.models.llama import LlamaConfig, LlamaForCausalLM
from reclaim.models.loading import save_model

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V x layers x K/V heads x head_dim x float32 bytes


def plan(kv_cache_bytes, max_model_len=256, max_num_seqs=8, dtype=torch.float32):
    return plan_kv_blocks(CFG, kv_cache_bytes=kv_cache_bytes, block_size=16,
                          max_model_len=max_model_len, max_num_seqs=max_num_seqs, dtype=dtype)


def test_blocks_fill_the_budget_and_never_exceed_it():
    assert KVPool.bytes_per_token(2, 2, 16, torch.float32) == PER_TOKEN
    budget = 40 * 16 * PER_TOKEN + PER_TOKEN  # 40 blocks and a token: the token is not rounded up
    assert plan(budget) == 40
    assert plan(budget, dtype=torch.bfloat16) == 80  # half the bytes per token: 1282 tokens, 80 blocks
    # more than max_num_seqs full sequences could use is not allocated
    assert plan(GIB, max_num_seqs=8) == 8 * 256 // 16


def test_a_budget_below_one_full_sequence_is_an_error_naming_the_sizes():
    one_seq = 256 * PER_TOKEN
    assert plan(one_seq) == 16
    with pytest.raises(ValueError) as e:
        plan(one_seq - 1)
    msg = str(e.value)
    assert f"budget of {one_seq - 1} bytes" in msg and f"{PER_TOKEN} bytes per token" in msg
    assert f"needs {one_seq} bytes" in msg and "max_model_len=256" in msg
    assert "max_model_len of at most 240" in msg  # what this budget does hold, in whole blocks


@pytest.fixture
def tiny_dir(tmp_path):
    model = LlamaForCausalLM(CFG)
    return save_model(model, None, tmp_path / "tiny"), model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_from_headers_equal_the_loaded_model(tiny_dir, dtype):
    path, model = tiny_dir
    loaded = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    assert weight_bytes(path, dtype) == loaded


def test_free_memory_is_known_on_the_cpu():
    free = free_memory("cpu")
    assert free is not None and 0 < free


def test_a_model_too_big_for_the_device_is_refused_with_the_sizes(tiny_dir, monkeypatch):
    path, model = tiny_dir
    args = dict(dtype=torch.float32, device="cpu", kv_cache_bytes=GIB, block_size=16,
                max_model_len=256, max_num_seqs=1)
    fits = check_fits(path, CFG, **args)
    assert fits.kv_bytes == 256 * PER_TOKEN and fits.weight_bytes == weight_bytes(path, torch.float32)
    monkeypatch.setattr(memory, "free_memory", lambda device: fits.weight_bytes + fits.kv_bytes - 1)
    with pytest.raises(ValueError, match=r"does not fit on cpu: weights .* \+ KV cache .* GiB is free"):
        check_fits(path, CFG, **args)
    # weights and one sequence fit; a budget for more sequences does not: lower it
    monkeypatch.setattr(memory, "free_memory", lambda device: fits.weight_bytes + fits.kv_bytes)
    with pytest.raises(ValueError, match="lower the KV cache memory"):
        check_fits(path, CFG, **{**args, "max_num_seqs": 4})
