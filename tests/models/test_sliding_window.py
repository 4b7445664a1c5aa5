"""Mistral's sliding window, beyond the window: the full forward, DenseCache decoding and the
engine's paged view all give transformers' logits; config keys the decoder cannot honour are
refused by name."""

import dataclasses
import json

import pytest
import torch

from reclaim.engine.kv_cache import BlockManager, KVPool
from reclaim.models.cache import DenseCache
from reclaim.models.hf import hf_forward, hf_logits
from reclaim.models.llama import LlamaConfig, LlamaForCausalLM
from reclaim.models.loading import load_checkpoint, read_config

TOL = 1e-4
WINDOW = 8
LENGTH = 32  # four windows


TINY = dict(vocab_size=96, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=256)


def make_windowed_hf(model_type: str = "mistral", **extra):
    """A tiny transformers model with sliding_window=8 and weights far from init."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **TINY, num_key_value_heads=2, sliding_window=WINDOW, **extra)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.15)
    return model.eval()


@pytest.fixture
def windowed(tmp_path, one_thread):
    """(our model, transformers' MistralForCausalLM) with sliding_window=8, same weights."""
    hf = make_windowed_hf()
    hf.save_pretrained(tmp_path / "mistral")
    model = load_checkpoint(tmp_path / "mistral")
    assert model.config.sliding_window == WINDOW
    return model, hf


def test_full_forward_matches_transformers_beyond_the_window(windowed):
    model, hf = windowed
    ids = torch.randint(0, TINY["vocab_size"], (2, LENGTH))
    unwindowed_model = LlamaForCausalLM(dataclasses.replace(model.config, sliding_window=None))
    unwindowed_model.load_state_dict(model.state_dict())
    with torch.no_grad():
        got = model(ids).logits
        unwindowed = unwindowed_model(ids).logits
    want = hf_logits(hf, ids)
    assert (got - want).abs().max() <= TOL
    # The window matters past it: full attention gives other logits there, the same ones before.
    assert (unwindowed[:, :WINDOW] - want[:, :WINDOW]).abs().max() <= TOL
    assert (unwindowed[:, WINDOW:] - want[:, WINDOW:]).abs().max() > 100 * TOL


def test_transformers_window_convention_is_window_keys_including_the_query():
    """kv > q - window: the query sees itself and window - 1 earlier keys (checked on the source)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    from reclaim.models.cache import causal_mask

    f = sliding_window_causal_mask_function(WINDOW)
    q, k = torch.arange(20)[:, None], torch.arange(20)[None, :]
    theirs = f(torch.tensor(0), torch.tensor(0), q, k)
    assert torch.equal(causal_mask(20, 0, torch.device("cpu"), WINDOW)[0, 0], theirs)


def test_dense_cache_decoding_matches_transformers_beyond_the_window(windowed):
    """A prefill shorter than the window, a chunk longer than it, then one token at a time."""
    model, hf = windowed
    ids = torch.randint(0, TINY["vocab_size"], (2, LENGTH))
    full = hf_logits(hf, ids)
    cache, hf_cache = DenseCache(sliding_window=WINDOW), None
    steps = [(0, 5), (5, 17)] + [(t, t + 1) for t in range(17, LENGTH)]
    for a, b in steps:
        pos = torch.arange(a, b).expand(2, -1)
        with torch.no_grad():
            got = model(ids[:, a:b], pos, cache).logits
        theirs, hf_cache = hf_forward(hf, ids[:, a:b], cache=hf_cache)
        assert (got - full[:, a:b]).abs().max() <= TOL, (a, b)
        assert (theirs - full[:, a:b]).abs().max() <= TOL, (a, b)


def test_a_cache_built_for_another_window_is_refused(windowed):
    model, _ = windowed
    with pytest.raises(ValueError, match="sliding_window=None.*sliding_window=8"):
        model(torch.tensor([[1, 2, 3]]), cache=DenseCache())


@pytest.mark.parametrize("block_size", [3, 4])
def test_paged_view_prefill_and_decode_match_transformers_beyond_the_window(windowed, block_size):
    """Through the engine's paged cache: a fresh prompt longer than the window (no gather), a
    chunked prefill, a padded batch mixing both, and lone decode rows past four windows."""
    model, hf = windowed
    c = model.config
    pool = KVPool(c.num_hidden_layers, 64, block_size, c.num_key_value_heads, c.head_dim)
    bm = BlockManager(64, block_size)
    g = torch.Generator().manual_seed(3)
    seqs = {"a": torch.randint(0, c.vocab_size, (LENGTH + 4,), generator=g).tolist(),
            "b": torch.randint(0, c.vocab_size, (LENGTH + 1,), generator=g).tolist()}
    want = {k: hf_logits(hf, torch.tensor([s]))[0] for k, s in seqs.items()}

    def run(rows: list[tuple[str, int, int]]) -> None:
        """One forward over (sequence, start, end) rows; checks every real position's logits."""
        for name, _, end in rows:
            assert bm.allocate(name, end)
        new = [end - start for _, start, end in rows]
        view = pool.view([bm.tables[n] for n, _, _ in rows], [s for _, s, _ in rows], new,
                         sliding_window=c.sliding_window)
        with torch.inference_mode():
            got = view.split(model(view.pack([seqs[n][s:e] for n, s, e in rows]), view.positions, view).logits)
        for i, (name, start, end) in enumerate(rows):
            assert (got[i] - want[name][start:end]).abs().max() <= TOL, (rows, name)

    run([("a", 0, 20)])  # fresh prompt: 20 > window, masked without a gather
    run([("b", 0, 6)])
    run([("b", 6, 19)])  # chunk longer than the window after a cached prefix
    run([("a", 20, 21), ("b", 19, 27)])  # padded batch: a decode row beside a chunk
    for t in range(21, 30):  # lone decode rows: keys cut to the window, early blocks unread
        run([("a", t, t + 1)])
    for t in range(30, LENGTH + 4):  # batched decode rows past the window: masked, early blocks unread
        run([("a", t, t + 1), ("b", t - 3, t - 2)])


def test_paged_view_reads_only_the_blocks_a_window_can_see(windowed):
    """Keys older than the window are never read: blocks holding only such keys are poisoned
    with NaN, and the decode row's attention is still that of its window."""
    model, _ = windowed
    c = model.config
    pool = KVPool(c.num_hidden_layers, 16, 4, c.num_key_value_heads, c.head_dim)
    g = torch.Generator().manual_seed(0)
    pool.k[0].normal_(generator=g)
    pool.v[0].normal_(generator=g)
    view = pool.view([list(range(10))], [36], [1], sliding_window=WINDOW)  # sees keys 29..36
    q = torch.randn(1, c.num_attention_heads, c.head_dim, generator=g)
    k, v = pool.k[0][9, :, :, 0], pool.v[0][9, :, 0]  # the new token's own K/V (slot 36: block 9, offset 0)
    want = view.attend(0, q, k, v)
    pool.k[0][:7], pool.v[0][:7] = float("nan"), float("nan")  # keys 0..27
    got = view.attend(0, q, k, v)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want)



