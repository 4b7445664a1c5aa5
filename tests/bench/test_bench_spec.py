"""`reclaim bench spec` end to end on a tiny model and drafter: every method at every point, the
outside peers at batch 1, greedy outputs compared with plain decoding, JSON with the run's
metadata and a PNG."""

import json

from reclaim.bench.spec import SpecBenchSpec, main
from reclaim.models.drafter import new_drafter, save_drafter
from reclaim.models.loading import load_model


def test_bench_spec_writes_every_point(tiny_model_dir, tmp_path):
    target, _ = load_model(tiny_model_dir)
    drafter = save_drafter(new_drafter(target), tmp_path / "drafter")
    spec = SpecBenchSpec(model=str(tiny_model_dir), drafter=str(drafter), batch_sizes=[1, 2],
                         temperatures=[0.0, 0.7], num_prompts=4, max_tokens=6, depth=2, tree_topk=2,
                         tree_tokens=3, repeats=2, out_dir=str(tmp_path / "out"))
    main(spec)
    result = json.loads((tmp_path / "out" / "spec.json").read_text())
    assert (tmp_path / "out" / "spec.png").stat().st_size > 0
    methods = {(p["temperature"], p["batch"], p["method"]) for p in result["points"]}
    for t in (0.0, 0.7):
        for b in (1, 2):
            assert {(t, b, m) for m in ("plain", "ngram", "suffix", "hybrid", "eagle-chain", "eagle-chain-fixed",
                                        "eagle-tree")} <= methods
    assert {(0.0, 1, "transformers"), (0.0, 1, "transformers-prompt-lookup")} <= methods
    for p in result["points"]:
        if p["temperature"] == 0 and p["method"] != "transformers-prompt-lookup":
            assert p["identical_to_plain"] == p["prompts"], p  # lossless, and the same as transformers
    assert all(len(p["tokens_per_s_runs"]) == 2 for p in result["points"] if "verifies" in p)
    assert result["meta"]["git"]["commit"] and result["meta"]["machine"]["cpu_model"]
    history = [p for p in result["points"] if p["method"] == "suffix"]
    assert all(p["history"]["tokens"] > 0 and p["step_seconds"] > 0 for p in history)  # memory reported


def test_bench_spec_runs_the_methods_asked_for_and_refuses_unknown_ones(tiny_model_dir, tmp_path):
    import pytest

    spec = SpecBenchSpec(model=str(tiny_model_dir), drafter="unused", batch_sizes=[1], temperatures=[0.0],
                         num_prompts=2, max_tokens=4, repeats=1, hf_peer=False, methods=["suffix"],
                         out_dir=str(tmp_path / "out"))
    main(spec)
    result = json.loads((tmp_path / "out" / "spec.json").read_text())
    assert {p["method"] for p in result["points"]} == {"plain", "suffix"}
    with pytest.raises(ValueError, match=r"methods \['medusa'\] are unknown"):
        main(SpecBenchSpec(model=str(tiny_model_dir), drafter="unused", methods=["medusa"], out_dir=str(tmp_path)))


def test_bench_spec_suffix_warm_starts_from_other_prompts_answers(tiny_model_dir, tmp_path):
    """suffix-warm's history: answers to prompts none of which is measured, its size reported; its
    greedy outputs are plain decoding's."""
    spec = SpecBenchSpec(model=str(tiny_model_dir), drafter="unused", batch_sizes=[1], temperatures=[0.0],
                         num_prompts=4, max_tokens=6, repeats=1, hf_peer=False, methods=["suffix", "suffix-warm"],
                         warm_prompts=6, out_dir=str(tmp_path / "out"))
    main(spec)
    result = json.loads((tmp_path / "out" / "spec.json").read_text())
    warm = result["warm_history"]
    assert warm["prompts"] == 6 and 0 < warm["answer_tokens"] <= 36 and warm["tokens"] > warm["answer_tokens"]
    rows = {p["method"]: p for p in result["points"]}
    assert set(rows) == {"plain", "suffix", "suffix-warm"} and rows["suffix-warm"]["identical_to_plain"] == 2
    assert rows["suffix-warm"]["history"]["kept_tokens"] > rows["suffix"]["history"]["kept_tokens"]
