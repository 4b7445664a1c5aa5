"""The inference engine: requests in, incremental outputs out, one `step()` at a time.

Each step drains requests added or aborted from other threads, asks the scheduler what to run
(a plain `SchedulerOutput`), has the model runner run it against the paged KV cache, samples,
and commits the tokens through the output processor (detokenize, stop checks, deltas). A failure
that belongs to one request (its sampling, its stop strings, its detokenization) fails that
request alone; the step goes on for the others.

Hooks for the other engines are explicit: `on_forward` (hidden states of every chunk as it runs,
e.g. to record a prompt's prefill) and `update_weights` (swaps weights between steps and bumps
`weights_version`; cached K/V of running requests is recomputed with the new weights unless
`kv_on_weight_update="keep"`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from reclaim.engine.detokenize import IncrementalDetokenizer
from reclaim.engine.kv_cache import BlockManager, plan_kv_blocks
from reclaim.engine.output import RequestState, commit, output
from reclaim.engine.request import RequestOutput, SamplingParams
from reclaim.engine.runner import ModelRunner, Row
from reclaim.engine.sampling import keyed_uniform, make_generator, process_logits, sample_each, token_logprobs
from reclaim.engine.drafters import HYBRID_MODES, make_drafter
from reclaim.engine.speculative import Draft, Drafter, DraftRequest, SpeculativeConfig
from reclaim.engine.spec_policy import DepthController, SpecGate, StepCosts
from reclaim.engine.rejection import accept, accept_keyed, accept_tree, accept_tree_keyed
from reclaim.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput, Sequence

log = logging.getLogger("reclaim.engine")

DEFAULT_KV_CACHE_BYTES = 1 << 30
# What happens to running requests' cached K/V when weights change: recompute it with the new
# weights (exact: no token is conditioned on old-weights K/V), or keep it (cheaper, mixes versions).
KV_ON_WEIGHT_UPDATE = ("recompute", "keep")


class Recorder(Protocol):
    """Runs a recorded request's whole prompt forward (e.g. with autograd, kept for training)
    and hands back what serving needs: each layer's K and V ([1, Hkv, P, D]) and the final
    hidden states ([P, H], or only the last one, [H]: then the request gets no prompt logprobs
    and no drafts). Called inside the step, between forwards; tensors are copied."""

    def __call__(self, request_id: str, prompt_ids: list[int], weights_version: int
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        ...


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
        kv_on_weight_update: str = "recompute",
        speculative: SpeculativeConfig | None = None,
        drafter: Drafter | None = None,
        recorder: Recorder | None = None,
    ) -> None:
        cfg = model.config
        param = next(model.parameters())
        device = torch.device(device) if device is not None else param.device
        if kv_on_weight_update not in KV_ON_WEIGHT_UPDATE:
            raise ValueError(f"kv_on_weight_update={kv_on_weight_update!r}; allowed: {list(KV_ON_WEIGHT_UPDATE)}")
        dtype = param.dtype
        if max_model_len is None:
            max_model_len = cfg.max_position_embeddings
        if num_blocks is None:
            num_blocks = plan_kv_blocks(cfg, kv_cache_bytes=kv_cache_bytes, block_size=block_size,
                                        max_model_len=max_model_len, max_num_seqs=max_num_seqs, dtype=dtype)
        self.blocks = BlockManager(num_blocks, block_size)
        self.runner = ModelRunner(model, self.blocks, device, head=head)
        self.model, self.device = self.runner.model, device
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(
            self.blocks, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids if eos_token_ids is not None else self._default_eos())
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.on_forward = on_forward
        self.recorder = recorder
        # False: a request is served unrecorded when another one waits for its first token (a
        # recorded prefill is slower, and would hold that one up)
        self.record_when_queued = True
        # may_record(prompt_tokens): whether a recorded request's prefill starting now is recorded
        # (None: always); a refused one is served unrecorded, as above
        self.may_record: Callable[[int], bool] | None = None
        self.num_recorded = 0
        self.num_record_failures = 0
        self.num_record_skipped = 0
        self._partial: set[str] = set()  # recorded without every prompt hidden state: never drafted
        self.kv_on_weight_update = kv_on_weight_update
        self.speculative = speculative
        self.drafter = drafter if drafter is not None or speculative is None else make_drafter(speculative, self.model)
        self.spec_stats = {"verifies": 0, "drafted": 0, "accepted": 0, "draft_seconds": 0.0, "draft_calls": 0,
                           "plain_decodes": 0}
        self.step_costs = StepCosts()  # decode steps' seconds by batch and draft tokens
        self._gates: dict[tuple[str, ...], SpecGate] = {}
        self.spec_gate = self._gate(speculative)  # which arm pays, per batch size (dynamic depth)
        self.depths = self._depth_controller(speculative, self.step_costs)
        self.weights_version = 0
        self.last_schedule: SchedulerOutput | None = None
        self.num_preemptions = 0
        self.num_request_errors = 0
        self._requests: dict[str, RequestState] = {}
        self._inbox: list[tuple[str, Any]] = []  # ("add", RequestState) | ("abort", request_id)
        self._inbox_lock = threading.Lock()  # add/abort may come from another thread
        self._step_lock = threading.RLock()  # one step or weight swap at a time
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
        *,
        record: bool = False,
    ) -> str:
        """Queue a request (prompt text or token ids); returns its id. Runs from the next step().

        record: run its prefill through the engine's `recorder` (e.g. with autograd, kept for
        training on feedback later: reclaim/online); the engine then serves from that forward.
        """
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
        if record and self.recorder is None:
            raise ValueError("record=True needs an engine built with a recorder (serve --learn)")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        req = RequestState(
            seq=Sequence(request_id, ids, len(ids), params, record=record),
            generator=make_generator(params.seed, self.device),
            detok=IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
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

    def awaits_first_token(self) -> bool:
        """Some request has not produced its first token yet: it is queued, or admitted with its
        prefill not done (what co-located training must not delay: time to first token)."""
        return self._awaiting_first_token(but=None)

    def _awaiting_first_token(self, but: str | None) -> bool:
        with self._inbox_lock:
            if any(kind == "add" for kind, _ in self._inbox):
                return True
        sched = self.scheduler
        return bool(sched.waiting) or any(s.num_tokens == s.num_prompt_tokens and s.request_id != but
                                          for s in sched.running)

    def stats(self) -> dict[str, int]:
        """Queue lengths and KV cache use."""
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_used": self.blocks.num_used,
            "kv_blocks_total": self.blocks.num_blocks,
            "num_preemptions": self.num_preemptions,
            "num_request_errors": self.num_request_errors,
            "num_shared_prefix_tokens": self.scheduler.num_shared_tokens,
            "num_recorded": self.num_recorded,
            "num_record_failures": self.num_record_failures,
            "num_record_skipped": self.num_record_skipped,
            "weights_version": self.weights_version,
            **{f"spec_{k}": v for k, v in self.spec_stats.items()},
        }

    # ---- stepping ----

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns an output for every request that changed."""
        with self._step_lock:
            outputs = self._drain_inbox()
            spec = self.speculative
            batch = len(self.scheduler.running)
            speculate = spec is not None and batch <= spec.max_batch
            arm = spec.method if speculate else "plain"
            # dynamic: the arm that pays at this batch size (the history drafter decides per draft
            # itself, from its measured acceptance and the measured cost of a draft token)
            if speculate and self.depths is not None and spec.method != "suffix":
                arm = self.spec_gate.choose(batch)
                speculate = arm != "plain"
                if not speculate:
                    self.spec_stats["plain_decodes"] += batch
                elif arm in HYBRID_MODES and hasattr(self.drafter, "mode"):
                    self.drafter.mode = arm
            sched = self.scheduler.schedule(self._lookahead if speculate else 0)
            self.last_schedule = sched
            self.num_preemptions += len(sched.preempted)
            share = getattr(self.drafter, "share", None)
            for dst, src, n in sched.shared if share is not None else []:
                share(src, dst, n)
            if not sched.chunks:
                return outputs
            t0, drafted, verified = time.perf_counter(), self.spec_stats["drafted"], self.spec_stats["verifies"]
            executed = self._execute(sched.chunks)
            if self.depths is not None and not any(c.is_prefill for c in sched.chunks):
                # what decode-only steps cost and yield: the depths and the gate go by them
                seconds, drafted = time.perf_counter() - t0, self.spec_stats["drafted"] - drafted
                self.step_costs.observe(len(sched.chunks), drafted, seconds, self.spec_stats["verifies"] - verified)
                committed = sum(len(t) for _, t, _ in executed if not isinstance(t, Exception))
                self.spec_gate.update(len(sched.chunks), arm if drafted > 0 else "plain", committed, seconds)
            for rid, tokens, lps in executed:
                req = self._requests[rid]
                if isinstance(tokens, Exception):
                    outputs.append(self._fail(req, tokens))
                    continue
                try:
                    out = commit(req, tokens, lps, self.weights_version, self.eos_token_ids, self.max_model_len)
                except Exception as exc:  # noqa: BLE001 - its detokenizer or stop strings: it alone fails
                    outputs.append(self._fail(req, exc))
                    continue
                if out.finished:
                    self._release(req)
                outputs.append(out)
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
                req.finish_reason = "abort"
                self._release(req)
                outputs.append(output(req, [], [] if req.logprobs is not None else None, self.weights_version))
        return outputs

    def _gate(self, spec: SpeculativeConfig | None) -> SpecGate:
        """The gate over plain and the method, or for a hybrid drafter each of its modes (one per
        set of arms, kept across config changes: what it measured stays)."""
        if spec is not None and spec.method == "hybrid" and hasattr(self.drafter, "mode"):
            arms = ("plain", *HYBRID_MODES)
        else:
            arms = ("plain", spec.method if spec is not None else "spec")
        if arms not in self._gates:
            self._gates[arms] = SpecGate(arms)
        return self._gates[arms]

    @staticmethod
    def _depth_controller(spec: SpeculativeConfig | None, costs: StepCosts) -> DepthController | None:
        if spec is None or not spec.dynamic_depth:
            return None
        return DepthController(spec.num_speculative_tokens, spec.draft_overhead, spec.draft_token_cost,
                               costs=costs)

    def _lookahead(self, seq: Any) -> int:
        """Draft tokens to make room for after this decode: the config's, or with dynamic depth
        the request's own (a chain that deep; a tree whole or not at all; 0: decode plainly)."""
        spec = self.speculative
        if not self._can_speculate(seq.params):
            return 0
        if self.depths is None or spec.history:  # a history draft's size follows its own confidence
            return spec.lookahead
        k = self.depths.depth(seq.request_id, len(self.scheduler.running))
        if k == 0:
            self.spec_stats["plain_decodes"] += 1
        return spec.lookahead if spec.tree and k else k

    def _can_speculate(self, params: SamplingParams) -> bool:
        """Requests whose logits are processed speculate in chains only (each draft position's
        logits processed as if the draft tokens before it were committed), and a grammar must
        be able to roll back the draft tokens it was advanced over."""
        if not params.processes_logits:
            return True
        return not self.speculative.tree and (params.constraint is None
                                                     or hasattr(params.constraint, "rollback"))

    def _release(self, req: RequestState) -> None:
        """Forget a finished request and free its blocks."""
        self.scheduler.remove(req.seq.request_id)
        del self._requests[req.seq.request_id]
        self._partial.discard(req.seq.request_id)
        if self.depths is not None:
            self.depths.release(req.seq.request_id)
        if self.drafter is not None:
            self.drafter.finish(req.seq.request_id, req.seq.token_ids, req.seq.num_prompt_tokens)
            self.drafter.release(req.seq.request_id)

    def _fail(self, req: RequestState, exc: Exception) -> RequestOutput:
        """End one request with finish_reason 'error' (the others in the step go on)."""
        log.warning("request %s failed: %r", req.seq.request_id, exc)
        self.num_request_errors += 1
        req.finish_reason, req.error = "error", f"{type(exc).__name__}: {exc}"
        self._release(req)
        try:
            return output(req, [], [] if req.logprobs is not None else None, self.weights_version)
        except Exception:  # noqa: BLE001 - even its text is broken: report it without text
            return RequestOutput(req.seq.request_id, [], "", None, True, "error", self.weights_version,
                                 req.first_version or self.weights_version, error=req.error)

    def _execute(self, chunks: list[ScheduledChunk]) -> list[tuple[str, list[int] | Exception, list | None]]:
        """Run the chunks' forwards (decodes with a draft verify it in the same forward) and choose
        the tokens of each chunk that ends its sequence: (request id, tokens to commit or the
        exception that failed that request alone, their logprobs or None)."""
        drafts = self._drafts(chunks)
        recorded = self._record(chunks)
        rows = []
        for c in chunks:
            seq = self._requests[c.request_id].seq
            draft = drafts.get(c.request_id, Draft())
            rows.append(Row(c.request_id, c.start, seq.token_ids[c.start:c.start + c.num_tokens] + draft.tokens,
                            None if draft.parents is None else [-1] + [p + 1 for p in draft.parents]))
        with torch.inference_mode():
            run = [i for i, c in enumerate(chunks) if c.request_id not in recorded]
            hidden: list[torch.Tensor] = [None] * len(chunks)
            feats: list[torch.Tensor | None] = [None] * len(chunks)  # what the drafter observes
            aux = getattr(self.drafter, "aux_layers", None)  # EAGLE-3: the states entering these layers
            for i, (h, f) in zip(run, self.runner.run_features([rows[i] for i in run], aux) if run else []):
                hidden[i], feats[i] = h, f
            for i, c in enumerate(chunks):
                if c.request_id in recorded:  # a recorded prefill has no aux states: EAGLE-3 does not draft it
                    hidden[i] = recorded[c.request_id]
                    feats[i] = hidden[i] if aux is None else None
            if self.on_forward is not None:
                self.on_forward([
                    ForwardRecord(c.request_id, c.start, r.token_ids[: c.num_tokens], h[: c.num_tokens],
                                  list(self.blocks.tables[c.request_id]), c.is_prefill, self.weights_version)
                    for c, r, h in zip(chunks, rows, hidden)
                ])
            for c, r, f in zip(chunks, rows, feats):
                if not c.sample and self.drafter is not None and c.request_id not in self._partial and f is not None:
                    self.drafter.observe(c.request_id, c.start, r.token_ids, f)
            for c, h in zip(chunks, hidden):
                if c.is_prefill and self._requests[c.request_id].seq.params.prompt_logprobs is not None:
                    self._prompt_logprobs(self._requests[c.request_id], c, h)
            sampling = [i for i, c in enumerate(chunks) if c.sample]
            if not sampling:
                return []
            # Logits where tokens are chosen: a chunk's last token, and every draft token after it.
            spans = [(chunks[i].num_tokens - 1, len(rows[i].token_ids)) for i in sampling]
            x = self.runner.logits(torch.cat([hidden[i][a:b] for i, (a, b) in zip(sampling, spans)]))
            per_row = list(torch.split(x, [b - a for a, b in spans]))
            reqs = [self._requests[chunks[i].request_id] for i in sampling]
            plain = [j for j, i in enumerate(sampling) if chunks[i].request_id not in drafts]
            chosen: list[list[int] | Exception] = [[] for _ in sampling]
            rows_x = {}
            for j in plain:
                try:
                    rows_x[j] = self._processed(reqs[j], per_row[j][0])
                except Exception as exc:  # noqa: BLE001 - its constraint or processors: it alone fails
                    chosen[j] = exc
            plain = [j for j in plain if j in rows_x]
            if plain:
                got = sample_each(torch.stack([rows_x[j] for j in plain]), [reqs[j].seq.params for j in plain],
                                  [self._randomness(reqs[j]) for j in plain], self.generator)
                for j, t in zip(plain, got):
                    chosen[j] = t if isinstance(t, Exception) else [t]
            for j, i in enumerate(sampling):
                if chunks[i].request_id in drafts:
                    chosen[j] = self._verify(chunks[i], reqs[j], per_row[j], drafts[chunks[i].request_id], feats[i])
                elif self.drafter is not None and not isinstance(chosen[j], Exception) \
                        and chunks[i].request_id not in self._partial and feats[i] is not None:
                    c = chunks[i]
                    self.drafter.observe(c.request_id, c.start, rows[i].token_ids, feats[i])
            out = []
            for j, req in enumerate(reqs):
                lps = None
                if req.seq.params.logprobs is not None and not isinstance(chosen[j], Exception):
                    n = len(chosen[j])
                    lps = token_logprobs(per_row[j][:n], chosen[j], [req.seq.params.logprobs] * n)
                out.append((req.seq.request_id, chosen[j], lps))
        return out

    def _record(self, chunks: list[ScheduledChunk]) -> dict[str, torch.Tensor]:
        """Run the recorder for recorded requests whose prefill starts now: the whole prompt at
        once (whatever the step's token budget), its K/V written into the cache, recorded once
        (a later recompute after preemption is an ordinary prefill). The chunk becomes the whole
        prompt; returns each one's final hidden states [P, H]."""
        out = {}
        for c in chunks:
            seq = self._requests[c.request_id].seq
            if not (seq.record and c.start == 0 and c.is_prefill):
                continue
            p = seq.num_prompt_tokens
            if (not self.record_when_queued and self._awaiting_first_token(but=seq.request_id)) \
                    or (self.may_record is not None and not self.may_record(p)):
                seq.record = False  # served unrecorded (training recomputes its prompt)
                self.num_record_skipped += 1
                continue
            if not self.blocks.allocate(seq.request_id, p):
                continue  # no room for the whole prompt now: an ordinary prefill, not recorded
            try:
                keys, values, hidden = self.recorder(seq.request_id, seq.token_ids[:p], self.weights_version)
                hidden = hidden.detach().to(self.device)
                if hidden.dim() == 1 and seq.params.prompt_logprobs is not None:
                    raise ValueError("prompt_logprobs need the recorder's hidden states at every prompt position")
            except Exception as exc:  # noqa: BLE001 - the request is served, just not recorded
                log.warning("recording %s failed, serving it unrecorded: %r", seq.request_id, exc)
                self.num_record_failures += 1
                continue
            self.runner.write_kv(seq.request_id, 0, keys, values)
            c.num_tokens, c.sample, seq.num_computed, seq.record = p, True, p, False
            self.num_recorded += 1
            if hidden.dim() == 1:  # the last position only: stand-in rows, nothing else reads them
                self._partial.add(seq.request_id)
                hidden = hidden.expand(p, -1)
            out[seq.request_id] = hidden.reshape(p, -1)
        return out

    @staticmethod
    def _randomness(req: RequestState):
        """A seeded request draws its next token with the uniform keyed by (seed, position), so
        its output is the same with or without speculation; others use their generator."""
        seed = req.seq.params.seed
        return req.generator if seed is None else keyed_uniform(seed, req.seq.num_tokens)

    def _processed(self, req: RequestState, logits: torch.Tensor) -> torch.Tensor:
        """A row's logits after its logits processors and constraint (as is when it has none)."""
        p = req.seq.params
        if not p.processes_logits:
            return logits
        seq = req.seq
        stop = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
        return process_logits(logits, p, seq.token_ids[: seq.num_prompt_tokens], seq.output_token_ids, stop)

    def _prompt_logprobs(self, req: RequestState, chunk: ScheduledChunk, hidden: torch.Tensor) -> None:
        """Logprobs of the prompt tokens this prefill chunk predicts (position j predicts j + 1)."""
        seq, k = req.seq, req.seq.params.prompt_logprobs
        have = 1 + len(req.prompt_logprobs)  # prompt tokens with a logprob (the first has none)
        end = min(chunk.start + chunk.num_tokens, seq.num_prompt_tokens - 1)  # last predicting position + 1
        for a in range(max(chunk.start, have - 1), end, 256):  # bounded logits memory
            b = min(a + 256, end)
            x = self.runner.logits(hidden[a - chunk.start: b - chunk.start])
            req.prompt_logprobs += token_logprobs(x, seq.token_ids[a + 1: b + 1], [k] * (b - a))

    def _processed_draft(self, req: RequestState, logits: torch.Tensor, draft: Draft) -> tuple[torch.Tensor, Draft]:
        """A chain's verification logits [L + 1, V] processed position by position, as plain
        decoding would process them had the draft tokens before each been committed (penalties,
        min_tokens, bad words, the grammar advanced over them and rolled back after). The draft
        ends before a token its position's processing forbids or one that completes the grammar
        (the commit path stops the request there)."""
        p, seq = req.seq.params, req.seq
        stop = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
        prompt, output = seq.token_ids[: seq.num_prompt_tokens], seq.output_token_ids
        rows, advanced, n = [], 0, len(draft.tokens)
        try:
            for j in range(len(draft.tokens) + 1):
                rows.append(process_logits(logits[j], p, prompt, output + draft.tokens[:j], stop))
                if j == len(draft.tokens):
                    break
                d = draft.tokens[j]
                if rows[-1][d] == float("-inf"):
                    n = j
                    break
                if p.constraint is not None:
                    p.constraint.accept(d)
                    advanced += 1
                    if p.constraint.finished():
                        n = j
                        break
        finally:
            if advanced:
                p.constraint.rollback(advanced)
        return torch.stack(rows[: n + 1]), draft.truncate(n)

    def _drafts(self, chunks: list[ScheduledChunk]) -> dict[str, Draft]:
        """Drafts for the decodes the scheduler left room for (empty drafts dropped)."""
        t0 = time.perf_counter()
        if self.speculative is None or not any(c.lookahead for c in chunks):
            return {}
        if self.depths is not None:
            cost, overhead = self.depths.cost_per_token(len(chunks)), self.depths.overhead_per_verify(len(chunks))
        else:
            cost, overhead = self.speculative.draft_token_cost, self.speculative.draft_overhead
        asks = [DraftRequest(c.request_id, r.seq.token_ids, c.lookahead, r.seq.params, r.generator,
                             r.seq.num_prompt_tokens, cost, overhead)
                for c in chunks if c.lookahead > 0
                for r in [self._requests[c.request_id]] if self._can_speculate(r.seq.params)]
        if not asks:
            return {}
        drafts = {}
        self.spec_stats["draft_calls"] += 1
        for ask, d in zip(asks, self.drafter.propose(asks)):
            if d.tokens:
                drafts[ask.seq_id] = d.truncate(ask.max_tokens)
        self.spec_stats["draft_seconds"] += time.perf_counter() - t0
        return drafts

    def _verify(self, chunk: ScheduledChunk, req: RequestState, logits: torch.Tensor, draft: Draft,
                hidden: torch.Tensor) -> list[int] | Exception:
        """Accept a prefix of the draft (lossless rule); roll the cache back over the rest. `hidden`:
        the row's drafter features (final states, or EAGLE-3's aux states), observed where kept."""
        try:
            keyed = req.seq.params.seed is not None and not req.seq.params.greedy
            position = req.seq.num_tokens  # of the first token this verification chooses
            if req.seq.params.processes_logits:
                logits, draft = self._processed_draft(req, logits, draft)
            if draft.parents is None:
                tokens = (accept_keyed(logits, draft, req.seq.params, position) if keyed else
                          accept(logits, draft, req.seq.params, req.generator, self.generator))
                path = list(range(len(tokens) - 1))
            else:
                tokens, path = (accept_tree_keyed(logits, draft, req.seq.params, position) if keyed else
                                accept_tree(logits, draft, req.seq.params, req.generator, self.generator))
                self.runner.move_kv(req.seq.request_id, [chunk.start + 1 + i for i in path],
                                    [chunk.start + 1 + j for j in range(len(path))])
        except Exception as exc:  # noqa: BLE001 - this request alone fails
            return exc
        kept = len(tokens)  # the pending token and len(tokens) - 1 accepted draft tokens are cached
        req.seq.num_computed = chunk.start + kept
        hidden = hidden[[0] + [1 + i for i in path]]
        self.spec_stats["verifies"] += 1
        self.spec_stats["drafted"] += len(draft.tokens)
        self.spec_stats["accepted"] += kept - 1
        if self.depths is not None:  # a chain's length, or a tree's depth, against what it kept
            self.depths.update(req.seq.request_id, max(draft.depths(), default=0), kept - 1)
        if self.drafter is not None:
            self.drafter.observe(req.seq.request_id, chunk.start, req.seq.token_ids[chunk.start:] + tokens[:-1],
                                 hidden)
        return tokens

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits from final hidden states [..., H], as the model's lm_head computes them."""
        return self.runner.logits(hidden)

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

    def set_speculative(self, config: SpeculativeConfig | None) -> None:
        """Change the speculative config between steps (None: plain decoding). The drafter stays
        the one the engine was built with; an EAGLE drafter takes the new depth and tree shape.
        An adaptive rollout picks the config per step this way."""
        with self._step_lock:
            if config is not None and self.drafter is None:
                self.drafter = make_drafter(config, self.model)
            if config is not None and hasattr(self.drafter, "topk"):
                self.drafter.topk, self.drafter.depth = config.eagle_topk, config.num_speculative_tokens
                self.drafter.total = config.lookahead
            if config is not None and hasattr(self.drafter, "mode"):
                self.drafter.mode = config.method if config.method in HYBRID_MODES else "hybrid"
            self.speculative = config
            self.depths = self._depth_controller(config, self.step_costs)  # measured costs stay
            self.spec_gate = self._gate(config)

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> int:
        """Copy new weights in between steps (the names of model.state_dict()); returns the new version.

        Running requests go on with the new weights; with kv_on_weight_update="recompute" (the
        default) their cached K/V is recomputed first, so no new token attends to K/V made by
        the old weights. Each output reports the version of its tokens.
        """
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
            return self.weights_changed()

    def weights_changed(self) -> int:
        """The model's weights changed in place (update_weights, or a training step on the very
        module the engine serves, as online learning does between steps): bump the version and
        treat cached K/V per `kv_on_weight_update`. Returns the new version."""
        with self._step_lock:
            if self.kv_on_weight_update == "recompute":
                self.scheduler.recompute_all()
            else:
                self.scheduler.forget_prefixes()
            self.weights_version += 1
            return self.weights_version
