"""Corpus: the stdlib file list, tokenized stream (cached), deterministic window batches."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from reclaim.data import corpus


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<eos>": 0, "[UNK]": 1} | {c: i + 2 for i, c in enumerate("abcdefghij ")}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="[UNK]")


def test_stdlib_files_are_sorted_stdlib_sources() -> None:
    files = corpus.stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    assert files == sorted(files)
    assert root / "os.py" in files and root / "json" / "decoder.py" in files
    assert not any("site-packages" in p.parts or "test" in p.relative_to(root).parts for p in files)


def test_tokenize_corpus_joins_documents_with_eos_and_caches(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setenv("RECLAIM_CACHE", str(tmp_path / "cache"))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "b.txt").write_text("cab")
    (docs / "a.txt").write_text("ab cd")
    (docs / "skip.bin").write_text("jjj")
    tokens = corpus.tokenize_corpus(str(docs), tokenizer)
    expected = []
    for text in ("ab cd", "cab"):  # sorted path order, .bin skipped
        expected += tokenizer(text, add_special_tokens=False)["input_ids"] + [0]
    assert tokens.tolist() == expected
    assert len(list((tmp_path / "cache" / "corpus").glob("*.pt"))) == 1
    assert torch.equal(corpus.tokenize_corpus(str(docs), tokenizer), tokens)
    (docs / "b.txt").write_text("cabbage")  # a changed file must not be served from the cache
    assert corpus.tokenize_corpus(str(docs), tokenizer).numel() == tokens.numel() + 4


def test_bad_corpus_spec_names_the_value(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        corpus.corpus_files(str(tmp_path / "nope"))


def test_window_batches_are_deterministic_contiguous_and_cover_an_epoch() -> None:
    tokens = torch.arange(1000, dtype=torch.int32)
    T, bs = 16, 4
    n = corpus.num_windows(tokens, T)
    starts = []
    for index in range(n // bs):
        batch = corpus.window_batch(tokens, T, bs, seed=3, index=index)
        assert batch.shape == (bs, T) and batch.dtype == torch.long
        assert torch.equal(batch, corpus.window_batch(tokens, T, bs, seed=3, index=index))
        assert torch.equal(batch - batch[:, :1], torch.arange(T).expand(bs, -1))
        starts += batch[:, 0].tolist()
    assert len(set(starts)) == len(starts)  # no window twice in an epoch
    assert all(s % T == 0 and s + T <= tokens.numel() for s in starts)
    assert not torch.equal(corpus.window_batch(tokens, T, bs, seed=4, index=0),
                           corpus.window_batch(tokens, T, bs, seed=3, index=0))
    with pytest.raises(ValueError, match="context_length=2000"):
        corpus.num_windows(tokens, 2000)
