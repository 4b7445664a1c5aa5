"""Prompt logprobs: `echo` on /v1/completions (lm-evaluation-harness's loglikelihood requests)
and vLLM's `prompt_logprobs`, checked against log_softmax of one forward over the prompt."""

from __future__ import annotations

import pytest
import torch

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@torch.no_grad()
def forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row j is the distribution over token j + 1."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), -1)


def lm_eval_loglikelihood(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-eval's LocalCompletionsAPI.parse_logprobs for one choice, verbatim in substance."""
    logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
    tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    is_greedy = True
    for tok, top in zip(tokens_logprobs, top_logprobs):
        if tok != max(top.values()):
            is_greedy = False
            break
    return logprobs, is_greedy


def test_lm_eval_loglikelihood_requests(server, http):
    """lm-eval's payload: token-id prompts (context + continuation), max_tokens 1, logprobs 1,
    echo, temperature 0, a seed; its parsing gives log P(continuation | context)."""
    tok = server.tokenizer
    pairs = [("The quick brown", " fox jumps"), ("Hello, world!", " How are you"),
             ("Numbers: 0 1 2", " 3 4")]
    prompts, ctxlens = [], []
    for context, continuation in pairs:
        ctx, cont = tok.encode(context), tok.encode(continuation)
        prompts.append(ctx + cont)
        ctxlens.append(len(ctx))
    r = http.post(COMPLETIONS, json={"model": "tiny-llama", "prompt": prompts, "temperature": 0,
                                     "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for choice, ids, ctxlen in zip(choices, prompts, ctxlens):
        rows = forward_logprobs(server.model, ids)
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then the one generated token
        want = [float(rows[j, ids[j + 1]]) for j in range(len(ids) - 1)]
        assert lp["token_logprobs"][1:len(ids)] == pytest.approx(want, abs=1e-4)
        got, greedy = lm_eval_loglikelihood(choice, ctxlen)
        assert got == pytest.approx(sum(want[ctxlen - 1:]), abs=1e-4)
        assert greedy == all(int(rows[j].argmax()) == ids[j + 1]
                             for j in range(ctxlen - 1, len(ids) - 1))
        assert choice["text"].startswith(tok.decode(ids))
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0


def test_echo_text_prompt_with_max_tokens_zero(server, http):
    tok = server.tokenizer
    text = "Serving language models"
    ids = tok.encode(text)
    r = http.post(COMPLETIONS, json={"prompt": text, "max_tokens": 0, "echo": True,
                                     "logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                             "total_tokens": len(ids)}
    lp = choice["logprobs"]
    rows = forward_logprobs(server.model, ids)
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"][1:] == pytest.approx(
        [float(rows[j, ids[j + 1]]) for j in range(len(ids) - 1)], abs=1e-4)
    for top, row in zip(lp["top_logprobs"][1:], rows):
        assert max(top.values()) == pytest.approx(float(row.max()), abs=1e-4)
    assert "".join(lp["tokens"]) == text
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(ids))]


def test_echo_without_logprobs_and_streamed(http):
    body = {"prompt": "Hello", "max_tokens": 4, "echo": True, "temperature": 0,
            "ignore_eos": True}
    whole = http.post(COMPLETIONS, json=body).json()["choices"][0]
    plain = http.post(COMPLETIONS, json={**body, "echo": False}).json()["choices"][0]
    assert whole["text"] == "Hello" + plain["text"] and whole["logprobs"] is None
    with http.stream("POST", COMPLETIONS, json={**body, "stream": True}) as r:
        import json
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                       if line.startswith("data: {"))
    assert text == whole["text"]


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_vllm_prompt_logprobs(server, http, route):
    tok = server.tokenizer
    if route == COMPLETIONS:
        req = {"prompt": "The quick brown fox"}
        ids = tok.encode(req["prompt"])
    else:
        req = {"messages": [{"role": "user", "content": "Hi there"}]}
        ids = http.post("/tokenize", json=req).json()["tokens"]
    r = http.post(route, json={**req, "max_tokens": 2, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    entries = body["choices"][0]["prompt_logprobs"] if route == COMPLETIONS \
        else body["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    rows = forward_logprobs(server.model, ids)
    for j, entry in enumerate(entries[1:]):
        actual = entry[str(ids[j + 1])]
        assert actual["logprob"] == pytest.approx(float(rows[j, ids[j + 1]]), abs=1e-4)
        assert actual["decoded_token"] == tok.decode([ids[j + 1]])
        top = rows[j].topk(3)
        for rank, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
            assert entry[str(t)]["logprob"] == pytest.approx(v, abs=1e-4)
            assert entry[str(t)]["rank"] == rank
        assert 3 <= len(entry) <= 4
