"""`reclaim bench engine` end to end on a tiny model: every workload and head kernel runs, the
outputs equal transformers' token for token, and the JSON says where and how it ran."""

from __future__ import annotations

import json

import pytest

from reclaim.bench.engine import EngineBenchSpec, main


def test_bench_engine_runs_every_workload_and_writes_json_and_png(tiny_model_dir, tmp_path):
    spec = EngineBenchSpec(model=str(tiny_model_dir), batch1_prompts=2, static_batch=3, max_tokens=6,
                           repeats=2, sharegpt_requests=7, sharegpt_slots=3, sharegpt_scale=0.1,
                           max_model_len=256, threads=1, out_dir=str(tmp_path))
    main(spec)
    result = json.loads((tmp_path / "engine.json").read_text())
    assert (tmp_path / "engine.png").stat().st_size > 0
    rows = {r["workload"]: r for r in result["results"]}
    assert set(rows) == {"static batch 1", "static batch 3", "sharegpt"}
    for row in rows.values():
        for side in ("reclaim[linear]", "reclaim[auto]"):
            r = row[side]
            n = row["requests"] if row["workload"] == "sharegpt" else row["prompts"]
            assert r["identical_outputs"] == f"{n}/{n}"
            assert r["tokens_per_s"] > 0
    assert len(rows["static batch 1"]["output_lengths"]) == 2
    assert rows["static batch 1"]["reclaim[linear]"]["seconds"]["min"] > 0
    share = rows["sharegpt"]
    # Requested tokens only: every request got exactly its output length on both sides.
    assert share["transformers"]["tokens"] == share["reclaim[linear]"]["tokens"] == share["output_tokens"]["total"]
    # Static batches compute every row to the batch's longest output.
    assert share["transformers"]["computed_row_steps_per_requested_token"] >= 1
    assert result["command"] and result["git"]["commit"]
    m = result["machine"]
    assert m["cpu_model"] and m["cpu_cores"] >= 1 and m["torch_threads"] == 1
    assert result["versions"]["torch"] and result["versions"]["transformers"]


def test_bench_engine_rejects_unknown_workloads_and_heads():
    with pytest.raises(ValueError, match="allowed"):
        EngineBenchSpec(workloads=["batch1", "nope"])
    with pytest.raises(ValueError, match="allowed"):
        EngineBenchSpec(heads=["onednn"])
