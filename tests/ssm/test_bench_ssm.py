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


def test_family_sweeps_are_the_issues_and_count_attention_kv() -> None:
    from reclaim.bench.ssm import bench_spec, kv_bytes_per_token, train_config
    from reclaim.ssm.train import build_model

    for family in ("mamba2", "hybrid"):
        spec = bench_spec(family=family)
        assert spec.modes == ["backprop", "adjoint", "truncated"] and spec.cap_gib == 0.25
        assert spec.contexts[0] == 4096 and spec.contexts[-1] == 65536 and spec.window >= spec.chunk_size
    spec = bench_spec(family="hybrid")
    model = build_model(train_config(spec, context_length=64), spec.vocab_size)
    attention = [layer.mixer for layer in model.backbone.layers if layer.kind == "full_attention"]
    assert kv_bytes_per_token(spec) == sum(2 * a.kv_heads * a.head_dim * 4 for a in attention) > 0
    assert kv_bytes_per_token(bench_spec(family="mamba2")) == 0
    with pytest.raises(ValueError, match=r"unknown family 'jamba'; allowed: \['mamba', 'mamba2', 'hybrid'\]"):
        bench_spec(family="jamba")


@pytest.mark.slow
def test_bench_ssm_hybrid_writes_its_own_files(tmp_path) -> None:
    from reclaim.bench.ssm import bench_spec

    spec = bench_spec(family="hybrid")
    spec.contexts, spec.reference_context, spec.chunk_size, spec.window, spec.threads = [1024], 1024, 256, 256, 1
    main(spec, tmp_path, log=lambda *_: None)
    result = json.loads((tmp_path / "ssm-hybrid.json").read_text())
    points = {p["mode"]: p for p in result["points"]}
    assert set(points) == {"backprop", "adjoint", "truncated"}
    for p in points.values():  # same init and data: the same loss in every mode
        assert p["loss"] == pytest.approx(points["backprop"]["loss"], rel=1e-5)
    assert result["kv_bytes_per_token"] == 128 and (tmp_path / "ssm-hybrid.png").is_file()
