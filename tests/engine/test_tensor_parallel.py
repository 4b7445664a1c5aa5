"""A tensor-parallel engine (engine/tensor_parallel.py, models/tensor_parallel.py) on two gloo ranks.

One torchrun run checks what a user of `--tensor-parallel-size 2` relies on, against one process
with the whole model as the oracle: the sharded model's logits, the greedy outputs of plain and
suffix-speculative decoding (chains and trees; identical, float32 and float64), EAGLE drafting on the leader
from its whole embedding and head (chains, trees, a drafter the config loads, new weights), and the sampled distribution (the
engine's two-sample chi-square test, which a different temperature fails). Bad input is refused
by name before any weights are touched.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from engine_helpers import TINY, make_pair
from test_speculative import _AlwaysDraft, same_distribution

from reclaim.engine.config import EngineConfig
from reclaim.engine.engine import Engine
from reclaim.engine.request import SamplingParams
from reclaim.engine.speculative import Draft, SpeculativeConfig
from reclaim.engine.tensor_parallel import check_launch
from reclaim.models.llama_config import LlamaConfig
from reclaim.models.tensor_parallel import check_tensor_parallel

sys.path.insert(0, str(Path(__file__).parents[1] / "rl"))
from rl_helpers import rank_main, torchrun  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
DRAWS = 1500
CHI_PROMPT = [3, 5, 3, 5, 3]
SUFFIX = SpeculativeConfig(method="suffix", num_speculative_tokens=3, max_batch=64, measured_costs=False)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    # repeated halves, so the history drafter finds matches and its drafts get verified
    out = []
    for n in torch.randint(3, 10, (6,), generator=g).tolist():
        half = torch.randint(2, 96, (n,), generator=g).tolist()
        out.append(half + half)
    return out


def _model(dtype: torch.dtype, seed: int = 0, **kw):
    return make_pair(seed, **kw)[0].to(dtype)


def _greedy(model, **kw) -> list[list[int]]:
    eng = Engine(model, num_blocks=64, block_size=4, **kw)
    return [o.token_ids for o in eng.generate(_prompts() + _prompts()[:2], GREEDY)], eng


def _hist(outputs, v: int) -> torch.Tensor:
    c = torch.zeros(v, v, dtype=torch.float64)
    for o in outputs:
        c[o.token_ids[0], o.token_ids[1]] += 1
    return c


class _EveryToken(_AlwaysDraft):
    """A tree of every token of an 8-token vocabulary as the next one: one branch is always
    accepted, mostly not the first, so its K/V moves into place."""

    def propose(self, reqs):
        return [Draft(list(range(8)), None, [-1] * 8) for _ in reqs]


def _tree_moves(target, **kw) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs (which a K/V left unmoved on any rank would change)."""
    eng = Engine(target, num_blocks=64, block_size=4, **kw)
    params = dataclasses.replace(GREEDY, logprobs=0)
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in eng.generate([CHI_PROMPT, [1, 2, 3]], params)]


def _tree_target():
    return make_pair(seed=4, vocab_size=8)[0].double()


TREES = dict(proposer=_EveryToken(), speculative=SpeculativeConfig(max_batch=64, num_speculative_tokens=8,
                                                                   measured_costs=False))


def _eagle_target_and_drafter(seed: int = 1):
    """A target whose head favours 8 tokens and a random drafter sharing that head: some drafts land."""
    from reclaim.models.drafter import new_drafter

    target = make_pair(seed=seed)[0]
    with torch.no_grad():
        target.lm_head.weight[8:] *= 0.05
    torch.manual_seed(2)
    return target, new_drafter(target)


EAGLE_PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _eagle_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 96, (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (8,), generator=g)]