def test_qwen2_window_on_every_layer_matches_transformers(tmp_path, one_thread):
    hf = make_windowed_hf("qwen2", use_sliding_window=True, max_window_layers=0)
    hf.save_pretrained(tmp_path / "qwen2")
    model = load_checkpoint(tmp_path / "qwen2")
    assert model.config.sliding_window == WINDOW
    ids = torch.randint(0, TINY["vocab_size"], (1, LENGTH))
    with torch.no_grad():
        assert (model(ids).logits - hf_logits(hf, ids)).abs().max() <= TOL


# ---- config keys --------------------------------------------------------------------------------

def hf_dict(model_type: str, **kw) -> dict:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**TINY, "num_key_value_heads": 2, **kw}).to_dict()


def test_window_resolves_as_transformers_applies_it():
    assert LlamaConfig.from_hf({"model_type": "mistral"}).sliding_window == 4096  # transformers' default
    assert LlamaConfig.from_hf(hf_dict("mistral", sliding_window=None)).sliding_window is None
    # Qwen configs carry a window that is off unless use_sliding_window is set
    assert LlamaConfig.from_hf(hf_dict("qwen2", sliding_window=16)).sliding_window is None
    raw = {"model_type": "qwen2", "num_hidden_layers": 4, "use_sliding_window": True,
           "sliding_window": 16, "max_window_layers": 4}
    assert LlamaConfig.from_hf(raw).sliding_window is None  # no layer past max_window_layers
    assert LlamaConfig.from_hf({**raw, "max_window_layers": 0}).sliding_window == 16


@pytest.mark.parametrize("raw, key", [
    ({"model_type": "qwen2", "num_hidden_layers": 4, "use_sliding_window": True,
      "sliding_window": 16, "max_window_layers": 2}, "max_window_layers=2"),
    ({"model_type": "mistral", "num_hidden_layers": 2,
      "layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"model_type": "llama", "sliding_window": 16}, "sliding_window=16"),
    ({"model_type": "llama", "use_qk_norm": True}, "use_qk_norm=True"),
    ({"model_type": "llama", "attention_dropout": 0.1}, "attention_dropout=0.1"),
    ({"model_type": "llama", "quantization_config": {"quant_method": "awq"}}, "quantization_config"),
    ({"model_type": "llama", "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
])
def test_behaviour_changing_keys_are_refused_by_name(raw, key):
    with pytest.raises(ValueError, match=key):
        LlamaConfig.from_hf(raw)


def test_unknown_key_in_config_json_is_refused_naming_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**hf_dict("llama"), "logit_softcapping": 30.0}))
    with pytest.raises(ValueError, match=r"config.json.*logit_softcapping=30\.0"):
        read_config(tmp_path)


def test_tiny_test_configs_load_and_round_trip(tiny_hf, family):
    cfg = LlamaConfig.from_hf(tiny_hf(family).config.to_dict())
    again = LlamaConfig.from_hf(cfg.to_hf())
    assert dataclasses.replace(again, extra={}) == dataclasses.replace(cfg, extra={})


def test_windowed_config_round_trips_through_transformers():
    from transformers import AutoConfig

    for raw in (hf_dict("mistral", sliding_window=WINDOW),
                hf_dict("qwen2", sliding_window=WINDOW, use_sliding_window=True, max_window_layers=0)):
        cfg = LlamaConfig.from_hf(raw)
        d = cfg.to_hf()
        again = AutoConfig.for_model(d.pop("model_type"), **{k: v for k, v in d.items() if k != "architectures"})
        assert LlamaConfig.from_hf(again.to_dict()).sliding_window == WINDOW


def test_the_bundled_default_model_config_loads(default_model_dir):
    cfg = read_config(default_model_dir)
    assert cfg.model_type == "llama" and cfg.sliding_window is None
