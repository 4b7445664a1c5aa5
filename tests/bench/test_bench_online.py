"""`reclaim bench online` end to end on a tiny model: every training figure per mix (reuse, its
ceiling, the planner, memory, record bytes), gradient errors against recompute, serving with and
without co-located training, JSON with the run's metadata and a PNG."""

from __future__ import annotations

import json

import pytest

from reclaim.bench.online import OnlineBenchSpec, main, parse_mixes, plot


def test_bench_online_writes_every_figure(tiny_model_dir, tmp_path, one_thread):
    spec = OnlineBenchSpec(model=str(tiny_model_dir), mixes=[(24, 8), (48, 16)], repeats=1, threads=1,
                           requests=6, rate=50.0, scale=0.05, train_batch=2, feedback_share=1.0,
                           serve_repeats=2, out_dir=str(tmp_path))
    main(spec, log=lambda s: None)
    result = json.loads((tmp_path / "online.json").read_text())
    assert (tmp_path / "online.png").stat().st_size > 0
    mixes = result["training"]["mixes"]
    assert [(m["prompt"], m["response"]) for m in mixes] == [(24, 8), (48, 16)]
    for m in mixes:
        assert m["ceiling"] > 1 and m["speedup"] > 0 and m["recompute_tokens_per_s"] > 0
        assert m["planner"]["action"] in ("reuse", "recompute")
        assert m["planned_tokens_per_s"] in (m["reuse_tokens_per_s"], m["recompute_tokens_per_s"])
        peaks = m["peak_train_bytes"]
        assert all(v > result["training"]["grad_bytes"] for v in peaks.values()), peaks
        assert 0 < m["selective_saved_bytes_per_prompt_token"] < m["autograd_saved_bytes_per_prompt_token"]
        assert len(m["samples"]["reuse_s"]) == 1
    first = mixes[0]
    assert first["exact_reuse_rel_err"] < 1e-5 and first["selective_reuse_rel_err"] < 1e-5
    assert first["prefix_grad_false_rel_err"] > 1e-5  # stopping at the prompt is not exact
    serving = result["serving"]
    for side in ("serve_only", "serve_and_record", "serve_and_learn"):
        s = serving[side]
        assert s["requests"] == 6 and s["ttft_s"]["p50"] > 0 and s["output_tokens"] == sum(serving["output_tokens"])
        # two passes, their requests pooled: the pooled median lies within the passes' medians
        p50s = [r["ttft_s"]["p50"] for r in s["runs"]]
        assert len(p50s) == 2 and min(p50s) <= s["ttft_s"]["p50"] <= max(p50s)
    learned = serving["serve_and_learn"]["learning"]
    # every retained request recorded, or served unrecorded while another waited for its first token
    assert learned["train_steps"] >= 1 and learned["record_puts"] + learned["record_skipped"] == 6
    recorded = serving["serve_and_record"]["learning"]  # recording alone: no training
    assert recorded["train_steps"] == 0 and recorded["record_puts"] + recorded["record_skipped"] == 6
    assert set(serving["slowdown_recording_only"]) == set(serving["slowdown"])
    for side, key in (("serve_and_learn", "slowdown_per_pass"),
                      ("serve_and_record", "slowdown_recording_only_per_pass")):
        runs, base = serving[side]["runs"], serving["serve_only"]["runs"]
        assert serving[key]["ttft_s_mean"] == pytest.approx(
            [r["ttft_s"]["mean"] / b["ttft_s"]["mean"] for r, b in zip(runs, base)])
    noise = serving["serve_only_odd_vs_even"]  # one pass each: the passes' own ratio
    assert noise["ttft_s_p50"] == pytest.approx(serving["serve_only"]["runs"][1]["ttft_s"]["p50"]
                                                / serving["serve_only"]["runs"][0]["ttft_s"]["p50"])
    assert result["meta"]["git"]["commit"] and result["meta"]["machine"]["cpu_model"]
    plot({**result, "serving": None}, tmp_path / "training-only.png")  # --requests 0
    assert (tmp_path / "training-only.png").stat().st_size > 0


def test_bad_mixes_and_values_are_refused():
    assert parse_mixes("256/256, 1024/256") == [(256, 256), (1024, 256)]
    with pytest.raises(ValueError, match="mix '256x256'"):
        parse_mixes("256x256")
    with pytest.raises(ValueError, match="feedback_share=2"):
        OnlineBenchSpec(feedback_share=2)
    with pytest.raises(ValueError, match="requests=-1"):
        OnlineBenchSpec(requests=-1)
    with pytest.raises(ValueError, match="mix 0/8"):
        OnlineBenchSpec(mixes=[(0, 8)])


def test_sharegpt_file_gives_the_mixes_and_the_stream(tmp_path, tiny_tokenizer):
    from reclaim.bench.online import conversation_turns, mix_sample, request_stream
    from reclaim.models.tokenizer import encode_chat

    data = [{"conversations": [{"from": "human", "value": f"question {i} " * 6},
                               {"from": "gpt", "value": f"answer {i} " * 9}]} for i in range(5)]
    data.append({"conversations": [{"from": "gpt", "value": "no human turn first"}]})  # skipped
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    turns = conversation_turns(tiny_tokenizer, 7, sharegpt=str(path), scale=1.0, seed=0)
    assert turns[5] == turns[0] and turns[4][0] == "question 4 " * 6  # the file's pairs, cycled
    prompt, reply = mix_sample(tiny_tokenizer, turns, 60, 20)
    last_turn = encode_chat(tiny_tokenizer, [{"role": "user", "content": turns[-1][0]}])
    assert len(prompt) == 60 and len(reply) == 20 and len(last_turn) < 60
    assert prompt[-len(last_turn):] == last_turn  # the history ends with the last question
    reply_ids = tiny_tokenizer.encode(turns[-1][1], add_special_tokens=False)
    assert reply[:len(reply_ids)] == reply_ids[:20]
    spec = OnlineBenchSpec(sharegpt=str(path), requests=4, max_turns=2, rate=2.0)
    stream = request_stream(tiny_tokenizer, spec, max_len=256)
    assert len(stream) == 4 and [t for t, _, _ in stream] == sorted(t for t, _, _ in stream)
    assert all(1 <= n and len(p) + n < 256 for _, p, n in stream)
