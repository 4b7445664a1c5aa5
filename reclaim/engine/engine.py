"""The inference engine: requests in, incremental outputs out, one `step()` at a time.

Each step drains requests added or aborted from other threads, asks the scheduler what to run,
runs it through the model against the paged KV cache (similar-length chunks share a forward),
samples, detokenizes and checks stop conditions. Hooks for the other engines are explicit:
`forward_tokens` (several new tokens against a sequence's cache, e.g. speculative verification),
`on_forward` (hidden states of every chunk as it runs, e.g. to record a prompt's prefill) and
`update_weights` (swaps weights between steps and bumps `weights_version`).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from reclaim.engine.detokenize import IncrementalDetokenizer
from reclaim.engine.kv_cache import BlockManager, KVPool
from reclaim.engine.request import RequestOutput, SamplingParams, TokenLogprob
from reclaim.engine.sampling import make_generator, sample, token_logprobs
from reclaim.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput, Sequence
from reclaim.models.llama import ForwardOutput

DEFAULT_KV_CACHE_BYTES = 1 << 30


def cpu_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for an LM head on CPU: MKL's sgemm is fine for one row but about 1.6x
    slower than oneDNN for a few rows against a 50K-row weight (SmolLM2, 16 rows: 140 ms vs 89 ms)."""
    if x.numel() == x.shape[-1]:
        return torch.nn.functional.linear(x, weight)
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


HEAD_KERNELS = ("auto", "linear")


def head_kernel(device: torch.device, dtype: torch.dtype,
                kind: str = "auto") -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The matmul the engine uses for logits: 'auto' picks oneDNN for fp32 on CPU, 'linear' is
    plain `F.linear` (what transformers uses; benchmarks compare both)."""
    if kind not in HEAD_KERNELS:
        raise ValueError(f"head kernel {kind!r} is unknown; allowed: {list(HEAD_KERNELS)}")
    if kind == "auto" and device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        return cpu_linear
    return torch.nn.functional.linear


@dataclass
class ForwardRecord:
    """What one chunk's forward produced, handed to `on_forward` (hidden states, cache location)."""

    request_id: str
    start: int  # position of token_ids[0]
    token_ids: list[int]
    hidden: torch.Tensor  # [len(token_ids), hidden_size], final-norm hidden states
    block_ids: list[int]  # the sequence's block table; K/V of positions < start + len live there
    is_prefill: bool
    weights_version: int


@dataclass
class _Request:
    seq: Sequence
    generator: torch.Generator | None
    detok: IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None


def group_chunks(chunks: list[ScheduledChunk], max_waste: float = 0.25) -> list[list[ScheduledChunk]]:
    """Split a step's chunks into forwards of similar length, so padding stays within `max_waste`."""
    groups: list[list[ScheduledChunk]] = []
    cur: list[ScheduledChunk] = []
    work = 0
    for c in sorted(chunks, key=lambda c: c.num_tokens):
        if cur and (len(cur) + 1) * c.num_tokens > (1 + max_waste) * (work + c.num_tokens):
            groups.append(cur)
            cur, work = [], 0
        cur.append(c)
        work += c.num_tokens
    if cur:
        groups.append(cur)
    return groups


