"""`reclaim bench serve` end to end on a tiny model (the structured-output point too, alone and in
the sweep), and its percentile against numpy's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from live_server import make_model, make_tokenizer
from reclaim.bench.serve import ServeBenchSpec, main
from reclaim.bench.serve_load import percentile
from reclaim.models.loading import save_model


@pytest.mark.parametrize("q", [0, 50, 99, 100])
def test_percentile_matches_numpy(q):
    xs = list(np.random.default_rng(q).exponential(size=37))
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_bench_serve_writes_json_and_png(tmp_path):
    tokenizer = make_tokenizer()
    model_dir = save_model(make_model(tokenizer), tokenizer, tmp_path / "tiny")
    spec = ServeBenchSpec(model=str(model_dir), concurrency=[1, 3], max_tokens=5,
                          requests_per_client=1, min_requests=2, repeats=2, max_num_seqs=4,
                          gap_budgets=[16, 64], long_prompt_tokens=150, gap_stream_tokens=4,
                          structured_concurrency=[2], structured_max_tokens=40,
                          structured_schema=SMALL_SCHEMA, out_dir=str(tmp_path / "out"))
    main(spec)
    result = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert (tmp_path / "out" / "serve.png").stat().st_size > 0
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 3]
    for lv in result["levels"]:
        for side in ("server", "engine", "hf_static"):
            r = lv[side]
            assert len(r["runs"]) == 2
            for run in r["runs"]:
                assert run["requests"] == max(2, lv["concurrency"])
                # Every request produced exactly max_tokens tokens (EOS is ignored).
                assert run["output_tok_per_s"] * run["wall_s"] == pytest.approx(5 * run["requests"])
                assert 0 < run["ttft_p50_ms"] <= run["ttft_p99_ms"]
            s = r["output_tok_per_s_spread"]
            assert s["min"] <= s["median"] <= s["max"]
        assert lv["ratios"]["server_vs_hf_static_tok_per_s"]["median"] > 0
    # The run is reproducible from what the JSON records.
    assert result["command"] and result["git"]["commit"]
    assert result["machine"]["cpu_model"] and result["machine"]["torch_threads"] >= 1
    assert result["versions"]["torch"] and result["versions"]["transformers"]
    gaps = result["inter_token_gap"]
    assert [b["max_num_batched_tokens"] for b in gaps["budgets"]] == [16, 64]
    assert 100 < gaps["long_prompt_tokens"] < 256  # the tiny model's context is 256
    for b in gaps["budgets"]:
        assert b["alone"]["worst_gap_ms"] > 0 and b["with_long_prompt"]["worst_gap_ms"] > 0
        assert b["with_long_prompt"]["long_prompt_ttft_s"] > 0
    _check_structured(result["structured_output"], [2])
    # The point alone, put into the sweep's JSON (the rest kept).
    main(ServeBenchSpec(model=str(model_dir), only="structured", structured_concurrency=[1, 3],
                        structured_max_tokens=40, structured_schema=SMALL_SCHEMA, repeats=1,
                        min_requests=2, requests_per_client=1, max_num_seqs=4,
                        out_dir=str(tmp_path / "out")))
    again = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert again["levels"] == result["levels"] and again["inter_token_gap"] == gaps
    _check_structured(again["structured_output"], [1, 3])
    assert again["structured_output"]["machine"]["load_average_at_start"]


SMALL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                 "n": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["ok", "n"], "additionalProperties": False}


def _check_structured(point: dict, concurrency: list[int]) -> None:
    assert [lv["concurrency"] for lv in point["levels"]] == concurrency
    for lv in point["levels"]:
        assert lv["outputs"] == lv["requests"] * len(lv["json_schema"]["runs"])
        assert lv["outputs_valid"] == lv["outputs"]  # every reply parses and fits the schema
        assert len(lv["reply_tokens"]) == lv["requests"]
        first = lv["json_schema"]["runs"][0]
        assert first["output_tok_per_s"] * first["wall_s"] == pytest.approx(sum(lv["reply_tokens"]))
        for free in lv["unconstrained"]["runs"]:
            # Each unconstrained request makes as many tokens as the constrained reply to its prompt.
            assert free["output_tok_per_s"] * free["wall_s"] == pytest.approx(sum(lv["reply_tokens"]))
        assert lv["json_schema_vs_unconstrained_tok_per_s"]["median"] > 0


def test_unknown_point_is_refused():
    with pytest.raises(ValueError, match="only='gaps'.*allowed"):
        ServeBenchSpec(only="gaps")
