"""The compiled decode forward: one graph with no breaks for every batch size (no recompiles
across buckets), the same greedy output as eager, and a compile failure that falls back to
eager with one warning."""

import pytest
import torch

from reclaim.engine.engine import Engine
from reclaim.engine.request import SamplingParams
from reclaim.engine.runner import BUCKETS, CompiledDecode, bucket
from reclaim.models.kernels.paged import kernel_status

pytestmark = pytest.mark.skipif(kernel_status() != "on", reason=f"paged attention kernel {kernel_status()}")


def _prompts(n):
    return [[3 + i, 5, 7, 11 + i % 3, 13] for i in range(n)]


def _greedy(engine, n, max_tokens=12):
    return [o.token_ids for o in engine.generate(_prompts(n), SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                            ignore_eos=True))]


def test_decode_forward_has_no_graph_breaks(tiny):
    model = tiny[0]
    engine = Engine(model, num_blocks=64, block_size=16, max_num_seqs=8)
    engine.generate(_prompts(3), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    for i, p in enumerate(_prompts(3)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    engine.step()  # the prefills
    runner = engine.runner
    rows = [runner.requests[f"r{i}"].seq for i in range(3)]
    view = runner.pool.view([runner.blocks.tables[s.request_id] for s in rows], [s.num_computed for s in rows],
                            [1] * 3, token_ids=[[s.token_ids[-1]] for s in rows], pad_to=4, table_width=4)
    decode = CompiledDecode(model, torch.device("cpu"), backend="eager")
    with torch.inference_mode():
        explained = torch._dynamo.explain(decode._forward)(view.input_ids, view.positions, view)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


def test_one_graph_for_every_bucket_and_the_same_output_as_eager(tiny):
    """aot_eager runs the graph as AOTAutograd makes it (the pool writes functionalised), so a
    write lost between layers would show in the tokens."""
    model = tiny[0]
    eager = Engine(model, num_blocks=128, block_size=16, max_num_seqs=16)
    compiled = Engine(model, num_blocks=128, block_size=16, max_num_seqs=16, compile=True)
    from torch._dynamo.testing import CompileCounter  # torch._dynamo: seconds of a worker's start if imported at collection

    counter = CompileCounter()
    compiled.runner._decode = CompiledDecode(model, torch.device("cpu"), backend=counter)
    for n in (1, 3, 5, 9, 16):  # buckets 2, 4, 8, 16, 16
        assert _greedy(compiled, n) == _greedy(eager, n)
    assert counter.frame_count == 1


def test_aot_eager_keeps_every_layers_cache_writes(tiny):
    model = tiny[0]
    eager = Engine(model, num_blocks=64, block_size=16, max_num_seqs=8)
    compiled = Engine(model, num_blocks=64, block_size=16, max_num_seqs=8)
    compiled.runner._decode = CompiledDecode(model, torch.device("cpu"), backend="aot_eager")
    assert _greedy(compiled, 5, 20) == _greedy(eager, 5, 20)


@pytest.mark.slow
def test_inductor_compiled_decode_equals_eager(tiny):
    model = tiny[0]
    eager = Engine(model, num_blocks=64, block_size=16, max_num_seqs=8)
    compiled = Engine(model, num_blocks=64, block_size=16, max_num_seqs=8, compile=True)
    assert _greedy(compiled, 6, 20) == _greedy(eager, 6, 20)
    assert compiled.runner._decode.failed is None


def test_a_compile_failure_runs_eagerly_with_one_warning(tiny):
    model = tiny[0]

    def broken(gm, inputs):
        raise RuntimeError("no compiler here")

    eager = Engine(model, num_blocks=64, block_size=16, max_num_seqs=8)
    engine = Engine(model, num_blocks=64, block_size=16, max_num_seqs=8)
    engine.runner._decode = CompiledDecode(model, torch.device("cpu"), backend=broken)
    with pytest.warns(UserWarning, match="compile of the decode forward failed.*no compiler here") as seen:
        assert _greedy(engine, 3) == _greedy(eager, 3)
    assert len([w for w in seen if "compile" in str(w.message)]) == 1


def test_buckets_hold_every_batch():
    assert [bucket(n) for n in (1, 2, 3, 9, 16, 17, 256, 257)] == [1, 2, 4, 16, 16, 24, 256, 272]
    assert list(BUCKETS) == sorted(set(BUCKETS))
