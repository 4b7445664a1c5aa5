"""Text corpora for language-model training: read, tokenize once (cached), cut into fixed windows.

The default corpus is text present on every machine, the Python standard library's own sources,
read in sorted path order so every machine builds the same token stream.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path
from typing import Any

import torch

from reclaim.paths import cache_root

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
# Third-party packages and the test suites are not "the standard library's sources".
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test"}


def stdlib_files() -> list[Path]:
    """The standard library's *.py files (no site-packages, no test suites), sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p for p in root.rglob("*.py") if not _STDLIB_SKIP & set(p.relative_to(root).parts)
    )


def corpus_files(corpus: str) -> list[Path]:
    """Resolve a corpus spec: "stdlib", a text file, or a directory (its text files, sorted)."""
    if corpus == "stdlib":
        return stdlib_files()
    path = Path(corpus).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise ValueError(f"corpus directory {corpus!r} holds no {'/'.join(TEXT_SUFFIXES)} files")
        return files
    raise FileNotFoundError(f"corpus {corpus!r} is neither 'stdlib', a file, nor a directory")


def _fingerprint(files: list[Path], tokenizer: Any) -> str:
    """Cache key: file paths, sizes and mtimes, plus the tokenizer's identity and behaviour."""
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    probe = tokenizer("def f(x):\n    return x  # ünïcode", add_special_tokens=False)["input_ids"]
    h.update(json.dumps([getattr(tokenizer, "name_or_path", ""), len(tokenizer), probe,
                         tokenizer.eos_token_id]).encode())
    return h.hexdigest()[:16]


def tokenize_corpus(corpus: str | list[Path], tokenizer: Any, *, batch_files: int = 64) -> torch.Tensor:
    """One int32 token stream for the whole corpus (a spec, or its `corpus_files` already
    resolved), documents joined by EOS; cached on disk."""
    files = corpus_files(corpus) if isinstance(corpus, str) else corpus
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token_id; documents could not be separated")
    path = cache_root() / "corpus" / f"{_fingerprint(files, tokenizer)}.pt"
    if path.exists():
        return torch.load(path)
    ids: list[int] = []
    for i in range(0, len(files), batch_files):
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in files[i:i + batch_files]]
        for doc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            ids.extend(doc)
            ids.append(tokenizer.eos_token_id)
    tokens = torch.tensor(ids, dtype=torch.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(tokens, tmp)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
    return tokens


def num_windows(tokens: torch.Tensor, context_length: int) -> int:
    """How many non-overlapping context_length-token windows the stream holds."""
    n = tokens.numel() // context_length
    if n < 1:
        raise ValueError(
            f"context_length={context_length} is longer than the corpus ({tokens.numel()} tokens)"
        )
    return n


def window_batch(tokens: torch.Tensor, context_length: int, batch_size: int, seed: int,
                 index: int) -> torch.Tensor:
    """Batch `index` of a seeded epoch-wise shuffle of windows: a [batch, context_length] long.

    Depends only on (seed, index), so a resumed run draws exactly the batches it would have drawn.
    """
    n = num_windows(tokens, context_length)
    rows = []
    for j in range(index * batch_size, (index + 1) * batch_size):
        epoch, pos = divmod(j, n)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        w = int(torch.randperm(n, generator=gen, device=gen.device)[pos])
        rows.append(tokens[w * context_length:(w + 1) * context_length])
    return torch.stack(rows).long()
