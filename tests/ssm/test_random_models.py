"""Shapes no other test uses: Mamba-2, Nemotron-H and Bamba models drawn at random (head counts, groups,
state sizes, kernels, biases, tied heads, layer patterns), each checked against the oracles: logits
against transformers with its math in float64, the exact adjoint's gradients against autograd at a
chunk that divides neither the sequence nor the SSD block, and a truncated window that covers the
sequence against the exact adjoint. The draw is seeded, so a failure names a config to rerun."""

import random

import pytest
import torch
from transformers import BambaConfig as HFBambaConfig
from transformers import BambaForCausalLM as HFBamba
from transformers import Mamba2Config as HFMamba2Config
from transformers import Mamba2ForCausalLM as HFMamba2
from transformers import NemotronHConfig as HFNemotronHConfig
from transformers import NemotronHForCausalLM as HFNemotronH

from ssm_helpers import grads, hf_pair, rel

from reclaim.models import ssd
from reclaim.models.bamba import BambaConfig, BambaForCausalLM
from reclaim.models.mamba2 import Mamba2Config, Mamba2ForCausalLM
from reclaim.models.nemotron_h import NemotronHConfig, NemotronHForCausalLM

pytestmark = pytest.mark.usefixtures("one_thread")

M, A, P = "linear_attention", "full_attention", "mlp"
SEEDS = range(4)


def _divisor(rng: random.Random, n: int) -> int:
    return rng.choice([d for d in range(1, n + 1) if n % d == 0])


def mamba2_config(seed: int) -> dict:
    rng = random.Random(seed)
    heads = rng.choice([2, 3, 4, 6])
    head_dim = rng.choice([2, 3, 5])
    expand = rng.choice([1, 2]) if heads * head_dim % 2 == 0 else 1  # heads * head_dim = expand * hidden
    return dict(vocab_size=rng.randint(20, 70), hidden_size=heads * head_dim // expand, state_size=rng.randint(2, 7),
                num_hidden_layers=rng.randint(1, 3), num_heads=heads, head_dim=head_dim, expand=expand,
                n_groups=_divisor(rng, heads), conv_kernel=rng.randint(2, 4), use_bias=rng.random() < 0.5,
                use_conv_bias=rng.random() < 0.5, tie_word_embeddings=rng.random() < 0.5,
                time_step_limit=rng.choice([(0.0, float("inf")), (0.02, 0.4)]), chunk_size=rng.randint(3, 9))


def nemotron_h_config(seed: int) -> dict:
    rng = random.Random(100 + seed)
    layers = [M, A] + [rng.choice([M, A, P]) for _ in range(rng.randint(1, 3))]
    rng.shuffle(layers)
    heads = rng.choice([2, 4, 6])
    mamba_heads = rng.choice([2, 3, 4, 6])
    return dict(vocab_size=rng.randint(20, 70), hidden_size=rng.choice([8, 12]), layers_block_type=layers,
                num_attention_heads=heads, num_key_value_heads=_divisor(rng, heads), head_dim=rng.choice([2, 3, 4]),
                intermediate_size=rng.randint(6, 20), ssm_state_size=rng.randint(2, 6), mamba_num_heads=mamba_heads,
                mamba_head_dim=rng.choice([2, 3]), n_groups=_divisor(rng, mamba_heads), conv_kernel=rng.randint(2, 4),
                use_bias=rng.random() < 0.5, mlp_bias=rng.random() < 0.5, tie_word_embeddings=rng.random() < 0.5,
                chunk_size=rng.randint(3, 9))


def bamba_config(seed: int) -> dict:
    rng = random.Random(200 + seed)
    layers = rng.randint(2, 4)
    heads = rng.choice([2, 4])
    mamba_heads = rng.choice([2, 4])
    return dict(vocab_size=rng.randint(20, 70), hidden_size=8 * rng.choice([1, 2]), num_hidden_layers=layers,
                attn_layer_indices=sorted(rng.sample(range(layers), rng.randint(1, layers - 1))),
                num_attention_heads=heads, num_key_value_heads=_divisor(rng, heads), intermediate_size=rng.randint(6, 20),
                mamba_n_heads=mamba_heads, mamba_n_groups=_divisor(rng, mamba_heads), mamba_d_state=rng.randint(2, 6),
                mamba_d_conv=rng.randint(2, 4), mamba_proj_bias=rng.random() < 0.5, attention_bias=rng.random() < 0.5,
                mlp_bias=rng.random() < 0.5, tie_word_embeddings=rng.random() < 0.5, mamba_chunk_size=rng.randint(3, 9),
                rope_parameters={"rope_type": "default", "rope_theta": rng.choice([100.0, 10000.0])})


FAMILIES = {
    "mamba2": (mamba2_config, HFMamba2Config, HFMamba2, Mamba2Config, Mamba2ForCausalLM),
    "nemotron_h": (nemotron_h_config, HFNemotronHConfig, HFNemotronH, NemotronHConfig, NemotronHForCausalLM),
    "bamba": (bamba_config, HFBambaConfig, HFBamba, BambaConfig, BambaForCausalLM),
}


def _pair(family: str, seed: int):
    draw, hf_config, hf_model, config, model = FAMILIES[family]
    kw = draw(seed)
    return (kw, *hf_pair(hf_config, hf_model, config, model, kw, seed))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", SEEDS)
def test_random_model_logits_equal_transformers(family, seed, float64_transformers):
    kw, hf, ours = _pair(family, seed)
    ids = torch.randint(0, kw["vocab_size"], (2, 29))
    float64_transformers()
    with torch.no_grad():
        assert rel(ours(ids).logits, hf(ids).logits) <= 1e-10, kw


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", SEEDS)
def test_random_model_adjoint_equals_autograd(family, seed, monkeypatch):
    monkeypatch.setattr(ssd, "CPU_MAX_BLOCK", 4)  # several SSD blocks inside a chunk
    kw, _, model = _pair(family, seed)
    ids = torch.randint(0, kw["vocab_size"], (2, 23))
    ref_loss, ref = grads(model, ids)
    chunk = random.Random(seed).choice([5, 6, 7, 9, 10])  # divides neither 23 nor the block of 4
    loss, got = grads(model, ids, chunk=chunk)
    assert abs(loss - ref_loss) <= 1e-12 * ref_loss
    assert max(rel(got[n], ref[n]) for n in ref if ref[n].abs().max() > 0) <= 1e-9, (kw, chunk)
    _, covered = grads(model, ids, chunk=chunk, window=23)
    assert max(rel(covered[n], ref[n]) for n in ref if ref[n].abs().max() > 0) <= 1e-9, (kw, chunk)
