"""The online trainer's planner: per sample, reuse its prompt record or recompute the prompt, by
what each costs (`CostModel`, timed on the model at start-up), with the reason (a `Decision`).

    cost = CostModel.measure(model)
    decisions = plan(samples, [store.info(s.response_id) for s in samples], version, 0, cost)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from reclaim.online.recorder import record_prompt, recompute_loss, reuse_loss
from reclaim.online.store import RecordInfo


@dataclass(frozen=True)
class CostModel:
    """What reusing a sample's record saves and costs, in seconds. Reuse skips the prompt's
    forward, forward_fixed_s + forward_s_per_token * P for P prompt tokens (the backward is the
    same either way), and pays reuse_overhead_s (attaching the record) plus reload_s_per_byte
    per byte of a record offloaded to host memory. The planner reuses when it saves more.
    Serving pays for a record too (`record_extra_s`): the prefill's forward with autograd over
    the inference one, plus a forward of its own for the decode rows of that engine step (a
    recorded prefill is not batched with them), inference_fixed_s."""

    forward_fixed_s: float
    forward_s_per_token: float
    reuse_overhead_s: float
    reload_s_per_byte: float
    inference_fixed_s: float = 0.0
    inference_s_per_token: float = 0.0

    def saved_s(self, prompt_tokens: int) -> float:
        return self.forward_fixed_s + self.forward_s_per_token * prompt_tokens

    def record_extra_s(self, prompt_tokens: int) -> float:
        """Serving seconds recording a prompt of this many tokens adds to its engine step; 0
        when the inference forward was not measured."""
        if not (self.inference_fixed_s or self.inference_s_per_token):
            return 0.0
        inference = self.inference_fixed_s + self.inference_s_per_token * prompt_tokens
        return max(self.saved_s(prompt_tokens) - inference, 0.0) + self.inference_fixed_s

    def cost_s(self, info: RecordInfo) -> float:
        reload = info.nbytes * self.reload_s_per_byte if info.where == "host" else 0.0
        return self.reuse_overhead_s + reload

    @classmethod
    def fixed(cls, prefer: str) -> "CostModel":
        """A model that always prefers `prefer` ("reuse" or "recompute")."""
        return cls(1e9, 0.0, 0.0, 0.0) if prefer == "reuse" else cls(0.0, 0.0, 1e9, 0.0)

    @classmethod
    def measure(cls, model: torch.nn.Module, prompt_tokens: Sequence[int] = (64, 256),
                response_tokens: int = 32, repeats: int = 2) -> "CostModel":
        """Time on `model` the prompt's forward with autograd and without at two prompt lengths
        (the lines through them), the reuse overhead (a reused step less the recompute step
        without its prompt forward) at the shorter, and a host reload; the best of `repeats` runs
        (the machine may be shared)."""
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(0)
        dev = next(model.parameters()).device  # token ids are drawn on the CPU, run where the model is

        def best(fn: Callable[[object], object], setup: Callable[[], object] = lambda: None) -> float:
            out = math.inf
            for _ in range(repeats):
                model.zero_grad(set_to_none=True)
                arg = setup()
                t = time.perf_counter()
                fn(arg)
                if dev.type == "cuda":  # kernels run asynchronously: wait for them
                    torch.cuda.synchronize(dev)
                out = min(out, time.perf_counter() - t)
            return out

        forward, inference = [], []
        for p in prompt_tokens:
            ids = torch.randint(vocab, (1, p), generator=g, device=g.device).to(dev)
            with torch.enable_grad():
                forward.append(best(lambda _: model(ids, return_hidden=True, compute_logits=False)))
            with torch.inference_mode():
                inference.append(best(lambda _: model(ids, return_hidden=True, compute_logits=False)))

        def line(ts: list[float]) -> tuple[float, float]:
            """(fixed seconds, seconds per token) through the two lengths' times."""
            slope = max((ts[-1] - ts[0]) / max(prompt_tokens[-1] - prompt_tokens[0], 1), 0.0)
            return max(ts[0] - slope * prompt_tokens[0], 0.0), slope

        p0, f0 = prompt_tokens[0], forward[0]
        (fixed, slope), (inf_fixed, inf_slope) = line(forward), line(inference)
        prompt = torch.randint(vocab, (p0,), generator=g, device=g.device).tolist()
        resp = torch.randint(vocab, (response_tokens,), generator=g, device=g.device).tolist()
        with torch.enable_grad():
            recompute = best(lambda _: recompute_loss(model, [prompt], [resp])[0].backward())
            reuse = best(lambda rec: reuse_loss(model, [rec], [resp])[0].backward(),
                         lambda: record_prompt(model, prompt, response_id="probe", version=0))
        model.zero_grad(set_to_none=True)
        buf = torch.empty(4 << 20)  # 16 MiB
        t = time.perf_counter()
        buf.to(dev, copy=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        per_byte = (time.perf_counter() - t) / buf.nbytes
        return cls(fixed, slope, max(reuse - (recompute - f0), 0.0), per_byte, inf_fixed, inf_slope)


@dataclass(frozen=True)
class Sample:
    """One thing to train on: the prompt and the response tokens the loss is on."""

    feedback_id: int
    response_id: str
    prompt_ids: list[int]
    response_ids: list[int]


@dataclass(frozen=True)
class Decision:
    """Reuse or recompute one sample, and why: record (exact reuse), record_stale (within
    max_staleness, gradient stopped at the prompt), no_record, evicted, stale, cost."""

    feedback_id: int
    response_id: str
    action: str  # "reuse" | "recompute"
    reason: str
    prompt_tokens: int
    saved_s: float  # the cost model's estimates: the prompt forward reuse skips,
    cost_s: float | None  # and what reusing the record costs (None: no usable record)


def plan(samples: Sequence[Sample], infos: Sequence[RecordInfo], version: int, max_staleness: int,
         cost: CostModel) -> list[Decision]:
    """Per sample, reuse its record when it exists, is recent enough and saves more time than
    it costs."""
    out = []
    for s, info in zip(samples, infos, strict=True):
        p = len(s.prompt_ids)
        d = Decision(s.feedback_id, s.response_id, "recompute", "", p, cost.saved_s(p), None)
        if info.status != "present":
            d = replace(d, reason="no_record" if info.status == "missing" else info.status)
        elif info.prompt_tokens != p:
            d = replace(d, reason="no_record")  # a record of another prompt: never attach it
        elif not 0 <= version - info.version <= max_staleness:
            d = replace(d, reason="stale")
        else:
            d = replace(d, cost_s=cost.cost_s(info))
            if d.cost_s >= d.saved_s:
                d = replace(d, reason="cost")
            else:
                d = replace(d, action="reuse",
                            reason="record" if info.version == version else "record_stale")
        out.append(d)
    return out
