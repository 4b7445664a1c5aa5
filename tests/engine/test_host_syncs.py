"""A decode step reads the device on the host at most once greedy and twice sampled (vLLM v1's
budget): no per-row `.item()` in the sampler, the verifier or the attention; and a step runs as
many ops for 8 rows as for 4.

What is counted: ops whose result the host must wait for (`_local_scalar_dense`: item(), bool(),
int(); `nonzero` and the ops built on it; copies to the CPU from another device), seen by a
TorchDispatchMode, and `Tensor.tolist()`, which on a CPU reads memory without dispatching.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from reclaim.engine.engine import Engine
from reclaim.engine.request import SamplingParams
from reclaim.engine.speculative import Draft, SpeculativeConfig
from test_speculative import _AlwaysDraft
from reclaim.models.kernels.paged import kernel_status

SYNC_OPS = {"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique", "_unique2",
            "unique_consecutive", "unique_dim", "repeat_interleave"}


class SyncCounter(TorchDispatchMode):
    """Counts host syncs inside it (see the module doc), with the ops' names."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        kwargs = kwargs or {}
        if name in SYNC_OPS:
            self.seen.append(name)
        elif name in ("_to_copy", "copy_") and _to_host(func, args, kwargs):
            self.seen.append(f"{name} to host")
        return func(*args, **kwargs)

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        counter = self

        def tolist(t):
            counter.seen.append("tolist")
            return counter._tolist(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def _to_host(func, args, kwargs) -> bool:
    """A copy from a non-CPU tensor into CPU memory."""
    src = args[1] if func.__name__.startswith("copy_") else args[0]
    dst_cpu = (args[0].device.type == "cpu") if func.__name__.startswith("copy_") else \
        torch.device(kwargs.get("device") or src.device).type == "cpu"
    return src.device.type != "cpu" and dst_cpu


def _decode_syncs(engine: Engine, params: list[SamplingParams], steps: int = 6) -> list[list[str]]:
    """Syncs of each of `steps` decode steps once every request's prefill is done."""
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", [3 + i, 5, 7, 11, 13, 2 + i], p)
    while any(s.num_computed < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting \
            or not engine.scheduler.running:
        engine.step()
    out = []
    for _ in range(steps):
        with SyncCounter() as c:
            engine.step()
        out.append(c.seen)
    return out


pytestmark = pytest.mark.skipif(kernel_status() != "on", reason=f"paged attention kernel {kernel_status()}")


def test_a_greedy_decode_step_syncs_once(tiny):
    engine = Engine(tiny[0], num_blocks=64, block_size=16, max_num_seqs=8)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 5
    for seen in _decode_syncs(engine, params):
        assert len(seen) <= 1, seen


@pytest.mark.parametrize("kw", [dict(), dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1), dict(seed=7)])
def test_a_sampled_decode_step_syncs_at_most_twice(tiny, kw, monkeypatch):
    import reclaim.engine.sampling as sampling

    monkeypatch.setattr(sampling, "CANDIDATES", 8)  # top-p and min-p rows check their candidates (the 2nd read)
    engine = Engine(tiny[0], num_blocks=64, block_size=16, max_num_seqs=8)
    params = [SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, **kw)] * 3 + \
             [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 2
    for seen in _decode_syncs(engine, params):
        assert len(seen) <= 2, seen


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_a_speculative_verify_step_syncs_within_the_budget(tiny, temperature):
    """Drafted rows (prompt lookup) are verified together: greedy once, sampled chains twice."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
    engine = Engine(tiny[0], num_blocks=64, block_size=16, max_num_seqs=8, speculative=spec)
    params = [SamplingParams(temperature=temperature, max_tokens=40, ignore_eos=True)] * 4
    steps = _decode_syncs(engine, params, steps=8)
    assert engine.stats()["spec_verifies"] > 0
    for seen in steps:
        assert len(seen) <= (1 if temperature == 0 else 2), seen


class _Trees(_AlwaysDraft):
    """A tree on every row: two children of the pending token, a grandchild under the first."""

    def propose(self, reqs):
        return [Draft([5, 7, 9], None, [-1, -1, 0]) if r.max_tokens >= 3 else Draft([]) for r in reqs]


def test_a_sampled_tree_verify_step_syncs_at_most_twice(tiny):
    """Sampled trees are verified together too (every node's rejection at once), not row by row."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, max_batch=64, measured_costs=False)
    engine = Engine(tiny[0], num_blocks=64, block_size=16, max_num_seqs=8, speculative=spec, proposer=_Trees())
    params = [SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True)] * 4
    steps = _decode_syncs(engine, params, steps=8)
    assert engine.stats()["spec_verifies"] > 0
    for seen in steps:
        assert len(seen) <= 2, seen


class OpCounter(TorchDispatchMode):
    """Counts the ops that compute (views excluded: they launch nothing on a device)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


PENALTIES = [dict(repetition_penalty=1.3), dict(presence_penalty=0.5, frequency_penalty=0.2),
             dict(logit_bias={5: 1.0, 9: -2.0}), dict(min_tokens=30)]


@pytest.mark.parametrize("penalized", [False, True])
def test_a_step_runs_the_same_ops_for_twice_the_rows(tiny, penalized):
    """Sampling, seeds, logit_bias, penalties and min_tokens are tensor ops over the batch: a
    decode step of 8 sampled rows runs as many ops as one of 4 (each kind of penalty twice as
    often)."""
    ops = {}
    for n in (4, 8):
        engine = Engine(tiny[0], num_blocks=64, block_size=16, max_num_seqs=8)
        for i in range(n):
            kw = PENALTIES[i % len(PENALTIES)] if penalized else {}
            engine.add_request(f"r{i}", [3 + i, 5, 7, 11], SamplingParams(temperature=0.8, max_tokens=40,
                                                                       ignore_eos=True, seed=i, **kw))
        for _ in range(3):
            engine.step()
        with OpCounter() as c:
            engine.step()
        ops[n] = c.ops
    assert ops[8] == ops[4], ops
