"""guidellm (vLLM's load generator) benchmarks a live server: a short concurrent run of synthetic
requests completes with no errors and every request gets the output tokens it asked for.

guidellm is not a dependency: it pins click and multidict below what the dev extra installs and
brings uvloop and httptools, which uvicorn would then pick up, so it lives in its own virtual
environment (README: "guidellm"). The test runs the `guidellm` on PATH or the one $GUIDELLM
names, and is skipped without one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.slow
GUIDELLM = os.environ.get("GUIDELLM") or shutil.which("guidellm")
OUTPUT_TOKENS = 8


def test_guidellm_runs_against_the_server(server, tmp_path):
    if not GUIDELLM:
        pytest.skip("guidellm is not installed (set GUIDELLM to its executable)")
    server.tokenizer.save_pretrained(tmp_path / "tokenizer")  # guidellm sizes prompts with it
    report = tmp_path / "guidellm.json"
    cmd = [GUIDELLM, "run", "--backend", f"kind=openai_http,target={server.url}",
           "--profile", "kind=concurrent,streams=2",
           "--constraint", "kind=max_requests,count=6",
           "--data", f"kind=synthetic_text,prompt_tokens=24,output_tokens={OUTPUT_TOKENS}",
           "--tokenizer", f"kind=huggingface_auto,model={tmp_path / 'tokenizer'}",
           "--output", f"kind=json,path={report}", "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    benchmarks = json.loads(report.read_text())["benchmarks"]
    assert len(benchmarks) == 1
    totals = benchmarks[0]["metrics"]["request_totals"]
    assert totals["successful"] >= 6 and totals["errored"] == 0, totals
    tokens = benchmarks[0]["metrics"]["output_token_count"]["successful"]
    assert tokens["min"] == tokens["max"] == OUTPUT_TOKENS  # ignore_eos and max_tokens honoured
