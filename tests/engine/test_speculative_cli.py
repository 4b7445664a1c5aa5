"""`--speculative` on generate and chat: the same text as plain decoding, and bad values refused
with the allowed forms named."""

import functools
import re

import pytest
import torch
from typer.testing import CliRunner

from reclaim.cli import app
from reclaim.models.drafter import new_drafter, save_drafter
from reclaim.models.llama import LlamaConfig, LlamaForCausalLM
from reclaim.models.loading import load_model, save_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, default_model_dir):
    from reclaim.models.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    return str(save_model(LlamaForCausalLM(cfg), tok, tmp_path_factory.mktemp("spec") / "tiny"))


@pytest.fixture(scope="module")
def drafter_dir(tiny_dir, tmp_path_factory):
    target, _ = load_model(tiny_dir)
    torch.manual_seed(1)
    return str(save_drafter(new_drafter(target), tmp_path_factory.mktemp("spec") / "drafter"))


@pytest.mark.parametrize("command", [["generate", "Say hello twice: hello hello"], ["chat"]])
@pytest.mark.parametrize("spec", ["ngram", "eagle:{d}", "eagle:{d} --eagle-topk 3 --num-draft-tokens 6",
                                  "eagle:{d} --spec-fixed-depth", "suffix", "suffix --suffix-cache-tokens 64",
                                  "hybrid:{d}", "suffix+eagle:{d} --num-speculative-tokens 6 --num-draft-tokens 8"])
def test_speculative_output_equals_plain(tiny_dir, drafter_dir, command, spec):
    base = [*command, "-m", tiny_dir, "--max-tokens", "24"]
    fast = CliRunner().invoke(app, base + ["--speculative", *spec.format(d=drafter_dir).split()],
                              input="Say hello twice: hello hello\n")
    assert fast.exit_code == 0, fast.output
    assert fast.output == _plain(tuple(base))


@functools.cache
def _plain(base: tuple[str, ...]) -> str:
    """The command's output without speculation (greedy: one run serves every method's test)."""
    plain = CliRunner().invoke(app, list(base), input="Say hello twice: hello hello\n")
    assert plain.exit_code == 0, plain.output
    return plain.output


@pytest.mark.parametrize("spec,message", [
    ("medusa", "'medusa' is unknown; allowed: none, ngram, suffix, eagle:PATH (an EAGLE-1/2 drafter directory), "
               "eagle3:PATH (an EAGLE-3 one), hybrid:PATH"),
    ("eagle:/no/such/drafter", "/no/such/drafter"),
    ("hybrid:/no/such/drafter", "/no/such/drafter"),
    ("suffix:/a/path", "'suffix:/a/path' is unknown; allowed: none, ngram, suffix,"),
    ("suffix --suffix-cache-tokens 0", "suffix_cache_tokens=0; allowed: >= 1"),
    ("suffix --suffix-cache-tokens -5", "suffix_cache_tokens=-5; allowed: >= 1"),
    ("ngram --suffix-cache-tokens 100", "--suffix-cache-tokens is for --speculative suffix or hybrid, not 'ngram'"),
])
def test_bad_speculative_values_are_refused(tiny_dir, spec, message):
    res = CliRunner().invoke(app, ["generate", "Hi", "-m", tiny_dir, "--speculative", *spec.split()])
    text = re.sub(r"[\s│╭╮╰╯─]+", " ", res.output)  # typer's error box wraps lines
    assert res.exit_code != 0 and message in text, text


def test_drafter_for_another_model_is_refused(tiny_dir, tmp_path):
    other = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, max_position_embeddings=64))
    path = save_drafter(new_drafter(other), tmp_path / "other")
    res = CliRunner().invoke(app, ["generate", "Hi", "-m", tiny_dir, "--speculative", f"eagle:{path}"])
    assert res.exit_code == 1 and "hidden_size=16 but the target has hidden_size=32" in res.output


def test_spec_fixed_depth_turns_dynamic_depth_off():
    from reclaim.cli import _speculative

    assert _speculative("ngram", None).dynamic_depth is True
    assert _speculative("ngram", None, fixed_depth=True).dynamic_depth is False


def test_a_drafter_in_the_other_eagle_layout_is_refused_by_name(tiny_dir, drafter_dir, tmp_path):
    """An EAGLE-1/2 directory given as eagle3:PATH and an EAGLE-3 one as eagle:PATH: errors that
    say which layout it is and the form to use."""
    from reclaim.models.eagle3 import new_eagle3, save_eagle3

    target, _ = load_model(tiny_dir)
    e3 = save_eagle3(new_eagle3(target), tmp_path / "e3")
    for spec, message in ((f"eagle3:{drafter_dir}", "is an EAGLE-1/2 drafter"), (f"eagle:{e3}", "is an EAGLE-3 drafter")):
        res = CliRunner().invoke(app, ["generate", "Hi", "-m", tiny_dir, "--speculative", spec])
        text = re.sub(r"\s+", " ", res.output)
        assert res.exit_code == 1 and message in text, text
