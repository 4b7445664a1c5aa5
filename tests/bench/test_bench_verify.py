"""`reclaim bench verify` on a two-layer model: its JSON and plot, what each point holds, and the
errors for values it cannot run."""

from __future__ import annotations

import json

import pytest

from reclaim.bench.verify import VerifyBenchSpec, main


def test_bench_verify_writes_each_width_against_the_plain_step(tmp_path) -> None:
    spec = VerifyBenchSpec(tiny=True, dtypes=["float32"], batch_sizes=[1, 2], widths=[1, 3], repeats=2,
                           out_dir=str(tmp_path))
    result = main(spec, log=lambda *_: None)
    assert json.loads((tmp_path / "verify.json").read_text())["points"] == result["points"]
    assert (tmp_path / "verify.png").stat().st_size > 0
    assert [(p["dtype"], p["batch"]) for p in result["points"]] == [("float32", 1), ("float32", 2)]
    for p in result["points"]:
        assert p["plain_step_ms"] > 0
        assert [v["tokens"] for v in p["verify"]] == [1, 3]
        for v in p["verify"]:
            assert v["draft_tokens"] == v["tokens"] - 1
            assert v["over_plain"] == pytest.approx(v["ms"] / p["plain_step_ms"])
        assert p["free_tokens"] in (0, 1, 3)


@pytest.mark.parametrize("fields, named", [
    ({"dtypes": ["int8"]}, "int8"), ({"batch_sizes": [0]}, "batch_sizes=[0]"),
    ({"widths": [65]}, "widths=[65]"), ({"repeats": 0}, "repeats=0"),
    ({"model": "m", "tiny": True}, "--tiny"),
])
def test_bench_verify_refuses_what_it_cannot_run(fields, named) -> None:
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        VerifyBenchSpec(**fields)
