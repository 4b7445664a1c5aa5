"""FlashInfer's plan (models/kernels/flashinfer_paged.py) on the CPU, against an emulation of
FlashInfer's documented semantics: `BatchPrefillWithPagedKVCacheWrapper` over "HND" pages (each
row's pages from its CSR slice, the last one `last_page_len` full), its causal mask aligned with
the end of a row's keys, `window_left`, and a custom mask flattened row by row ([qo_len, kv_len]
each). The emulation checks every argument it is given as FlashInfer documents them and computes
in float64; the attention it gives must equal test_paged_attention's per-query reference over
decodes, chunks after a prefix, fresh prompts, trees and windows, and an engine with
RECLAIM_ATTENTION_BACKEND=flashinfer must decode exactly as the default one. The real kernel is
compared with the gathering path by scripts/gpu_check.py on a GPU."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from test_paged_attention import CASES, _poison_unseen, reference, shuffled_tables
from reclaim.engine import kv_cache
from reclaim.engine.kv_cache import KVPool
from reclaim.models.kernels import flashinfer_paged


class _Wrapper:
    """BatchPrefillWithPagedKVCacheWrapper as FlashInfer documents it, in torch on any device."""

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD") -> None:
        assert workspace.dtype == torch.uint8 and kv_layout == "HND"
        self.planned = 0

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, *, custom_mask=None, causal=False, sm_scale=None,
             window_left=-1, q_data_type=None, kv_data_type=None):
        for t in (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len):
            assert t.dtype == torch.int32 and t.dim() == 1
        b = len(qo_indptr) - 1
        assert len(paged_kv_indptr) == b + 1 and len(paged_kv_last_page_len) == b
        assert int(qo_indptr[0]) == int(paged_kv_indptr[0]) == 0
        assert len(paged_kv_indices) == int(paged_kv_indptr[-1])
        last = paged_kv_last_page_len.tolist()
        assert all(1 <= n <= page_size for n in last), last
        assert num_qo_heads % num_kv_heads == 0
        qo = qo_indptr.tolist()
        kv_len = [(int(paged_kv_indptr[i + 1] - paged_kv_indptr[i]) - 1) * page_size + last[i] for i in range(b)]
        if custom_mask is not None:
            assert custom_mask.dtype == torch.bool
            assert custom_mask.numel() == sum((qo[i + 1] - qo[i]) * kv_len[i] for i in range(b))
        self.args = dict(qo=qo, kv=paged_kv_indptr.tolist(), idx=paged_kv_indices.tolist(), kv_len=kv_len,
                         mask=custom_mask, causal=causal, scale=sm_scale or head_dim_qk ** -0.5,
                         window_left=window_left, heads=(num_qo_heads, num_kv_heads, head_dim_qk), ps=page_size,
                         dtypes=(q_data_type, kv_data_type))
        self.planned += 1

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a = self.args
        k, v = paged_kv_cache
        nh, nkv, d = a["heads"]
        assert k.is_contiguous() and v.is_contiguous() and k.shape[1:] == (nkv, a["ps"], d) == v.shape[1:]
        assert q.shape == (a["qo"][-1], nh, d) and a["dtypes"] == (q.dtype, k.dtype)
        out, at = torch.empty_like(q), 0
        for i in range(len(a["qo"]) - 1):
            q0, q1 = a["qo"][i], a["qo"][i + 1]
            n, s = q1 - q0, a["kv_len"][i]
            pages = torch.tensor(a["idx"][a["kv"][i]:a["kv"][i + 1]])
            keys = k[pages].transpose(1, 2).reshape(-1, nkv, d)[:s].repeat_interleave(nh // nkv, 1)
            vals = v[pages].transpose(1, 2).reshape(-1, nkv, d)[:s].repeat_interleave(nh // nkv, 1)
            if a["mask"] is not None:
                seen = a["mask"][at:at + n * s].view(n, s)
                at += n * s
            else:
                qi, kj = torch.arange(n)[:, None], torch.arange(s)[None]
                seen = kj <= s - n + qi if a["causal"] else torch.ones(n, s, dtype=torch.bool)
                if a["window_left"] >= 0:
                    seen &= kj >= s - n + qi - a["window_left"]
            w = torch.einsum("qhd,shd->hqs", q[q0:q1].double(), keys.double()) * a["scale"]
            w = w.masked_fill(~seen, float("-inf")).softmax(-1)
            out[q0:q1] = torch.einsum("hqs,shd->qhd", w, vals.double()).to(q.dtype)
        return out


WHY_NOT = flashinfer_paged.why_not  # the module's own, which `emulated` replaces


@pytest.fixture
def emulated(monkeypatch):
    """FlashInfer emulated and taken on this CPU (any dtype): the plan runs as it would on CUDA."""
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_Wrapper))
    monkeypatch.setattr(flashinfer_paged, "installed", lambda: True)
    monkeypatch.setattr(flashinfer_paged, "why_not", lambda device, dtype, head_dim: None)
    monkeypatch.setattr(flashinfer_paged, "_wrappers", {})
    monkeypatch.setattr(flashinfer_paged, "_failed", [])


def _pool(layout, past, new, window, trees, *, nkv=3, nh=9, d=64, bs=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(1, 64, bs, nkv, d, layout=layout, dtype=torch.float64)
    tables = shuffled_tables(past, new, bs, g)
    k_new = torch.randn(64 * bs, nkv, d, generator=g, dtype=torch.float64)
    v_new = torch.randn(64 * bs, nkv, d, generator=g, dtype=torch.float64)
    q = torch.randn(sum(new), nh, d, generator=g, dtype=torch.float64)
    # Every slot of the rows' blocks written (the cached prefix and the new tokens alike).
    blk = torch.tensor([b for tb in tables for b in tb for _ in range(bs)])
    off = torch.tensor([o for tb in tables for _ in tb for o in range(bs)])
    pool.write(0, (blk, off), k_new[:len(blk)], v_new[:len(blk)])
    view = pool.view(tables, past, new, sliding_window=window, trees=trees)
    new_at = [s for tb, p, n in zip(tables, past, new) for s in range(p, p + n)]
    row_of = [r for r, n in enumerate(new) for _ in range(n)]
    slot = torch.tensor([sum(len(tb) for tb in tables[:r]) * bs + s for r, s in zip(row_of, new_at)])
    return pool, view, q, tables, k_new[slot], v_new[slot]


SHAPES = [dict(), dict(nkv=2, nh=16, d=128, bs=32), dict(nkv=4, nh=4, d=16)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()) or "smollm2")
@pytest.mark.parametrize("past,new,window,trees", CASES)
def test_the_plan_gives_the_reference_attention(emulated, past, new, window, trees, shape):
    pool, view, q, tables, k, v = _pool("pages", past, new, window, trees, **shape)
    assert view.flashinfer_plan is not None and view.fresh == []
    want = torch.zeros_like(q)
    reference(q, pool.k[0], pool.v[0], view.rows, want)
    # Finite poison: a paged kernel reads whole pages and weighs the slots it masks by 0 (a NaN
    # there would spread, as in FlexAttention's case); a weight above 0 on any would still show.
    _poison_unseen(pool, view, tables, past, new, window, finite=True)
    got = view.attend(0, q, k, v)  # writes the new K/V again (the same values), then FlashInfer's plan
    assert (view.flashinfer_plan.mask is not None) == (trees is not None)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("past,new,window,trees", CASES)
def test_a_pages_pool_where_flashinfer_cannot_run_attends_through_the_gathering_path(past, new, window, trees):
    """RECLAIM_ATTENTION_BACKEND=flashinfer on a CPU (or a float32 cache on CUDA): no plan, fresh
    prompts over their own K/V and the rest gathered from the pages, as from the default pool."""
    _, view, q, _, k, v = _pool("pages", past, new, window, trees)
    _, plain, *_ = _pool("blocks", past, new, window, trees)
    assert view.flashinfer_plan is None
    torch.testing.assert_close(view.attend(0, q, k, v), plain.attend(0, q, k, v), atol=1e-12, rtol=1e-12)


def test_one_plan_serves_every_layer_and_a_forward_between_plans_again(emulated):
    pool, view, q, _, k, v = _pool("pages", [20, 3], [1, 1], None, None)
    other_pool, other, q2, _, k2, v2 = _pool("pages", [40], [2], None, None, seed=1)
    first = view.attend(0, q, k, v)
    wrapper = flashinfer_paged._wrappers["cpu"][0]
    assert view.attend(0, q, k, v).equal(first) and wrapper.planned == 1
    other.attend(0, q2, k2, v2)
    assert wrapper.planned == 2 and view.attend(0, q, k, v).equal(first) and wrapper.planned == 3


def test_the_auto_backend_picks_pages_where_flashinfer_runs(emulated, monkeypatch):
    monkeypatch.delenv("RECLAIM_ATTENTION_BACKEND", raising=False)
    assert kv_cache.attention_layout(torch.device("cpu"), torch.bfloat16, 64) == "blocks"
    monkeypatch.setattr(flashinfer_paged, "why_not", lambda device, dtype, head_dim: None if dtype == torch.bfloat16 else "no")
    cuda = torch.device("cuda")
    assert kv_cache.attention_layout(cuda, torch.bfloat16, 64) == "pages"
    assert kv_cache.attention_layout(cuda, torch.float32, 64) == "heads"
    monkeypatch.setenv("RECLAIM_ATTENTION_BACKEND", "flashinfer")
    assert kv_cache.attention_layout(torch.device("cpu"), torch.float32, 64) == "pages"


def test_why_not_names_what_flashinfer_needs(monkeypatch):
    monkeypatch.setattr(flashinfer_paged, "installed", lambda: True)
    cuda = torch.device("cuda")
    assert "CUDA" in flashinfer_paged.why_not(torch.device("cpu"), torch.bfloat16, 64)
    assert "torch.float32" in flashinfer_paged.why_not(cuda, torch.float32, 64)
    assert "96" in flashinfer_paged.why_not(cuda, torch.bfloat16, 96)
    assert flashinfer_paged.why_not(cuda, torch.bfloat16, 128) is None
    monkeypatch.setattr(flashinfer_paged, "installed", lambda: False)
    assert "pip install flashinfer-python" in flashinfer_paged.why_not(cuda, torch.bfloat16, 128)


def test_asking_for_flashinfer_without_it_says_how_to_install(monkeypatch):
    monkeypatch.setattr(flashinfer_paged, "installed", lambda: False)
    monkeypatch.setenv("RECLAIM_ATTENTION_BACKEND", "flashinfer")
    with pytest.raises(ValueError, match="pip install flashinfer-python"):
        KVPool(1, 4, 16, 2, 64)


def test_an_engine_on_flashinfers_pages_decodes_as_the_default_one(emulated, monkeypatch, one_thread):
    """Greedy decoding, a prefix-cached second round and speculative (n-gram) verify rows: the
    same tokens as the default engine's (C kernel or gathering path)."""
    from reclaim.engine.engine import Engine
    from reclaim.engine.request import SamplingParams
    from reclaim.engine.speculative import SpeculativeConfig
    from reclaim.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, eos_token_id=1)).eval()
    with torch.no_grad():  # sharp logits: greedy has clear winners
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    prompts = [[1, 5, 9, 2, 7] * 3, [3, 3, 8], list(range(2, 40))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(**kw):
        out = []
        for spec in (None, SpeculativeConfig(method="ngram", num_speculative_tokens=3)):
            engine = Engine(model, num_blocks=64, block_size=16, max_num_seqs=4, speculative=spec, **kw)
            out += [o.token_ids for _ in range(2) for o in engine.generate(prompts, params)]
        return out, engine

    want, plain = run()
    monkeypatch.setenv("RECLAIM_ATTENTION_BACKEND", "flashinfer")
    got, engine = run()
    assert engine.runner.pool.layout == "pages" and plain.runner.pool.layout == "blocks"
    assert flashinfer_paged._wrappers["cpu"][0].planned > 0
    assert got == want


def test_a_flashinfer_that_fails_warns_once_and_the_engine_gathers_from_the_same_pages(emulated, monkeypatch,
                                                                                      one_thread):
    """FlashInfer raising at its first run (a JIT build that fails, say): one warning that says
    why, the same greedy tokens as the default engine through the gathering path, and no pool of
    the process asks it again (why_not names the failure)."""
    import warnings

    from reclaim.engine.engine import Engine
    from reclaim.engine.request import SamplingParams
    from reclaim.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, eos_token_id=1)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    prompts, params = [[1, 5, 9, 2, 7] * 3, [3, 3, 8]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in Engine(model, num_blocks=64, block_size=16).generate(prompts, params)]

    def broken(self, q, kv):
        raise RuntimeError("ninja: build stopped: subcommand failed")

    monkeypatch.setattr(_Wrapper, "run", broken)
    monkeypatch.setenv("RECLAIM_ATTENTION_BACKEND", "flashinfer")
    engine = Engine(model, num_blocks=64, block_size=16)
    assert engine.runner.pool.flashinfer
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = [o.token_ids for o in engine.generate(prompts, params)]
    assert got == want and not engine.runner.pool.flashinfer
    said = [str(w.message) for w in seen if "FlashInfer" in str(w.message)]
    assert len(said) == 1 and "ninja: build stopped" in said[0]
    assert "FlashInfer failed in this process (RuntimeError: ninja" in WHY_NOT(torch.device("cuda"), torch.bfloat16, 64)
