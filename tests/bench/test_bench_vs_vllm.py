"""`reclaim bench engine --against vllm` without vLLM: a stand-in `vllm` package (transformers'
greedy generate behind vLLM's LLM.generate) checks the plumbing end to end (the job, the
subprocess, token-for-token comparison, ratios, limits, JSON and PNG), and a missing vLLM is an
error that says how to give one."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from reclaim.bench.vs_vllm import VllmBenchSpec, main, vllm_python
from reclaim.cli import app

FAKE_VLLM = '''
"""Stand-in for vLLM's offline API: greedy decoding by transformers, EOS ignored."""
__version__ = "0.0-fake"


class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        assert temperature == 0.0 and ignore_eos
        self.max_tokens = max_tokens


class _Out:
    def __init__(self, ids):
        self.token_ids = ids


class _Req:
    def __init__(self, ids, request_id=None, finished=True):
        self.outputs = [_Out(ids)]
        self.request_id, self.finished = request_id, finished


class _Engine:
    """The step loop: a request's first token in one step, all of them (finished) in the next."""

    def __init__(self, llm):
        self.llm, self.steps = llm, []

    def add_request(self, request_id, prompt, params):
        ids = self.llm.generate([prompt], [params])[0].outputs[0].token_ids
        self.steps += [[_Req(ids[:1], request_id, False)], [_Req(ids, request_id, True)]]

    def step(self):
        return self.steps.pop(0)


class LLM:
    def __init__(self, model, dtype, max_model_len, max_num_seqs, seed):
        import torch
        from transformers import AutoModelForCausalLM
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.llm_engine = _Engine(self)

    def generate(self, prompts, params, use_tqdm=False):
        out = []
        for p, sp in zip(prompts, params):
            ids = self.torch.tensor([p["prompt_token_ids"]])
            with self.torch.no_grad():
                got = self.model.generate(ids, max_new_tokens=sp.max_tokens, min_new_tokens=sp.max_tokens,
                                          do_sample=False, pad_token_id=0)
            out.append(_Req(got[0, ids.shape[1]:].tolist()))
        return out
'''


@pytest.fixture
def fake_vllm_python(tmp_path) -> str:
    pkg = tmp_path / "fake" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    exe = tmp_path / "python-with-vllm"
    exe.write_text(f"#!/bin/sh\nPYTHONPATH={pkg.parent}:$PYTHONPATH exec {sys.executable} \"$@\"\n")
    exe.chmod(0o755)
    return str(exe)


def test_against_a_vllm_side_the_outputs_ratios_and_limits_are_written(tiny_model_dir, tmp_path, fake_vllm_python):
    spec = VllmBenchSpec(vllm_python=vllm_python(fake_vllm_python), model=str(tiny_model_dir), batch1_prompts=2,
                         max_tokens=4, long_prompts=1, long_context=60, requests=5, slots=2, scale=0.05,
                         max_output=6, context_lengths=[16, 48], max_model_len=128, out_dir=str(tmp_path / "out"))
    main(spec)
    result = json.loads((tmp_path / "out" / "engine-vllm.json").read_text())
    assert (tmp_path / "out" / "engine-vllm.png").stat().st_size > 0
    rows = {r["workload"]: r for r in result["results"]}
    assert set(rows) == {"batch1", "long", "sharegpt"}
    for r in rows.values():
        assert r["identical_outputs"] == f"{r['requests']}/{r['requests']}"  # greedy = transformers' greedy
        assert r["ratio"] == pytest.approx(r["vllm"]["seconds"] / r["reclaim"]["seconds"])
        assert 0 < r["limit"]["reclaim_share"] and r["limit"]["flops"] > 0
    assert rows["long"]["prompt_tokens"] == 60
    assert set(result["decode_tokens_per_s_by_context"]) == {"16", "48"}
    assert result["decode_identical_outputs"] == "6/6"  # 3 prompts of each length, taking turns
    limit = result["decode_limit_tokens_per_s_by_context"]
    assert limit["16"] > limit["48"] > 0 and result["decode_long_over_short_limit"] == pytest.approx(limit["48"] / limit["16"])
    assert result["vllm_version"] == "0.0-fake" and result["limits"]["read_gb_per_s"] > 0


def test_without_vllm_the_error_says_how_to_give_one(monkeypatch):
    monkeypatch.delenv("RECLAIM_VLLM_PYTHON", raising=False)
    res = CliRunner().invoke(app, ["bench", "engine", "--against", "vllm"])
    assert res.exit_code == 2 and "--vllm-python" in res.output and "pip install" in res.output
    assert "Traceback" not in res.output
    res = CliRunner().invoke(app, ["bench", "engine", "--against", "vllm", "--vllm-python", sys.executable])
    assert res.exit_code == 2 and "cannot import vllm" in res.output
    assert not os.environ.get("RECLAIM_VLLM_PYTHON")
