"""vLLM's allowed_token_ids and bad_words on both routes: the output keeps to the allowed ids and
never completes a banned word's token sequence (equal to a plain decoding loop that masks the
same tokens), is unchanged when the restriction does not bind, and bad ids get a 400 naming the
value and the vocabulary's range. The words' token sequences are compared with vLLM's rule."""

from __future__ import annotations

import re

import pytest
import torch

from reclaim.server.plan import bad_words_token_ids

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def vllm_rule(words: list[str], tokenizer) -> list[list[int]]:
    """vLLM's SamplingParams.update_from_tokenizer as its docs show it: the word without a leading
    space, then with one if that starts with another token and has the same length."""
    out: list[list[int]] = []
    for word in words:
        for spaced in (False, True):
            ids = tokenizer.encode((" " if spaced else "") + word.lstrip(), add_special_tokens=False)
            if not spaced or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    return out


@torch.no_grad()
def masked_greedy(model, prompt: list[int], n: int, banned: list[list[int]] = (),
                  allowed: list[int] | None = None) -> list[int]:
    """Greedy by full forwards, masking vLLM's way: the allowed ids only, and a banned
    sequence's last token when the output so far ends with the rest of it."""
    ids, out = list(prompt), []
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].double()
        if allowed is not None:
            keep = torch.zeros_like(logits, dtype=torch.bool)
            keep[allowed] = True
            logits[~keep] = float("-inf")
        for seq in banned:
            if len(seq) == 1 or out[-(len(seq) - 1):] == seq[:-1]:
                logits[seq[-1]] = float("-inf")
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out


def _text(body: dict, route: str, i: int = 0) -> str:
    choice = body["choices"][i]
    return choice["text"] if route == COMPLETIONS else choice["message"]["content"]


def _contains(seq: list[int], word: list[int]) -> bool:
    return any(seq[i:i + len(word)] == word for i in range(len(seq) - len(word) + 1))


def test_bad_words_sequences_follow_vllms_rule(server):
    tok = server.tokenizer
    same = ["fox", "the", " lazy", "brown", "how are you", "dog"]  # spaced: same length, or "Ġ" + plain
    assert bad_words_token_ids(same, tok, len(tok)) == vllm_rule(same, tok)
    # " batching" is 4 tokens, "batching" 5: vLLM drops the spaced form (vLLM issue #32557),
    # so " batching" mid-text would pass; here it is banned too.
    plain, spaced = (tok.encode(w, add_special_tokens=False) for w in ("batching", " batching"))
    assert len(plain) != len(spaced) and not _contains(spaced, plain)
    assert vllm_rule(["batching"], tok) == [plain]
    assert bad_words_token_ids(["batching"], tok, len(tok)) == [plain, spaced]


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_bad_words_never_complete_and_leave_other_outputs_alone(server, http, route):
    tok = server.tokenizer
    if route == COMPLETIONS:
        prompt = tok.encode("The quick brown fox")
        base = {"prompt": prompt}
    else:
        base = {"messages": [{"role": "user", "content": "The quick brown fox"}]}
        prompt = http.post("/tokenize", json=base).json()["tokens"]
    plain = masked_greedy(server.model, prompt, 16)
    # Banned: the words greedy writes whose token sequences it produces (a random model's
    # output re-encodes differently elsewhere).
    words = [w for w in re.findall(r"[A-Za-z]{2,}", tok.decode(plain))
             if any(_contains(plain, s) for s in bad_words_token_ids([w], tok, len(tok)))]
    assert words
    banned = bad_words_token_ids(words, tok, len(tok))
    want = masked_greedy(server.model, prompt, 16, banned=banned)
    assert want != plain and not any(_contains(want, seq) for seq in banned)
    r = http.post(route, json={**base, "max_tokens": 16, "bad_words": words, **GREEDY})
    assert r.status_code == 200, r.text
    assert _text(r.json(), route) == tok.decode(want, skip_special_tokens=True)
    unused = ["Unicode", "naïve"]  # greedy never writes these: the output is plain greedy's
    assert not any(_contains(plain, s) for s in bad_words_token_ids(unused, tok, len(tok)))
    r = http.post(route, json={**base, "max_tokens": 16, "bad_words": unused, **GREEDY})
    assert _text(r.json(), route) == tok.decode(plain, skip_special_tokens=True)


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_allowed_token_ids_keep_the_output_to_them(server, http, route):
    tok = server.tokenizer
    base = {"prompt": "Numbers: 0 1"} if route == COMPLETIONS else \
        {"messages": [{"role": "user", "content": "Numbers: 0 1"}]}
    digits = [i for i in range(len(tok)) if re.fullmatch(r"[0-9 ]+", tok.decode([i]))]
    r = http.post(route, json={**base, "max_tokens": 24, "n": 3, "temperature": 1.0, "seed": 7,
                               "ignore_eos": True, "allowed_token_ids": digits})
    assert r.status_code == 200, r.text
    for i in range(3):
        assert re.fullmatch(r"[0-9 ]+", _text(r.json(), route, i)), _text(r.json(), route, i)


def test_allowed_token_ids_equal_a_masked_loop_and_bind_only_when_they_exclude(server, http):
    tok = server.tokenizer
    prompt = tok.encode("Hello, world!")
    plain = masked_greedy(server.model, prompt, 12)
    allowed = sorted(set(range(60, 200)) - set(plain))
    want = masked_greedy(server.model, prompt, 12, allowed=allowed)
    body = {"prompt": prompt, "max_tokens": 12, **GREEDY}
    got = http.post(COMPLETIONS, json={**body, "allowed_token_ids": allowed}).json()
    assert got["choices"][0]["text"] == tok.decode(want) and want != plain
    loose = sorted(set(plain) | {5, 6, 7})
    got = http.post(COMPLETIONS, json={**body, "allowed_token_ids": loose}).json()
    assert got["choices"][0]["text"] == tok.decode(plain, skip_special_tokens=True)


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("field,value,message", [
    ("allowed_token_ids", [3, 320], "allowed_token_ids has token id 320; allowed: 0 to 319"),
    ("allowed_token_ids", [-1], "allowed_token_ids has token id -1; allowed: 0 to 319"),
    ("allowed_token_ids", [], "allowed_token_ids is an empty list"),
    ("allowed_token_ids", ["5"], "allowed_token_ids.0: Input should be a valid integer"),
    ("bad_words", ["  "], "bad_words: word 0 has 0 characters besides spaces; allowed: 1 to 1024"),
    ("bad_words", "fox", "bad_words: Input should be a valid array"),
])
def test_bad_values_name_the_field_and_the_range(http, route, field, value, message):
    base = {"prompt": "Hi"} if route == COMPLETIONS else {"messages": [{"role": "user", "content": "Hi"}]}
    r = http.post(route, json={**base, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].split(".")[0] == field and err["message"].startswith(message), err
