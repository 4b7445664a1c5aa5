"""Mamba-1 LM: same logits as transformers, checkpoint layouts both ways, stateful generation."""

import json

import pytest
import torch
from transformers import MambaConfig as HFMambaConfig
from transformers import MambaForCausalLM as HFMamba

from reclaim.models.mamba import (
    MambaConfig,
    MambaForCausalLM,
    hf_to_mamba_ssm_keys,
    load_mamba,
    mamba_ssm_to_hf_keys,
    save_mamba,
)

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = [
    dict(vocab_size=97, hidden_size=32, state_size=8, num_hidden_layers=2),
    dict(vocab_size=61, hidden_size=24, state_size=4, num_hidden_layers=3, expand=3, conv_kernel=3,
         time_step_rank=5, use_bias=True, use_conv_bias=False),
    dict(vocab_size=50, hidden_size=16, state_size=16, num_hidden_layers=1, conv_kernel=2,
         tie_word_embeddings=False),
]


def _pair(kw):
    hf = HFMamba(HFMambaConfig(**kw, use_cache=False)).eval()
    with torch.no_grad():  # random, non-trivial values everywhere (incl. norms, D, biases)
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ours = MambaForCausalLM(MambaConfig.from_hf(hf.config.to_dict()))
    ours.load_state_dict(hf.state_dict())
    return hf, ours


@pytest.mark.parametrize("kw", CONFIGS)
def test_logits_match_transformers(kw):
    hf, ours = _pair(kw)
    ids = torch.randint(0, kw["vocab_size"], (2, 37))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids).logits
    assert (got - ref).abs().max().item() <= 1e-4


def test_gradients_match_transformers():
    hf, ours = _pair(CONFIGS[1])
    ids = torch.randint(0, 61, (1, 23))
    hf.train()
    hf(ids, labels=ids).loss.backward()
    logits = ours(ids).logits
    torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
    ref = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        err = (p.grad - ref[name].grad).abs().max() / ref[name].grad.abs().max()
        assert err <= 1e-4, name


def test_chunked_forward_with_state_equals_full():
    _, ours = _pair(CONFIGS[1])
    ids = torch.randint(0, 61, (2, 30))
    with torch.no_grad():
        full = ours(ids)
        a = ours(ids[:, :11])
        b = ours(ids[:, 11:12], a.states)
        c = ours(ids[:, 12:], b.states)
    got = torch.cat([a.logits, b.logits, c.logits], 1)
    assert (got - full.logits).abs().max().item() <= 1e-5
    for s, f in zip(c.states, full.states):
        assert torch.allclose(s.h, f.h, atol=1e-5) and torch.allclose(s.conv, f.conv)


def test_generate_equals_full_forward_argmax():
    _, ours = _pair(CONFIGS[0])
    ids = torch.randint(0, 97, (2, 5))
    out = ours.generate(ids, max_new_tokens=12)
    seq = ids
    with torch.no_grad():
        for _ in range(12):
            nxt = ours(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)


def test_config_round_trips():
    hf_cfg = HFMambaConfig(vocab_size=100, hidden_size=48, state_size=8, num_hidden_layers=3,
                           expand=2, conv_kernel=3, time_step_rank=7)
    cfg = MambaConfig.from_hf(hf_cfg.to_dict())
    assert cfg.intermediate_size == hf_cfg.intermediate_size and cfg.dt_rank == 7
    back = HFMambaConfig(**cfg.to_hf())
    for k in ("vocab_size", "hidden_size", "state_size", "num_hidden_layers", "conv_kernel",
              "time_step_rank", "intermediate_size", "layer_norm_epsilon", "tie_word_embeddings"):
        assert getattr(back, k) == getattr(hf_cfg, k), k
    assert MambaConfig.from_mamba_ssm(cfg.to_mamba_ssm()) == MambaConfig(**{
        **{k: getattr(cfg, k) for k in cfg.__dataclass_fields__ if k != "extra"}})


def test_mamba_ssm_config_pads_vocab_and_rejects_hybrids():
    raw = {"d_model": 64, "n_layer": 2, "vocab_size": 50277, "ssm_cfg": {}, "rms_norm": True,
           "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 8,
           "tie_embeddings": True}
    cfg = MambaConfig.from_mamba_ssm(raw)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.dt_rank) == (50280, 64, 2, 4)
    with pytest.raises(ValueError, match="Mamba1"):
        MambaConfig.from_mamba_ssm({**raw, "ssm_cfg": {"layer": "Mamba2"}})
    with pytest.raises(ValueError, match="RMSNorm"):
        MambaConfig.from_mamba_ssm({**raw, "rms_norm": False})


def test_key_maps_round_trip():
    _, ours = _pair(CONFIGS[2])
    state = ours.state_dict()
    ssm = hf_to_mamba_ssm_keys(state)
    assert "backbone.embedding.weight" in ssm and "backbone.embeddings.weight" not in ssm
    assert "backbone.layers.0.mixer.A_log" in ssm and "backbone.norm_f.weight" in ssm
    back = mamba_ssm_to_hf_keys(ssm)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize("layout", ["hf", "mamba_ssm"])
def test_save_load_round_trip(tmp_path, layout):
    hf, ours = _pair(CONFIGS[0])
    save_mamba(ours, tmp_path / "m", layout=layout)
    conf = json.loads((tmp_path / "m" / "config.json").read_text())
    assert ("d_model" in conf) == (layout == "mamba_ssm")
    back = load_mamba(tmp_path / "m")
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, ours(ids).logits)


def test_loads_a_transformers_saved_dir(tmp_path):
    hf, _ = _pair(CONFIGS[1])
    hf.save_pretrained(tmp_path / "hf")
    ours = load_mamba(tmp_path / "hf")
    ids = torch.randint(0, 61, (1, 9))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() <= 1e-4
