"""`reclaim bench ssm` end to end on a tiny model: every mode runs in its own process and the
first full step's loss agrees across modes (same init and data; every gradient is backprop's,
the truncated one too with T-bar >= T); the truncation error falls with the window."""

from __future__ import annotations

import json

import pytest

from reclaim.bench.ssm import MODES, BenchSpec, main


@pytest.mark.slow
def test_bench_ssm_runs_every_mode_and_writes_json_and_png(tmp_path) -> None:
    spec = BenchSpec(d_model=16, n_layer=2, chunk_size=256, window=4096, loss_chunk=256,
                     cap_gib=4.0, contexts=[2048], reference_context=2048, threads=1)
    main(spec, tmp_path, log=lambda *_: None)
    result = json.loads((tmp_path / "ssm.json").read_text())
    points = {p["mode"]: p for p in result["points"]}
    assert set(points) == set(MODES)
    for p in points.values():
        assert "failed" not in p, p
        assert p["peak_bytes"] > 0 and p["step_s"] > 0
        # Step time: the median of at least 3 timed steps, with their spread.
        assert len(p["step_times_s"]) == 3
        assert p["step_s_min"] <= p["step_s"] <= p["step_s_max"]
        assert p["loss"] == pytest.approx(points["backprop"]["loss"], rel=1e-5)
    assert set(result["summary"]["ratios"]) == set(MODES[1:])
    # Truncation error: shrinks as the window grows, and a window spanning the context is exact.
    err = result["truncated_gradient_rel_l2_error"]
    assert err["16"] > err["1024"] > 0 and err["2048"] < 1e-5
    assert (tmp_path / "ssm.png").stat().st_size > 10_000
    for m, r in result["summary"]["ratios"].items():
        lo, hi = r["time_vs_backprop_range"]["2048"]
        assert lo <= r["time_vs_backprop"]["2048"] <= hi
    assert result["command"] and result["git"]["commit"] and result["versions"]["torch"]
    assert result["machine"]["cpu_model"] and result["machine"]["torch_threads"] == 1
