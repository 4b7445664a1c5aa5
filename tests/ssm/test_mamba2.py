"""Mamba-2 LM: same logits as transformers (float64), state carried across calls, checkpoints both
ways, one loader for every SSM family."""

import json

import pytest
import torch
from transformers import Mamba2Config as HFMamba2Config
from transformers import Mamba2ForCausalLM as HFMamba2

from reclaim.models.hf import hf_forward
from reclaim.models.mamba import MambaConfig, MambaForCausalLM, save_mamba
from reclaim.models.mamba2 import Mamba2Config, Mamba2ForCausalLM, load_mamba2, save_mamba2
from reclaim.models.ssd import ssd_scan, ssd_scan_ref
from reclaim.models.ssm import load_ssm

pytestmark = pytest.mark.usefixtures("one_thread")

# Heads 8 in 2 groups; 6 heads in 3 groups with biases, a short kernel, dt limits and a tied head;
# one group, one layer. transformers' SSD block (chunk_size) is chosen to differ from ours.
CONFIGS = [
    dict(vocab_size=67, hidden_size=16, state_size=6, num_hidden_layers=2, num_heads=8, head_dim=4,
         n_groups=2, chunk_size=8),
    dict(vocab_size=53, hidden_size=12, state_size=4, num_hidden_layers=3, num_heads=6, head_dim=6,
         expand=3, n_groups=3, conv_kernel=3, use_bias=True, use_conv_bias=True,
         time_step_limit=(0.02, 0.3), tie_word_embeddings=True, chunk_size=5),
    dict(vocab_size=40, hidden_size=8, state_size=8, num_hidden_layers=1, num_heads=4, head_dim=4,
         n_groups=1, conv_kernel=2, use_conv_bias=False, chunk_size=16),
]


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _pair(kw, dtype=torch.float64):
    torch.manual_seed(0)
    hf = HFMamba2(HFMamba2Config(**kw, use_cache=False)).to(dtype).eval()
    with torch.no_grad():  # random, non-trivial values everywhere (norms, D, dt_bias, biases)
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ours = Mamba2ForCausalLM(Mamba2Config.from_hf(hf.config.to_dict())).to(dtype)
    ours.load_state_dict(hf.state_dict())
    return hf, ours


@pytest.mark.parametrize("kw", CONFIGS)
def test_logits_match_transformers_float64(kw):
    hf, ours = _pair(kw)
    ids = torch.randint(0, kw["vocab_size"], (2, 37))
    with torch.no_grad():
        ref = hf(ids).logits.double()
        got = ours(ids).logits
    assert got.dtype == torch.float64
    assert rel(got, ref) <= 1e-6


@pytest.mark.parametrize("kw", CONFIGS)
def test_logits_equal_transformers_math_in_float64_throughout(kw, float64_transformers):
    hf, ours = _pair(kw)
    ids = torch.randint(0, kw["vocab_size"], (3, 70))
    with torch.no_grad():
        got = ours(ids).logits
        float64_transformers()
        ref = hf(ids).logits
    assert ref.dtype == torch.float64
    assert rel(got, ref) <= 1e-12


@pytest.mark.parametrize("float64_throughout,tol", [(False, 1e-5), (True, 1e-10)])
def test_gradients_match_transformers_autograd(float64_throughout, tol, float64_transformers):
    """As is, transformers' torch path computes the SSD and norms in float32 for float64 weights."""
    hf, ours = _pair(CONFIGS[1])
    ids = torch.randint(0, 53, (2, 23))
    logits = ours(ids).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    if float64_throughout:
        float64_transformers()
    hf.train()
    hf(ids, labels=ids).loss.backward()
    ref = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert rel(p.grad, ref[name].grad) <= tol, name


def test_parameter_names_are_transformers():
    hf, ours = _pair(CONFIGS[0])
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in hf.state_dict().items()}


def test_carried_state_and_decode_match_transformers_cache():
    """Prefill then one token at a time, each side with its own cache; both equal the full forward."""
    hf, ours = _pair(CONFIGS[0])
    ids = torch.randint(0, 67, (2, 16))
    with torch.no_grad():
        full = ours(ids).logits
        out = ours(ids[:, :9])
        got, ref = [out.logits], []
        r, cache = hf_forward(hf, ids[:, :9])
        ref.append(r)
        for t in range(9, 16):
            out = ours(ids[:, t:t + 1], out.states)
            got.append(out.logits)
            r, cache = hf_forward(hf, ids[:, t:t + 1], cache=cache)
            ref.append(r)
    got, ref = torch.cat(got, 1), torch.cat(ref, 1).double()
    assert rel(got, ref) <= 1e-6
    assert rel(got, full) <= 1e-12


def test_chunked_forward_with_state_equals_full():
    _, ours = _pair(CONFIGS[1])
    ids = torch.randint(0, 53, (2, 30))
    with torch.no_grad():
        full = ours(ids)
        a = ours(ids[:, :11])
        b = ours(ids[:, 11:12], a.states)
        c = ours(ids[:, 12:], b.states)
    assert rel(torch.cat([a.logits, b.logits, c.logits], 1), full.logits) <= 1e-12
    for s, f in zip(c.states, full.states):
        assert s.h.shape == (2, 6, 6, 4) and s.conv.shape == (2, 36 + 2 * 3 * 4, 2)
        assert rel(s.h, f.h) <= 1e-12 and rel(s.conv, f.conv) <= 1e-12