def _eagle_runs(drafter_dir: Path) -> dict:
    """EAGLE on a TP=2 engine: a proposer passed in (chains and trees), one the speculative config
    loads from a directory, and the same after update_weights with other whole weights."""
    from reclaim.engine.eagle import EagleProposer
    from reclaim.models.drafter import save_drafter

    out = {}
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, max_batch=64, num_draft_tokens=8,
                             measured_costs=False)
    for name, tree in (("chain", dict(topk=1, depth=3)), ("tree", dict(topk=3, depth=3, total=8))):
        target, drafter = _eagle_target_and_drafter()
        eng = Engine(target, num_blocks=256, block_size=4, max_num_seqs=4, tensor_parallel_size=2,
                     speculative=spec, proposer=EagleProposer(drafter, target, **tree))
        out[name] = ([o.token_ids for o in eng.generate(_eagle_prompts(), EAGLE_PARAMS)],
                     eng.stats()["spec_accepted"] if eng.is_leader else None)
    target, drafter = _eagle_target_and_drafter()
    path = save_drafter(drafter, drafter_dir)
    eng = Engine(target, num_blocks=256, block_size=4, max_num_seqs=4, tensor_parallel_size=2,
                 speculative=SpeculativeConfig(method="eagle", model=str(path), num_speculative_tokens=3,
                                               max_batch=64, measured_costs=False))
    out["config"] = ([o.token_ids for o in eng.generate(_eagle_prompts(), EAGLE_PARAMS)],
                     eng.stats()["spec_accepted"] if eng.is_leader else None)
    new = make_pair(seed=7)[0]
    eng.update_weights(new.state_dict())  # the leader's whole embedding and head follow
    out["updated"] = [o.token_ids for o in eng.generate(_eagle_prompts(), EAGLE_PARAMS)]
    if eng.is_leader:
        out["leader_whole"] = all(torch.equal(getattr(eng.draft_target, a).weight, getattr(new, a).weight)
                                  for a in ("lm_head",)) and torch.equal(
            eng.draft_target.model.embed_tokens.weight, new.model.embed_tokens.weight)
    return out


def _load_shard(directory: Path) -> dict:
    """A checkpoint loaded as this rank's shard (what `serve --tensor-parallel-size` does) against
    the whole model loaded and cut: equal tensors, and no split tensor read whole."""
    from reclaim.models import loading
    from reclaim.models.tensor_parallel import shard_llama

    model = _model(torch.float32, attention_bias=True)
    loading.save_model(model, None, directory)
    whole = loading.load_model(directory)[0]
    shard_llama(whole)
    read_whole: list[str] = []
    get = loading.SafetensorsSource.__getitem__
    loading.SafetensorsSource.__getitem__ = lambda self, key: read_whole.append(key) or get(self, key)
    try:
        part = loading.load_model(directory, tp_group=torch.distributed.group.WORLD)[0]
    finally:
        loading.SafetensorsSource.__getitem__ = get
    same = all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), part.state_dict().values()))
    return {"same": same and whole.state_dict().keys() == part.state_dict().keys(),
            "read_whole": read_whole, "kv_heads": part.tensor_parallel.num_kv_heads}


def _worker(out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results: dict = {}
    for name, dtype in (("float64", torch.float64), ("float32", torch.float32)):
        model = _model(dtype, tie_word_embeddings=name == "float32", attention_bias=True)
        ids = torch.tensor(_prompts()[:1])
        plain, _ = _greedy(model, tensor_parallel_size=2)  # shards the model
        # float64 drafts trees (an accepted branch's K/V moved into place on every rank), float32 chains
        suffix = dataclasses.replace(SUFFIX, suffix_topk=2 if name == "float64" else 1)
        spec, eng = _greedy(model, tensor_parallel_size=2, speculative=suffix)
        fresh = _model(dtype, seed=1, tie_word_embeddings=name == "float32", attention_bias=True)
        eng.update_weights(fresh.state_dict())  # every rank, full tensors: each keeps its shard
        results[name] = {"logits": model(ids).logits, "plain": plain, "spec": spec,
                         "accepted": eng.stats()["spec_accepted"] if eng.is_leader else None,
                         "kv_heads": eng.runner.pool.k[0].shape[1]}
    target, _ = make_pair(seed=4, vocab_size=8)
    results["tree_moves"] = _tree_moves(_tree_target(), tensor_parallel_size=2, **TREES)
    eng = Engine(target, num_blocks=128, block_size=4, max_num_seqs=64, seed=2, tensor_parallel_size=2,
                 speculative=SUFFIX)
    results["hist"] = _hist(eng.generate([CHI_PROMPT] * DRAWS, SAMPLED), 8)
    results["hist_accepted"] = eng.stats()["spec_accepted"] if eng.is_leader else None
    results["eagle"] = _eagle_runs(out.parent / f"drafter-rank{dist.get_rank()}")
    results["load"] = _load_shard(out.parent / f"model-rank{dist.get_rank()}")
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tp") / "rank0.pt"
    torchrun(__file__, str(out), timeout=300)
    return torch.load(out)


@pytest.mark.launches
@pytest.mark.parametrize("name,dtype,tol", [("float64", torch.float64, 1e-12), ("float32", torch.float32, 1e-5)])
def test_tp2_equals_one_process(two_ranks, name, dtype, tol):
    got = two_ranks[name]
    model = _model(dtype, tie_word_embeddings=name == "float32", attention_bias=True)
    fresh = _model(dtype, seed=1, tie_word_embeddings=name == "float32", attention_bias=True)
    # after update_weights with the unsharded tensors of other weights: those weights' logits
    torch.testing.assert_close(got["logits"], fresh(torch.tensor(_prompts()[:1])).logits, rtol=tol, atol=tol)
    ref, _ = _greedy(model)
    assert got["plain"] == ref  # greedy output identical to TP=1
    assert got["spec"] == ref and got["accepted"] > 0  # suffix drafts verified on the TP engine, lossless
    assert got["kv_heads"] == 1  # each rank's pool holds its own K/V heads (2 heads over 2 ranks)


@pytest.mark.launches
def test_tp2_moves_an_accepted_branch_on_every_rank(two_ranks):
    plain = _tree_moves(_tree_target())
    # trees in one process are lossless; on two ranks too
    for got in (_tree_moves(_tree_target(), **TREES), two_ranks["tree_moves"]):
        for (tokens, lps), (ref_tokens, ref_lps) in zip(got, plain):
            assert tokens == ref_tokens and lps == pytest.approx(ref_lps, rel=1e-12, abs=1e-12)


@pytest.mark.launches
def test_tp2_samples_the_target_distribution(two_ranks):
    target, _ = make_pair(seed=4, vocab_size=8)

    def one_process(temperature: float) -> torch.Tensor:
        eng = Engine(target, num_blocks=128, block_size=4, max_num_seqs=64, seed=1)
        params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True)
        return _hist(eng.generate([CHI_PROMPT] * DRAWS, params), 8)

    assert two_ranks["hist_accepted"] > 0
    assert same_distribution(two_ranks["hist"], one_process(1.0), DRAWS)
    # the test can fail: a sharper distribution is told apart
    assert not same_distribution(two_ranks["hist"], one_process(0.6), DRAWS)


