"""Incremental detokenization: deltas add up to decode(all ids); no part of a stop string is
ever streamed; the stop string is cut (or kept on request)."""

import pytest

from reclaim.engine.detokenize import IncrementalDetokenizer


def _stream(tok, ids, stop=(), include=False):
    d = IncrementalDetokenizer(tok, list(stop), include)
    deltas = []
    for i in ids:
        hit = d.add(i)
        deltas.append(d.delta(final=hit))
        if hit:
            break
    else:
        d.flush()
        deltas.append(d.delta(final=True))
    return d, deltas


def test_deltas_add_up_to_decode(toy_tokenizer):
    ids = [9, 40, 1, 60, 3, 3, 77]  # with an <eos> in the middle: skipped in text
    d, deltas = _stream(toy_tokenizer, ids)
    assert "".join(deltas) == toy_tokenizer.decode(ids, skip_special_tokens=True) == d.text
    assert d.stop_found is None


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_is_never_streamed(toy_tokenizer, include):
    tok = toy_tokenizer
    ids = tok.encode("abcdefgh")  # single letters: the stop "cde" spans three tokens
    d, deltas = _stream(tok, ids, stop=["cde", "zz"], include=include)
    assert d.stop_found == "cde"
    assert "".join(deltas) == ("abcde" if include else "ab")
    assert deltas[:2] == ["a", "b"] and deltas[2:4] == ["", ""]  # "c", "cd" held back
    assert len(deltas) == 5  # stopped at the token completing the stop string


def test_held_back_text_is_released_when_it_turns_out_not_to_stop(toy_tokenizer):
    d, deltas = _stream(toy_tokenizer, toy_tokenizer.encode("abcx"), stop=["bcd"])
    assert deltas[:3] == ["a", "", ""] and "".join(deltas) == "abcx"


def test_partial_utf8_waits_for_the_whole_character(smol_tokenizer):
    text = "naïve café: 日本語 🙂 ok"
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    d, deltas = _stream(smol_tokenizer, ids)
    assert "".join(deltas) == smol_tokenizer.decode(ids) == text
    assert not any("\ufffd" in x for x in deltas)