class Engine:
    """Continuous-batching generation over a paged KV cache for a reclaim LlamaForCausalLM."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        *,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 2048,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        eos_token_ids: list[int] | None = None,
        device: torch.device | str | None = None,
        seed: int = 0,
        on_forward: Callable[[list[ForwardRecord]], None] | None = None,
        head: str = "auto",
    ) -> None:
        cfg = model.config
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        dtype = param.dtype
        if max_model_len is None:
            max_model_len = cfg.max_position_embeddings
        if num_blocks is None:
            per_token = KVPool.bytes_per_token(
                cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype
            )
            budget_tokens = max(kv_cache_bytes // per_token, max_model_len)
            num_blocks = -(-min(budget_tokens, max_num_seqs * max_model_len) // block_size)
        self.blocks = BlockManager(num_blocks, block_size)
        self.pool = KVPool(
            cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
            dtype=dtype, device=self.device,
        )
        self.scheduler = Scheduler(
            self.blocks, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids if eos_token_ids is not None else self._default_eos())
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.on_forward = on_forward
        self._head = head_kernel(self.device, dtype, head)
        self.weights_version = 0
        self.last_schedule: SchedulerOutput | None = None
        self.num_preemptions = 0
        self._requests: dict[str, _Request] = {}
        self._inbox: list[tuple[str, Any]] = []  # ("add", _Request) | ("abort", request_id)
        self._inbox_lock = threading.Lock()  # add/abort may come from another thread
        self._step_lock = threading.RLock()  # one step, weight swap or forward_tokens at a time
        self._ids = itertools.count()

    def _default_eos(self) -> list[int]:
        ids = self.model.config.eos_token_id
        ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        return ids + ([tok_eos] if tok_eos is not None else [])

    # ---- requests (safe from any thread) ----

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
    ) -> str:
        """Queue a request (prompt text or token ids); returns its id. Runs from the next step()."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass prompt token ids instead")
            ids = list(self.tokenizer.encode(prompt))
        else:
            ids = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are out of range; allowed: 0 to {vocab - 1}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop={params.stop!r} needs a tokenizer to detokenize")
        if not 1 <= len(ids) < self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; allowed: 1 to {self.max_model_len - 1} "
                f"(max_model_len={self.max_model_len})"
            )
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        req = _Request(
            seq=Sequence(request_id, ids, len(ids), params),
            generator=make_generator(params.seed, self.device),
            detok=IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output),
            logprobs=[] if params.logprobs is not None else None,
        )
        with self._inbox_lock:
            pending = {r.seq.request_id for kind, r in self._inbox if kind == "add"}
            if request_id in self._requests or request_id in pending:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._inbox.append(("add", req))
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks at the next step (which reports finish_reason 'abort')."""
        with self._inbox_lock:
            self._inbox.append(("abort", request_id))

    def has_unfinished(self) -> bool:
        with self._inbox_lock:
            return bool(self._inbox) or self.scheduler.has_unfinished()

    def stats(self) -> dict[str, int]:
        """Queue lengths and KV cache use."""
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_used": self.blocks.num_used,
            "kv_blocks_total": self.blocks.num_blocks,
            "num_preemptions": self.num_preemptions,
            "weights_version": self.weights_version,
        }

    # ---- stepping ----

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns an output for every request that changed."""
        with self._step_lock:
            outputs = self._drain_inbox()
            sched = self.scheduler.schedule()
            self.last_schedule = sched
            self.num_preemptions += len(sched.preempted)
            if not sched.chunks:
                return outputs
            sampled = self._execute(sched.chunks)
            for rid, (token, lp) in sampled.items():
                outputs.append(self._append_token(self._requests[rid], token, lp))
            return outputs

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
        outputs = []
        for kind, item in inbox:
            if kind == "add":
                self._requests[item.seq.request_id] = item
                self.scheduler.add(item.seq)
            elif item in self._requests:
                req = self._requests[item]
                self.scheduler.remove(item)
                outputs.append(self._finish(req, "abort", []))
        return outputs

    def _execute(self, chunks: list[ScheduledChunk]) -> dict[str, tuple[int, TokenLogprob | None]]:
        """Run the chunks' forwards and sample where a chunk ends its sequence."""
        want_hidden = self.on_forward is not None
        rows: list[_Request] = []
        last: list[torch.Tensor] = []  # final hidden state of each row that samples
        records: list[ForwardRecord] = []
        with torch.inference_mode():
            for group in group_chunks(chunks):
                seqs = [self._requests[c.request_id].seq for c in group]
                ids = [s.token_ids[c.start:c.start + c.num_tokens] for s, c in zip(seqs, group)]
                hidden = self._forward(seqs, [c.start for c in group], ids).hidden
                for i, c in enumerate(group):
                    if c.sample:
                        rows.append(self._requests[c.request_id])
                        last.append(hidden[i, c.num_tokens - 1])
                    if want_hidden:
                        records.append(ForwardRecord(
                            c.request_id, c.start, ids[i], hidden[i, : c.num_tokens],
                            list(self.blocks.tables[c.request_id]), c.is_prefill, self.weights_version,
                        ))
            if records:
                self.on_forward(records)
            if not rows:
                return {}
            x = self.logits(torch.stack(last))
            params = [r.seq.params for r in rows]
            tokens = sample(x, params, [r.generator for r in rows], self.generator)
            lps: list[TokenLogprob | None] = [None] * len(rows)
            want = [i for i, p in enumerate(params) if p.logprobs is not None]
            if want:
                got = token_logprobs(x[want], [tokens[i] for i in want], [params[i].logprobs for i in want])
                for i, lp in zip(want, got):
                    lps[i] = lp
        return {r.seq.request_id: (t, lp) for r, t, lp in zip(rows, tokens, lps)}

    def _forward(self, seqs: list[Sequence], starts: list[int], ids: list[list[int]]) -> ForwardOutput:
        """One model forward over new tokens `ids[i]` placed at `starts[i]` of each sequence.

        Returns the final hidden states only; `logits()` applies the head where it is needed.
        """
        new = [len(x) for x in ids]
        t = max(new)
        view = self.pool.view([self.blocks.tables[s.request_id] for s in seqs], starts, new)
        input_ids = torch.tensor([x + [0] * (t - len(x)) for x in ids], device=self.device)
        return self.model(input_ids, view.positions, view, return_hidden=True, compute_logits=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits from final hidden states [..., H], as the model's lm_head computes them."""
        head = self.model.lm_head
        out = self._head(hidden, head.weight)
        if head.bias is not None:
            out = out + head.bias
        return out.float()

    def _append_token(self, req: _Request, token: int, lp: TokenLogprob | None) -> RequestOutput:
        seq, p = req.seq, req.seq.params
        seq.token_ids.append(token)
        if lp is not None:
            req.logprobs.append(lp)
        reason = None
        if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
            reason = "stop"  # the stop token stays in token_ids but adds no text
        elif req.detok.add(token):
            reason = "stop"
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is None:
            return self._output(req, [token], req.detok.delta(final=False))
        self.scheduler.remove(seq.request_id)
        return self._finish(req, reason, [token])

    def _finish(self, req: _Request, reason: str, new_ids: list[int]) -> RequestOutput:
        req.finish_reason = reason
        req.detok.flush()
        out = self._output(req, new_ids, req.detok.delta(final=True))
        del self._requests[req.seq.request_id]
        return out

    def _output(self, req: _Request, new_ids: list[int], delta: str) -> RequestOutput:
        seq = req.seq
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            token_ids=list(seq.output_token_ids),
            text=req.detok.text[: req.detok.emitted],
            new_token_ids=new_ids,
            delta_text=delta,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            finished=req.finish_reason is not None,
            finish_reason=req.finish_reason,
            weights_version=self.weights_version,
        )

    # ---- convenience and hooks ----

    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run prompts to completion; returns each prompt's final output, in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts; need one or equal")
        ids = [self.add_request(None, p, sp) for p, sp in zip(prompts, plist)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def forward_tokens(
        self, request_id: str, token_ids: list[int], *, return_hidden: bool = False
    ) -> ForwardOutput:
        """Run `token_ids` after a running sequence's cached prefix; logits at every new token.

        Their K/V are written after the prefix but the sequence is not advanced: the caller
        (speculative verification, chunked prefill) decides what to keep.
        """
        with self._step_lock:
            req = self._requests.get(request_id)
            if req is None:
                raise ValueError(f"unknown request_id {request_id!r}; running: {sorted(self._requests)}")
            seq = req.seq
            end = seq.num_computed + len(token_ids)
            if not token_ids or end > self.max_model_len:
                raise ValueError(
                    f"{len(token_ids)} tokens after {seq.num_computed} cached; need 1 to "
                    f"{self.max_model_len - seq.num_computed} (max_model_len={self.max_model_len})"
                )
            if not self.blocks.allocate(request_id, end):
                raise RuntimeError(f"KV cache full: no blocks for {len(token_ids)} more tokens of {request_id!r}")
            with torch.inference_mode():
                hidden = self._forward([seq], [seq.num_computed], [list(token_ids)]).hidden
                return ForwardOutput(self.logits(hidden), hidden if return_hidden else None)

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> int:
        """Copy new weights in between steps (the names of model.state_dict()); returns the new version."""
        with self._step_lock:
            own = self.model.state_dict()
            unknown = sorted(set(state_dict) - set(own))
            if unknown:
                raise ValueError(f"unknown parameter names {unknown[:5]}; expected names of model.state_dict()")
            with torch.no_grad():
                for name, value in state_dict.items():
                    if own[name].shape != value.shape:
                        raise ValueError(
                            f"{name}: shape {tuple(value.shape)} does not match {tuple(own[name].shape)}"
                        )
                    own[name].copy_(value)
            self.weights_version += 1
            return self.weights_version
