"""Bamba (Mamba-2 or attention with partial RoPE, each followed by a SwiGLU MLP): the same logits
as transformers (float64), state carried token by token, checkpoints both ways, the exact adjoint
equal to autograd for every parameter, a covering truncation window exact, bad configs refused
by name."""

import json

import pytest
import torch

from ssm_helpers import grads, hf_pair, rel

from reclaim.models import ssd
from reclaim.models.bamba import BambaConfig, BambaForCausalLM, load_bamba, save_bamba
from reclaim.models.ssm import load_ssm

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = [
    dict(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
         num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=4,
         mamba_d_conv=3, mamba_chunk_size=8),
    dict(vocab_size=37, hidden_size=12, intermediate_size=20, num_hidden_layers=4, num_attention_heads=3,
         num_key_value_heads=3, attn_layer_indices=[0, 3], mamba_n_heads=6, mamba_n_groups=3, mamba_d_state=3,
         mamba_expand=1, mamba_proj_bias=True, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
         time_step_limit=(0.01, 0.5), rope_parameters={"rope_type": "default", "rope_theta": 500.0}, mamba_chunk_size=5),
]


def _hf():
    """transformers' Bamba classes, imported by the tests that use them: importing its modeling
    module pulls in sympy and botocore (2 s, 500 modules), in each test worker's collection."""
    from transformers import BambaConfig as HFBambaConfig
    from transformers import BambaForCausalLM as HFBamba

    return HFBambaConfig, HFBamba


def _pair(kw, dtype=torch.float64):
    return hf_pair(*_hf(), BambaConfig, BambaForCausalLM, kw, dtype=dtype)


@pytest.mark.parametrize("kw", CONFIGS)
def test_logits_match_transformers_float64(kw, float64_transformers):
    hf, ours = _pair(kw)
    ids = torch.randint(0, kw["vocab_size"], (2, 41))
    with torch.no_grad():
        got = ours(ids).logits
        assert rel(got, hf(ids).logits.double()) <= 1e-6  # transformers as is: parts in float32
        float64_transformers()
        assert rel(got, hf(ids).logits) <= 1e-12


def test_parameter_names_are_transformers():
    hf, ours = _pair(CONFIGS[0])
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in hf.state_dict().items()}


def test_carried_state_equals_the_whole_sequence():
    _, ours = _pair(CONFIGS[0])
    ids = torch.randint(0, 50, (2, 14))
    with torch.no_grad():
        full = ours(ids).logits
        out = ours(ids[:, :8])
        got = [out.logits]
        for t in range(8, 14):  # the attention layer's keys rotated at their own positions
            out = ours(ids[:, t:t + 1], out.states)
            got.append(out.logits)
    assert out.states[1].k.shape == (2, 2, 14, 4)
    assert rel(torch.cat(got, 1), full) <= 1e-12


def test_save_loads_in_transformers_and_back(tmp_path):
    hf, ours = _pair(CONFIGS[1])
    save_bamba(ours, tmp_path / "m")
    conf = json.loads((tmp_path / "m" / "config.json").read_text())
    assert conf["architectures"] == ["BambaForCausalLM"] and conf["attn_layer_indices"] == [0, 3]
    theirs = _hf()[1].from_pretrained(tmp_path / "m", dtype=torch.float64, local_files_only=True).eval()
    ids = torch.randint(0, 37, (1, 19))
    with torch.no_grad():
        ref = ours(ids).logits
        assert rel(theirs(ids).logits.double(), ref) <= 1e-6
        hf.save_pretrained(tmp_path / "hf")
        back = load_ssm(tmp_path / "hf")
        assert isinstance(back, BambaForCausalLM) and back.config.rope_parameters["rope_theta"] == 500.0
        assert back.lm_head.weight is back.model.embed_tokens.weight
        assert rel(back(ids).logits, ref) <= 1e-12
        assert torch.equal(load_bamba(tmp_path / "m")(ids).logits, ref)


@pytest.mark.parametrize("kw", CONFIGS)
def test_exact_adjoint_equals_autograd_for_every_parameter(kw, monkeypatch):
    monkeypatch.setattr(ssd, "CPU_MAX_BLOCK", 4)  # several SSD blocks inside a chunk
    _, model = _pair(kw)
    ids = torch.randint(0, kw["vocab_size"], (2, 23))
    ref_loss, ref = grads(model, ids)
    # a dt clamped by time_step_limit everywhere passes no gradient to its dt_bias: exactly 0 then
    zero = {n for n, g in ref.items() if g.abs().max() == 0}
    assert zero <= {n for n in ref if n.endswith("dt_bias")}

    def err(got):
        assert all(got[n].abs().max() == 0 for n in zero)
        return max(rel(got[n], ref[n]) for n in ref if n not in zero)

    for chunk in (7, 10):  # divide neither 23 nor the SSD block
        loss, got = grads(model, ids, chunk=chunk)
        assert abs(loss - ref_loss) <= 1e-12 * ref_loss
        assert err(got) <= 1e-9, chunk
    assert err(grads(model, ids, chunk=7, window=23)[1]) <= 1e-9


def test_bad_configs_are_refused_by_name():
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'"):
        BambaConfig(hidden_act="gelu")
    with pytest.raises(ValueError, match=r"mamba_n_heads \(6\) must be a multiple of mamba_n_groups \(4\)"):
        BambaConfig(hidden_size=12, mamba_n_heads=6, mamba_n_groups=4)
    with pytest.raises(ValueError, match=r"attn_layer_indices \[5\] are not layers of a 4-layer model"):
        BambaConfig(num_hidden_layers=4, attn_layer_indices=[5])
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        BambaConfig.from_hf({"model_type": "bamba", "rope_parameters": {"rope_type": "yarn"}})
    with pytest.raises(ValueError, match="model_type 'mamba2' is not a Bamba config"):
        BambaConfig.from_hf({"model_type": "mamba2"})