def test_generate_equals_full_forward_argmax():
    _, ours = _pair(CONFIGS[0])
    ids = torch.randint(0, 67, (2, 5))
    out = ours.generate(ids, max_new_tokens=10)
    seq = ids
    with torch.no_grad():
        for _ in range(10):
            seq = torch.cat([seq, ours(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_ssd_scan_equals_the_recurrence_with_its_gradients():
    torch.manual_seed(1)
    b, t, heads, p, g, n = 2, 150, 6, 3, 2, 5  # several SSD blocks, the last one short
    ins = [torch.randn(b, t, heads, p), torch.rand(b, t, heads) * 0.5 + 0.05, -torch.rand(heads) * 2 - 0.1,
           torch.randn(b, t, g, n), torch.randn(b, t, g, n), torch.randn(b, heads, p, n)]
    ins = [v.double().requires_grad_() for v in ins]
    y, h = ssd_scan(*ins)
    yr, hr = ssd_scan_ref(*ins)
    assert rel(y, yr) <= 1e-12 and rel(h, hr) <= 1e-12
    gy, gh = torch.randn_like(y), torch.randn_like(h)
    got = torch.autograd.grad([y, h], ins, [gy, gh])
    ref = torch.autograd.grad([yr, hr], ins, [gy, gh])
    assert max(rel(a, r) for a, r in zip(got, ref)) <= 1e-12


def test_save_loads_in_transformers_and_back(tmp_path):
    hf, ours = _pair(CONFIGS[1])
    save_mamba2(ours, tmp_path / "m")
    conf = json.loads((tmp_path / "m" / "config.json").read_text())
    assert conf["model_type"] == "mamba2" and conf["architectures"] == ["Mamba2ForCausalLM"]
    theirs = HFMamba2.from_pretrained(tmp_path / "m", dtype=torch.float64, local_files_only=True).eval()
    ids = torch.randint(0, 53, (1, 21))
    with torch.no_grad():
        ref = ours(ids).logits
        assert rel(theirs(ids).logits.double(), ref) <= 1e-6
        hf.save_pretrained(tmp_path / "hf")
        back = load_ssm(tmp_path / "hf")
        assert isinstance(back, Mamba2ForCausalLM) and back.config.time_step_limit == (0.02, 0.3)
        assert rel(back.to(torch.float64)(ids).logits, ref) <= 1e-12
        again = load_mamba2(tmp_path / "m", dtype=torch.float64)
        assert torch.equal(again(ids).logits, ref)


def test_config_round_trips_through_transformers():
    hf_cfg = HFMamba2Config(**CONFIGS[1])
    cfg = Mamba2Config.from_hf(hf_cfg.to_dict())
    back = HFMamba2Config(**{k: v for k, v in cfg.to_hf().items() if k not in ("model_type", "architectures")})
    for k in ("vocab_size", "hidden_size", "state_size", "num_hidden_layers", "num_heads", "head_dim",
              "n_groups", "expand", "conv_kernel", "use_bias", "chunk_size", "tie_word_embeddings",
              "layer_norm_epsilon"):
        assert getattr(back, k) == getattr(hf_cfg, k), k
    assert tuple(back.time_step_limit) == tuple(hf_cfg.time_step_limit)


def test_load_ssm_picks_the_family_and_refuses_others(tmp_path):
    m1 = MambaForCausalLM(MambaConfig(vocab_size=30, hidden_size=8, state_size=4, num_hidden_layers=1))
    save_mamba(m1, tmp_path / "m1")
    assert isinstance(load_ssm(tmp_path / "m1", dtype=torch.float64), MambaForCausalLM)
    assert load_ssm(tmp_path / "m1", dtype=torch.float64).lm_head.weight.dtype == torch.float64
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*supported.*MambaForCausalLM.*Mamba2ForCausalLM"):
        load_ssm(tmp_path / "llama")


def test_bad_configs_and_checkpoints_are_refused(tmp_path):
    with pytest.raises(ValueError, match="num_heads .7. must be a positive multiple of n_groups .2."):
        Mamba2Config(hidden_size=14, num_heads=7, head_dim=4, n_groups=2)
    with pytest.raises(ValueError, match="num_heads \\* head_dim"):
        Mamba2Config(hidden_size=16, num_heads=8, head_dim=3, n_groups=2)
    with pytest.raises(ValueError, match="model_type 'mamba'"):
        Mamba2Config.from_hf({"model_type": "mamba"})
    _, ours = _pair(CONFIGS[0])
    save_mamba2(ours, tmp_path / "m")
    conf = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**conf, "state_size": 8}))
    with pytest.raises(ValueError, match="'backbone.layers.0.mixer.in_proj.weight' has shape \\[96, 16\\] "
                                         "in the checkpoint and \\[104, 16\\]"):
        load_ssm(tmp_path / "m")
