"""Nemotron-H hybrid (Mamba-2, attention, MLP layers): same logits as transformers (float64), state
carried across calls, checkpoints both ways, unsupported layer types refused by name."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import NemotronHConfig as HFNemotronHConfig
from transformers import NemotronHForCausalLM as HFNemotronH

from reclaim.models.hf import hf_forward
from reclaim.models.nemotron_h import NemotronHConfig, NemotronHForCausalLM, load_nemotron_h, save_nemotron_h
from reclaim.models.ssm import load_ssm

pytestmark = pytest.mark.usefixtures("one_thread")

M, A, P = "linear_attention", "full_attention", "mlp"
CONFIGS = [
    dict(vocab_size=50, hidden_size=16, layers_block_type=[M, A, P, M], num_attention_heads=4,
         num_key_value_heads=2, head_dim=4, intermediate_size=24, ssm_state_size=4, mamba_num_heads=6,
         mamba_head_dim=4, n_groups=2, chunk_size=8),
    dict(vocab_size=37, hidden_size=12, layers_block_type=[A, M, M, P, A], num_attention_heads=3,
         num_key_value_heads=3, head_dim=5, intermediate_size=10, ssm_state_size=3, mamba_num_heads=4,
         mamba_head_dim=2, n_groups=4, conv_kernel=3, use_bias=True, mlp_bias=True,
         time_step_limit=(0.01, 0.5), tie_word_embeddings=True, chunk_size=5),
]


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _pair(kw, dtype=torch.float64):
    torch.manual_seed(0)
    hf = HFNemotronH(HFNemotronHConfig(**kw, use_cache=False)).to(dtype).eval()
    with torch.no_grad():  # random, non-trivial values everywhere
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ours = NemotronHForCausalLM(NemotronHConfig.from_hf(hf.config.to_dict())).to(dtype)
    ours.load_state_dict(hf.state_dict())
    return hf, ours


@pytest.mark.parametrize("kw", CONFIGS)
def test_logits_match_transformers_float64(kw, float64_transformers):
    hf, ours = _pair(kw)
    ids = torch.randint(0, kw["vocab_size"], (2, 41))
    with torch.no_grad():
        got = ours(ids).logits
        assert rel(got, hf(ids).logits.double()) <= 1e-6  # transformers as is: its norms in float32
        float64_transformers()
        assert rel(got, hf(ids).logits) <= 1e-12


def test_parameter_names_are_transformers():
    hf, ours = _pair(CONFIGS[0])
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in hf.state_dict().items()}


def test_carried_state_and_decode_match_transformers_cache(float64_transformers):
    hf, ours = _pair(CONFIGS[0])
    ids = torch.randint(0, 50, (2, 14))
    float64_transformers()
    with torch.no_grad():
        full = ours(ids).logits
        out = ours(ids[:, :8])
        got, (r, cache) = [out.logits], hf_forward(hf, ids[:, :8])
        ref = [r]
        for t in range(8, 14):
            out = ours(ids[:, t:t + 1], out.states)
            got.append(out.logits)
            r, cache = hf_forward(hf, ids[:, t:t + 1], cache=cache)
            ref.append(r)
    assert out.states[1].k.shape == (2, 2, 14, 4)  # the attention layer's keys: every token so far
    assert rel(torch.cat(got, 1), full) <= 1e-12
    # hf_forward hands logits back in float32
    assert rel(torch.cat(got, 1), torch.cat(ref, 1).double()) <= 1e-6


def test_save_loads_in_transformers_and_back(tmp_path):
    hf, ours = _pair(CONFIGS[1])
    save_nemotron_h(ours, tmp_path / "m")
    with safe_open(tmp_path / "m" / "model.safetensors", "pt") as f:  # named as transformers writes
        assert "backbone.layers.0.mixer.q_proj.weight" in f.keys() and "lm_head.weight" in f.keys()
    conf = json.loads((tmp_path / "m" / "config.json").read_text())
    assert conf["architectures"] == ["NemotronHForCausalLM"] and conf["layers_block_type"][0] == A
    theirs = HFNemotronH.from_pretrained(tmp_path / "m", dtype=torch.float64, local_files_only=True).eval()
    ids = torch.randint(0, 37, (1, 19))
    with torch.no_grad():
        ref = ours(ids).logits
        assert rel(theirs(ids).logits.double(), ref) <= 1e-6
        hf.save_pretrained(tmp_path / "hf")
        back = load_ssm(tmp_path / "hf")
        assert isinstance(back, NemotronHForCausalLM) and back.config.time_step_limit == (0.01, 0.5)
        assert rel(back(ids).logits, ref) <= 1e-12
        assert torch.equal(load_nemotron_h(tmp_path / "m")(ids).logits, ref)


def test_legacy_pattern_and_unsupported_layers():
    cfg = NemotronHConfig.from_hf({"model_type": "nemotron_h", "hybrid_override_pattern": "M*-M",
                                   "hidden_size": 8, "mamba_num_heads": 4, "mamba_head_dim": 4, "n_groups": 2})
    assert cfg.layers_block_type == [M, A, P, M] and cfg.num_hidden_layers == 4
    with pytest.raises(ValueError, match=r"unsupported layer types \['moe'\]; supported: .*'linear_attention'"):
        NemotronHConfig.from_hf({"model_type": "nemotron_h", "hybrid_override_pattern": "ME"})
    with pytest.raises(ValueError, match="unsupported mlp_hidden_act 'gelu'"):
        NemotronHConfig(mlp_hidden_act="gelu")
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) must be a multiple of num_key_value_heads \(4\)"):
        NemotronHConfig(num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(ValueError, match=r"mamba_num_heads \(6\) must be a multiple of n_groups \(4\)"):
        NemotronHConfig(mamba_num_heads=6, n_groups=4)
