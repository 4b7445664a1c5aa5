"""Tiny random checkpoints of each supported family, written by transformers as the oracle."""

from pathlib import Path

import pytest
import torch

# One entry per property the decoder must get right; each is a transformers config.
TINY = dict(vocab_size=96, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=256)
FAMILIES = {
    # llama3 RoPE scaling with all three frequency bands present in a 12-dim head
    "llama3-gqa-untied": dict(
        model_type="llama", num_key_value_heads=2, tie_word_embeddings=False, rope_theta=5000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama-mha-tied": dict(model_type="llama", num_key_value_heads=4, tie_word_embeddings=True),
    "mistral-gqa": dict(model_type="mistral", num_key_value_heads=2, sliding_window=None),
    "qwen2-bias-tied": dict(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3-qknorm": dict(model_type="qwen3", num_key_value_heads=1, head_dim=16, tie_word_embeddings=False),
}


def randomize(model: torch.nn.Module) -> None:
    """Weights far from init (norm scales around 1, nonzero biases) so every parameter matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)


def make_hf_model(family: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(FAMILIES[family])
    config = AutoConfig.for_model(spec.pop("model_type"), **TINY, **spec)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    return model.eval()


@pytest.fixture
def tiny_hf():
    """make_hf_model, for tests that build their own tiny transformers models."""
    return make_hf_model


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture
def tiny_dir(family: str, tmp_path: Path, one_thread):
    """(directory written by transformers' save_pretrained, the transformers model) for `family`."""
    hf = make_hf_model(family)
    path = tmp_path / family
    hf.save_pretrained(path)
    return path, hf
