"""The held-out probe set and the regression gate: an update that makes the model worse on it is
undone.

A probe file is JSON lines, each `{"prompt": ..., "answer": ...}` (the loss is on the answer's
tokens after the prompt's) or `{"text": ...}` (the loss is on every token after the first); the
texts are tokenized as the trainer tokenizes corrections. The probe loss is the mean negative
log-likelihood per scored token, in nats, under no_grad.

    probes = load_probes("probe.jsonl")              # ValueError naming the file and line
    gate = RegressionGate(probes, tokenize, max_regression=0.05)
    gate.reset(model)                                # the loss of the weights now
    verdict = gate.check(model)                      # after an update: accept it, or not
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from reclaim.online.recorder import recompute_loss


@dataclass(frozen=True)
class Probe:
    """One held-out example: the loss is on `answer` after `prompt` (empty: a plain text)."""

    prompt: str
    answer: str


def load_probes(path: str | os.PathLike) -> list[Probe]:
    """Read a probe file; a line that does not parse is refused naming the file and line number."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"probe file {str(path)!r} does not exist")
    probes = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"probe file {str(path)!r} line {n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg}); each line must be "
                             '{"prompt": ..., "answer": ...} or {"text": ...}') from None
        if isinstance(row, dict) and set(row) == {"prompt", "answer"}:
            prompt, answer = row["prompt"], row["answer"]
        elif isinstance(row, dict) and set(row) == {"text"}:
            prompt, answer = "", row["text"]
        else:
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"{where}: got {keys}; each line must be "
                             '{"prompt": ..., "answer": ...} or {"text": ...}')
        if not isinstance(prompt, str) or not isinstance(answer, str) or not answer:
            raise ValueError(f"{where}: prompt must be a string and answer (or text) a non-empty "
                             "string")
        probes.append(Probe(prompt, answer))
    if not probes:
        raise ValueError(f"probe file {str(path)!r} has no examples")
    return probes


def tokenized(probes: list[Probe], tokenize: Callable[[str], list[int]], max_len: int
              ) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, scored ids) per probe; a text's first token is its prompt. Refuses a probe
    that tokenizes to nothing to score or does not fit `max_len` positions."""
    prompts, answers = [], []
    for i, p in enumerate(probes):
        prompt, answer = list(tokenize(p.prompt)) if p.prompt else [], list(tokenize(p.answer))
        if not prompt:
            prompt, answer = answer[:1], answer[1:]
        if not prompt or not answer or len(prompt) + len(answer) > max_len:
            raise ValueError(f"probe {i + 1}: {len(prompt)} prompt and {len(answer)} scored tokens; "
                             f"allowed: at least 1 of each, {max_len} in all")
        prompts.append(prompt)
        answers.append(answer)
    return prompts, answers


@dataclass(frozen=True)
class Verdict:
    """What the gate made of an update: the probe loss before and after, and whether it stays."""

    before: float
    after: float
    accepted: bool


class RegressionGate:
    """Measures the probe loss after each update; refuses an update that raises it by more than
    `max_regression` nats per token over the loss of the weights it started from."""

    def __init__(self, probes: list[Probe], tokenize: Callable[[str], list[int]],
                 max_regression: float, max_len: int, batch: int = 8) -> None:
        if not max_regression >= 0:
            raise ValueError(f"max_probe_regression={max_regression}; allowed: >= 0 (nats per token)")
        self.prompts, self.answers = tokenized(probes, tokenize, max_len)
        self.max_regression, self.batch = max_regression, batch
        self.loss: float | None = None  # of the weights the next update starts from
        self.rejected = 0
        self.accepted = 0

    @torch.no_grad()
    def measure(self, model: torch.nn.Module) -> float:
        """The probe loss of the weights now (mean NLL per scored token)."""
        total, tokens = 0.0, sum(map(len, self.answers))
        for i in range(0, len(self.prompts), self.batch):
            part, _ = recompute_loss(model, self.prompts[i:i + self.batch], self.answers[i:i + self.batch])
            total += float(part)
        return total / tokens

    def reset(self, model: torch.nn.Module) -> float:
        """Measure the weights an update will start from (at start-up, after a rollback)."""
        self.loss = self.measure(model)
        return self.loss

    def check(self, model: torch.nn.Module) -> Verdict:
        """Judge the update just applied; an accepted one's loss is the next baseline."""
        before = self.loss if self.loss is not None else float("nan")
        after = self.measure(model)
        ok = not after - before > self.max_regression
        if ok:
            self.loss = after
            self.accepted += 1
        else:
            self.rejected += 1
        return Verdict(before, after, ok)