@pytest.mark.launches
def test_a_rank_loads_only_its_shard_of_a_checkpoint(two_ranks):
    got = two_ranks["load"]
    assert got["same"] and got["kv_heads"] == 1
    # only tensors kept whole on every rank (norms, biases of row-parallel layers) are read whole
    assert got["read_whole"] and all(k.endswith(("norm.weight", "o_proj.bias")) for k in got["read_whole"])


@pytest.mark.launches
def test_tp2_drafts_with_eagle_losslessly(two_ranks):
    got = two_ranks["eagle"]
    plain = [o.token_ids for o in Engine(_eagle_target_and_drafter()[0], num_blocks=256, block_size=4)
             .generate(_eagle_prompts(), EAGLE_PARAMS)]
    for name in ("chain", "tree", "config"):
        tokens, accepted = got[name]
        assert tokens == plain and accepted > 0, name  # drafts verified on the TP engine, output unchanged
    fresh = Engine(make_pair(seed=7)[0], num_blocks=256, block_size=4).generate(_eagle_prompts(), EAGLE_PARAMS)
    assert got["updated"] == [o.token_ids for o in fresh] != plain
    assert got["leader_whole"]  # the drafter reads the new whole embedding and head


@pytest.mark.parametrize("field,value,shape", [
    ("num_attention_heads", 3, {"num_attention_heads": 3, "num_key_value_heads": 1}),
    ("num_key_value_heads", 3, {"num_attention_heads": 6, "num_key_value_heads": 3}),
    ("vocab_size", 97, {"vocab_size": 97}), ("intermediate_size", 129, {"intermediate_size": 129})])
def test_tp_size_that_does_not_divide_is_refused_by_name(field, value, shape):
    cfg = LlamaConfig(**{**TINY, "head_dim": 16, **shape})
    with pytest.raises(ValueError, match=rf"tensor_parallel_size=2 does not divide {field}={value}.*allowed"):
        check_tensor_parallel(cfg, 2)
    check_tensor_parallel(cfg, 1)


def test_tp_above_one_outside_torchrun_shows_the_torchrun_line(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = _model(torch.float32).config
    with pytest.raises(ValueError, match=r"run: torchrun --standalone --nproc-per-node=2 --no-python reclaim "
                                         r"serve m --tensor-parallel-size 2$"):
        check_launch(2, cfg, ["serve", "m", "--tensor-parallel-size", "2"])
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="WORLD_SIZE=4; they must be equal"):
        check_launch(2, cfg, ["serve"])
    with pytest.raises(ValueError, match="needs a process group of 2 ranks: run under torchrun"):
        Engine(_model(torch.float32), num_blocks=8, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=0; allowed: an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)


if __name__ == "__main__":
    rank_main(_worker, sys.argv[1])
