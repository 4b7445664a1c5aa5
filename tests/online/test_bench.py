"""The online micro-benchmark runs end to end on a tiny model and reports every figure."""

from __future__ import annotations

from conftest import tiny_model

from reclaim.online.bench import bench_online


def test_bench_reports_speedup_ceiling_and_record_bytes():
    out = bench_online(tiny_model(), mixes=((16, 8), (32, 16)), threads=1, repeats=1)
    assert [(m["prompt"], m["response"]) for m in out["mixes"]] == [(16, 8), (32, 16)]
    for m in out["mixes"]:
        assert m["ceiling"] > 1 and m["speedup"] > 0 and m["record_saved_bytes_per_token"] > 0
        assert len(m["samples"]["reuse_s"]) == 1
    first = out["mixes"][0]
    assert 0 < first["selective_saved_bytes_per_token"] < first["record_saved_bytes_per_token"]
    assert first["exact_reuse_rel_err"] < 1e-5 < first["prefix_grad_false_rel_err"]
