"""`reclaim bench serve` end to end on a tiny model, and its percentile against numpy's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from live_server import make_model, make_tokenizer
from reclaim.bench.serve import ServeBenchSpec, main, percentile
from reclaim.models.loading import save_model


@pytest.mark.parametrize("q", [0, 50, 99, 100])
def test_percentile_matches_numpy(q):
    xs = list(np.random.default_rng(q).exponential(size=37))
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_bench_serve_writes_json_and_png(tmp_path):
    tokenizer = make_tokenizer()
    model_dir = save_model(make_model(tokenizer), tokenizer, tmp_path / "tiny")
    spec = ServeBenchSpec(model=str(model_dir), concurrency=[1, 3], max_tokens=5,
                          requests_per_client=1, min_requests=2, hf_requests=2, max_num_seqs=4,
                          out_dir=str(tmp_path / "out"))
    main(spec)
    result = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert (tmp_path / "out" / "serve.png").stat().st_size > 0
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 3]
    for lv in result["levels"]:
        for side in ("server", "engine"):
            r = lv[side]
            assert r["requests"] == max(2, lv["concurrency"])
            # Every request produced exactly max_tokens tokens (EOS is ignored).
            assert r["output_tok_per_s"] * r["wall_s"] == pytest.approx(5 * r["requests"])
            assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert lv["ratios"]["server_vs_engine_tok_per_s"] > 0
    assert result["hf_sequential"]["requests"] == 2
