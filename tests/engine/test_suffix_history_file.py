"""`--suffix-history`: the history drafter starts from earlier outputs read from a file (and a
server writes its recent outputs there at shutdown). Warming is the same as having finished those
sequences; outputs stay those of plain decoding; bad files and misplaced options are refused."""

from __future__ import annotations

import json
import random
import re
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from engine_helpers import ToyTokenizer
from reclaim.engine.engine import Engine
from reclaim.engine.history import SuffixProposer, read_history, write_history
from reclaim.engine.request import SamplingParams
from reclaim.engine.speculative import DraftRequest, SpeculativeConfig
from test_speculative import _prompts


def _streams(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def _drafts(p: SuffixProposer, contexts: list[list[int]]) -> list[tuple]:
    reqs = [DraftRequest(f"q{i}", c, 8, SamplingParams(), num_prompt_tokens=len(c)) for i, c in enumerate(contexts)]
    out = [(d.tokens, d.parents) for d in p.propose(reqs)]
    for r in reqs:
        p.release(r.seq_id)
    return out


def test_warming_equals_finishing_the_same_sequences_and_is_evicted_alike():
    seqs, contexts = _streams(30, 0), _streams(20, 1)
    finished, warmed = SuffixProposer(), SuffixProposer()
    for i, s in enumerate(seqs):
        finished.finish(f"s{i}", s, num_prompt_tokens=len(s))  # a prompt alone: only the recent outputs share it
    warmed.warm(seqs)
    assert _drafts(warmed, contexts) == _drafts(finished, contexts)
    assert warmed.recent_outputs() == finished.recent_outputs() == seqs
    capped = SuffixProposer(cache_tokens=400)
    capped.warm(seqs)
    kept = capped.recent_outputs()
    assert 400 - 40 < sum(map(len, kept)) <= 400 and kept == seqs[len(seqs) - len(kept):]  # the oldest went first
    assert capped.memory()["kept_tokens"] == sum(map(len, kept))


def test_a_history_file_round_trips_and_its_text_lines_are_encoded(tmp_path):
    seqs = _streams(5, 2)
    path = tmp_path / "history.jsonl"
    write_history(str(path), seqs)
    assert read_history(str(path), encode=None, vocab_size=6) == seqs
    with path.open("a") as f:
        f.write("\n" + json.dumps({"text": "abc"}) + "\n")
    assert read_history(str(path), lambda t: [ord(c) - 97 for c in t], 6)[-1] == [0, 1, 2]


@pytest.mark.parametrize("line,message", [
    ('{"token_ids": [1, 9]}', "line 2 has token id 9; allowed: 0 to 5"),
    ('{"tokens": [1]}', 'line 2: allowed per line are {"token_ids": [int, ...]} or {"text": str}'),
    ('{"token_ids": [1, true]}', 'line 2: allowed per line are'),
    ("[1, 2", "line 2 is not JSON"),
])
def test_a_bad_history_line_is_refused_by_its_number(tmp_path, line, message):
    path = tmp_path / "history.jsonl"
    path.write_text('{"token_ids": [1, 2]}\n' + line + "\n")
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("{", r"\{")):
        read_history(str(path), lambda t: [], 6)


def test_an_engine_started_from_a_history_drafts_from_it_and_decodes_as_plain(tiny, tmp_path):
    target, _ = tiny
    prompts = _prompts(12, seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = Engine(target, num_blocks=128, block_size=4).generate(prompts, params)
    path = tmp_path / "history.jsonl"  # what a server that answered these before kept
    write_history(str(path), [p + o.token_ids for p, o in zip(prompts, plain)])
    cold = Engine(target, num_blocks=128, block_size=4,
                  speculative=SpeculativeConfig(method="suffix", measured_costs=False))
    warm = Engine(target, num_blocks=128, block_size=4,
                  speculative=SpeculativeConfig(method="suffix", suffix_history=str(path), measured_costs=False))
    outs = {name: [e.generate([p], params)[0].token_ids for p in prompts] for name, e in (("cold", cold), ("warm", warm))}
    assert outs["warm"] == outs["cold"] == [o.token_ids for o in plain]
    assert warm.stats()["spec_accepted"] > cold.stats()["spec_accepted"] + 10 * len(prompts)


def test_text_lines_need_the_engine_tokenizer_and_ids_its_vocabulary(tiny, tmp_path):
    target, _ = tiny
    path = tmp_path / "history.jsonl"
    path.write_text(json.dumps({"text": "hello"}) + "\n")
    spec = SpeculativeConfig(method="suffix", suffix_history=str(path))
    with pytest.raises(ValueError, match="needs the engine's tokenizer"):
        Engine(target, num_blocks=64, block_size=4, speculative=spec)
    tok = ToyTokenizer(target.config.vocab_size)
    eng = Engine(target, tok, num_blocks=64, block_size=4, speculative=spec)
    assert eng.proposer.recent_outputs() == [tok.encode("hello")]
    path.write_text(json.dumps({"token_ids": [target.config.vocab_size]}) + "\n")
    with pytest.raises(ValueError, match=f"token id {target.config.vocab_size}; allowed: 0 to"):
        Engine(target, num_blocks=64, block_size=4, speculative=spec)


def test_the_options_are_refused_where_they_do_not_apply(tmp_path):
    from reclaim.cli import app

    path = tmp_path / "history.jsonl"
    path.write_text("")
    with pytest.raises(ValueError, match="is for methods suffix and hybrid, not 'ngram'"):
        SpeculativeConfig(method="ngram", suffix_history=str(path))
    with pytest.raises(ValueError, match="'/no/such.jsonl' is not a file"):
        SpeculativeConfig(method="suffix", suffix_history="/no/such.jsonl")
    for args, message in ((["ngram", "--save-suffix-history", str(path)],
                           "--save-suffix-history is for --speculative suffix or hybrid, not 'ngram'"),
                          (["suffix", "--save-suffix-history", "/no/dir/h.jsonl"], "its directory does not exist")):
        res = CliRunner().invoke(app, ["serve", "--speculative", *args])
        assert res.exit_code != 0 and message in re.sub(r"[\s│╭╮╰╯─]+", " ", res.output), res.output


def test_a_server_writes_its_recent_outputs_for_the_next_one(tiny, tmp_path):
    from reclaim.server.serve import save_suffix_history_of

    target, _ = tiny
    eng = Engine(target, num_blocks=64, block_size=4, speculative=SpeculativeConfig(method="suffix"))
    outs = eng.generate(_prompts(3, seed=4), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    path = tmp_path / "history.jsonl"
    assert save_suffix_history_of(SimpleNamespace(engine=eng), str(path)) == (3, sum(len(o.prompt_token_ids) + 6 for o in outs))
    nxt = Engine(target, num_blocks=64, block_size=4,
                 speculative=SpeculativeConfig(method="suffix", suffix_history=str(path)))
    assert nxt.proposer.recent_outputs() == eng.proposer.recent_outputs()
