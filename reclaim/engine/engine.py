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
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from reclaim.devices import prepare, resolve_device
from reclaim.engine.config import EngineConfig
from reclaim.engine.detokenize import IncrementalDetokenizer
from reclaim.engine.kv_cache import BlockManager, free_storage, plan_kv_blocks, restore_storage
from reclaim.engine.output import RequestState, commit, output
from reclaim.engine.request import RequestOutput, SamplingParams
from reclaim.engine.runner import ModelRunner, RunnerOutput
from reclaim.engine.sampling import make_generator
from reclaim.engine.proposers import HYBRID_MODES, make_proposer
from reclaim.engine.speculative import MODEL_METHODS, Draft, Proposer, DraftRequest, SpeculativeConfig
from reclaim.engine.spec_policy import SpecPolicy
from reclaim.engine.tensor_parallel import LeaderTarget, draft_target, refuse_on_tensor_parallel, tensor_parallel
from reclaim.models.kernels.linear import forget_packed
from reclaim.models.tensor_parallel import copy_full
from reclaim.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput, Sequence

log = logging.getLogger("reclaim.engine")

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
        config: EngineConfig | None = None,
        *,
        eos_token_ids: list[int] | None = None,
        on_forward: Callable[[list[ForwardRecord]], None] | None = None,
        proposer: Proposer | None = None,
        recorder: Recorder | None = None,
        tp_group: Any = None,
        tp_control: Any = None,
        **fields: Any,
    ) -> None:
        """`config` (an EngineConfig; keyword `fields` of it override it) sizes the engine;
        eos_token_ids (default: the model's and the tokenizer's), the hooks below and a ready
        `proposer` (default: the one `config.speculative` names) come besides. `drafter=` is the
        proposer's old name, kept for one release with a DeprecationWarning.

        Tensor parallel (tensor_parallel.py): every rank of `tp_group` (default with
        tensor_parallel_size > 1: the whole world) builds the engine over the same weights, which
        are sharded here unless they are already; rank 0 of the group runs it (`is_leader`), the
        others `follow()`. `tp_control`: a gloo group over the same ranks for the step messages
        (default: tp_group)."""
        if "drafter" in fields:
            warnings.warn("Engine(drafter=...) is deprecated; pass proposer=...", DeprecationWarning, stacklevel=2)
            proposer = fields.pop("drafter") if proposer is None else proposer
        self.config = cfg = (config or EngineConfig()).replace(**fields)
        param = next(model.parameters())
        device = resolve_device(cfg.device) if cfg.device is not None else param.device
        prepare(device)
        max_model_len = cfg.max_model_len or model.config.max_position_embeddings
        channel = tensor_parallel(model, cfg.tensor_parallel_size, device, tp_group, tp_control)
        # What an EAGLE drafter takes from the target: on a TP engine the leader's whole copies of
        # the embedding and head (gathered by every rank now), else the model itself.
        self.draft_target, self._model_drafts = draft_target(model, channel, cfg.speculative, proposer)
        if channel is not None:
            refuse_on_tensor_parallel(recorder)
        kv_heads = model.config.num_key_value_heads if channel is None else channel.tp.num_kv_heads
        num_blocks = cfg.num_blocks or plan_kv_blocks(
            model.config, kv_cache_bytes=cfg.kv_cache_bytes, block_size=cfg.block_size,
            max_model_len=max_model_len, max_num_seqs=cfg.max_num_seqs, dtype=param.dtype, num_kv_heads=kv_heads)
        if channel is not None:  # block ids are the leader's: every rank's pool must hold them
            num_blocks = channel.agree_min(num_blocks)
        self.blocks = BlockManager(num_blocks, cfg.block_size)
        self.runner = ModelRunner(model, self.blocks, device, head=cfg.head, compile=cfg.compile,
                                  max_model_len=max_model_len, channel=channel)
        self.model, self.device = self.runner.model, device
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(
            self.blocks, max_num_seqs=cfg.max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
        )
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids if eos_token_ids is not None else self._default_eos())
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
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
        self.kv_on_weight_update = cfg.kv_on_weight_update
        self.speculative = speculative = cfg.speculative
        self.proposer = proposer
        if proposer is None and speculative is not None:
            self.proposer = make_proposer(speculative, self.draft_target, self._encode_text)
        self.spec_stats = {"verifies": 0, "drafted": 0, "accepted": 0, "draft_seconds": 0.0, "draft_calls": 0,
                           "plain_decodes": 0}
        self.policy = SpecPolicy(self.spec_stats)  # whether, with what and how deep to draft
        self.policy.configure(speculative, self._arms(speculative))
        self.runner.aux_layers = getattr(self.proposer, "aux_layers", None)  # EAGLE-3 drafts from these layers' states
        self.weights_version = 0
        self.sleeping = 0  # the level of sleep(), 0 awake
        self.weights_missing = False  # woken from sleep(level=2), not yet given weights
        self.last_schedule: SchedulerOutput | None = None
        self.num_preemptions = 0
        self.num_request_errors = 0
        self._requests: dict[str, RequestState] = {}
        # what the runner reads to choose tokens: the requests, stop tokens and fallback generator
        self.runner.requests, self.runner.eos_token_ids, self.runner.generator = \
            self._requests, self.eos_token_ids, self.generator
        self._inbox: list[tuple[str, Any]] = []  # ("add", RequestState) | ("abort", request_id)
        self._inbox_lock = threading.Lock()  # add/abort may come from another thread
        self._step_lock = threading.RLock()  # one step or weight swap at a time
        self._ids = itertools.count()

    @property
    def is_leader(self) -> bool:
        """Whether this process runs the engine: always, but on a TP follower rank."""
        return self.runner.channel is None or self.runner.channel.is_leader

    def follow(self) -> Any:
        """A TP follower rank: run the leader's forwards until it calls `release`; returns what
        the leader handed over."""
        if self.is_leader:
            raise ValueError("follow() is for the follower ranks of a tensor-parallel engine; this is the leader")
        return self.runner.follow()

    def release(self, result: Any = None) -> None:
        """The TP leader: let the followers out of `follow()`, handing them `result` (no-op without TP)."""
        with self._step_lock:
            self.runner.release(result)

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
        """One step, as vLLM v1's: schedule -> propose -> execute -> commit. Returns an output for
        every request that changed."""
        with self._step_lock:
            if self.sleeping or self.weights_missing:
                raise RuntimeError("the engine sleeps; call wake_up() before step()" if self.sleeping else
                                   "the weights were freed by sleep(level=2); call update_weights() before step()")
            outputs = self._drain_inbox()
            arm = self.policy.arm(len(self.scheduler.running))  # 'plain' or what drafts this step
            sched = self._schedule(arm)
            if not sched.chunks:
                return outputs
            t0 = time.perf_counter()
            drafts = self._propose(sched.chunks, arm)
            result = self.runner.execute(sched.chunks, drafts, self._record(sched.chunks))
            committed = self._commit(sched.chunks, result)
            if not any(c.is_prefill for c in sched.chunks):  # what decode steps cost and yield
                done = sum(len(t) for t in result.tokens.values() if not isinstance(t, Exception))
                self.policy.observe_step(len(sched.chunks), arm, sum(v.drafted for v in result.accepted.values()),
                                         len(result.accepted), done, time.perf_counter() - t0)
            return outputs + committed

    def _schedule(self, arm: str) -> SchedulerOutput:
        """The scheduler's plan for this step (room left for drafts unless it decodes plainly);
        its preemptions counted, prefixes it shared handed to the proposer's history."""
        batch = len(self.scheduler.running)
        lookahead = (lambda seq: self.policy.lookahead(seq.request_id, seq.params, batch)) if arm != "plain" else 0
        sched = self.last_schedule = self.scheduler.schedule(lookahead)
        self.num_preemptions += len(sched.preempted)
        share = getattr(self.proposer, "share", None)
        for dst, src, n in sched.shared if share is not None else []:
            share(src, dst, n)
        return sched

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

    def _arms(self, spec: SpeculativeConfig | None) -> tuple[str, ...]:
        """The gate's arms: plain and the method, or for a hybrid proposer each of its modes."""
        if spec is not None and spec.method == "hybrid" and hasattr(self.proposer, "mode"):
            return ("plain", *HYBRID_MODES)
        return ("plain", spec.method if spec is not None else "spec")

    def _release(self, req: RequestState) -> None:
        """Forget a finished request and free its blocks."""
        self.scheduler.remove(req.seq.request_id)
        del self._requests[req.seq.request_id]
        self._partial.discard(req.seq.request_id)
        self.policy.release(req.seq.request_id)
        if self.proposer is not None:
            self.proposer.finish(req.seq.request_id, req.seq.token_ids, req.seq.num_prompt_tokens)
            self.proposer.release(req.seq.request_id)

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

    def _commit(self, chunks: list[ScheduledChunk], result: RunnerOutput) -> list[RequestOutput]:
        """Hand the step's forward to the hooks and the proposer, keep the verified drafts' cache,
        and commit each request's tokens (one whose tokens failed, or whose commit fails, fails
        alone)."""
        if self.on_forward is not None:
            self.on_forward([
                ForwardRecord(c.request_id, c.start, self._requests[c.request_id].seq.token_ids[c.start:c.start + c.num_tokens],
                              result.hidden[c.request_id], list(self.blocks.tables[c.request_id]), c.is_prefill,
                              self.weights_version)
                for c in chunks
            ])
        for rid, got in result.prompt_logprobs.items():
            self._requests[rid].prompt_logprobs += got
        for rid, start, token_ids, feats in result.observed:
            if self.proposer is not None and rid not in self._partial:
                self.proposer.observe(rid, start, token_ids, feats)
        starts = {c.request_id: c.start for c in chunks}
        for rid, v in result.accepted.items():  # the pending token and the accepted draft tokens are cached
            self._requests[rid].seq.num_computed = starts[rid] + v.accepted + 1
            for k, n in (("verifies", 1), ("drafted", v.drafted), ("accepted", v.accepted)):
                self.spec_stats[k] += n
            self.policy.verified(rid, v.depth, v.accepted)  # a chain's length, or a tree's depth
        outputs = []
        for rid, tokens in result.tokens.items():
            req = self._requests[rid]
            try:
                if isinstance(tokens, Exception):
                    raise tokens
                out = commit(req, tokens, result.logprobs[rid], self.weights_version, self.eos_token_ids,
                             self.max_model_len)
            except Exception as exc:  # noqa: BLE001 - its sampling, detokenizer or stop strings: it alone fails
                outputs.append(self._fail(req, exc))
                continue
            if out.finished:
                self._release(req)
            outputs.append(out)
        return outputs

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

    def _propose(self, chunks: list[ScheduledChunk], arm: str) -> dict[str, Draft]:
        """Drafts for the decodes the scheduler left room for (empty drafts dropped); a hybrid
        proposer drafts in the mode the gate chose."""
        t0 = time.perf_counter()
        if self.speculative is None or not any(c.lookahead for c in chunks):
            return {}
        if arm in HYBRID_MODES and hasattr(self.proposer, "mode") and self.policy.depths is not None:
            self.proposer.mode = arm
        cost, overhead = self.policy.draft_costs(len(chunks))
        asks = [DraftRequest(c.request_id, r.seq.token_ids, c.lookahead, r.seq.params, r.generator,
                             r.seq.num_prompt_tokens, cost, overhead)
                for c in chunks if c.lookahead > 0
                for r in [self._requests[c.request_id]] if self.policy.can_speculate(r.seq.params)]
        if not asks:
            return {}
        drafts = {}
        self.spec_stats["draft_calls"] += 1
        for ask, d in zip(asks, self.proposer.propose(asks)):
            if d.tokens:
                drafts[ask.seq_id] = d.truncate(ask.max_tokens)
        self.spec_stats["draft_seconds"] += time.perf_counter() - t0
        return drafts

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits from final hidden states [..., H], as the model's lm_head computes them."""
        return self.runner.logits(hidden)

    # ---- convenience and hooks ----

    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run prompts to completion; returns each prompt's final output, in order. On a TP engine
        every rank of the group calls it: the leader's prompts run, and every rank gets the outputs."""
        if not self.is_leader:  # a TP follower: the leader's outputs, once its run is done
            result = self.follow()
            if result is None:
                raise RuntimeError("the tensor-parallel leader's generate failed (its rank has the error)")
            return result
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts; need one or equal")
        ids: list[str] = []
        try:
            ids = [self.add_request(None, p, sp) for p, sp in zip(prompts, plist)]
            final: dict[str, RequestOutput] = {}
            mine = set(ids)
            while len(final) < len(ids):
                for out in self.step():
                    if out.finished and out.request_id in mine:
                        final[out.request_id] = out
            result = [final[i] for i in ids]
        except BaseException:
            for i in ids:  # none of this call's requests is left to run in a later one
                self.abort_request(i)
            self.release(None)
            raise
        self.release(result)
        return result

    @property
    def drafter(self) -> Proposer | None:
        """The proposer's old name, kept for one release (DeprecationWarning): use `proposer`."""
        warnings.warn("Engine.drafter is deprecated; use Engine.proposer", DeprecationWarning, stacklevel=2)
        return self.proposer

    def _encode_text(self, text: str) -> list[int]:
        """A history file's text as this engine's tokens (no special tokens added)."""
        if self.tokenizer is None:
            raise ValueError("a suffix history with text lines needs the engine's tokenizer; none was given")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def set_speculative(self, config: SpeculativeConfig | None) -> None:
        """Change the speculative config between steps (None: plain decoding). The proposer stays
        the one the engine was built with; an EAGLE proposer takes the new depth and tree shape.
        An adaptive rollout picks the config per step this way."""
        with self._step_lock:
            if config is not None and self.proposer is None:
                if config.method in MODEL_METHODS and not self._model_drafts:
                    raise ValueError(f"speculative method {config.method!r} on a tensor-parallel engine built "
                                     "without one: build it with that speculative config or proposer")
                self.proposer = make_proposer(config, self.draft_target, self._encode_text)
            if config is not None and hasattr(self.proposer, "topk"):
                self.proposer.topk, self.proposer.depth = config.eagle_topk, config.num_speculative_tokens
                self.proposer.total = config.lookahead
            if config is not None and hasattr(self.proposer, "mode"):
                self.proposer.mode = config.method if config.method in HYBRID_MODES else "hybrid"
            self.speculative = config
            self.policy.configure(config, self._arms(config))  # measured costs stay
            self.runner.aux_layers = getattr(self.proposer, "aux_layers", None)

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> int:
        """Copy new weights in between steps (the names of model.state_dict()); returns the new version.

        Running requests go on with the new weights; with kv_on_weight_update="recompute" (the
        default) their cached K/V is recomputed first, so no new token attends to K/V made by
        the old weights. Each output reports the version of its tokens. On a TP engine every rank
        calls it (between generate calls) with the unsharded model's tensors and keeps its shard.
        """
        with self._step_lock:
            if self.sleeping:
                raise RuntimeError(f"update_weights() while the engine sleeps (level {self.sleeping}); call wake_up() first")
            if self.weights_missing:  # names only: a lazy mapping (FullWeights) gathers on lookup
                given = set(state_dict.keys())
                missing = sorted(n for n, _ in self.model.named_parameters() if n not in given)
                if missing:
                    raise ValueError(f"the weights were freed by sleep(level=2) and {missing[:5]} were not given; "
                                     "pass every parameter of model.state_dict()")
            # the TP leader's whole embedding and head (an EAGLE drafter's) take the whole tensors too
            leader = self.draft_target.update if isinstance(self.draft_target, LeaderTarget) else None
            copy_full(self.model, state_dict, also=leader)
            self.weights_missing = False
            return self.weights_changed()

    def sleep(self, level: int = 1) -> int:
        """Give the engine's memory back while it is not used (vLLM's `LLM.sleep`; GRPO sleeps it
        through training): level 1 frees the K/V pool (cached prefixes are forgotten), level 2
        the model's weights too, which `update_weights` must refill after `wake_up` (GRPO refills
        them from the trainer after each step anyway). Tensors keep their shapes and identities;
        only their storage goes. No request may be in flight. Returns the bytes freed. On a TP
        engine every rank sleeps and wakes its own shard."""
        if level not in (1, 2):
            raise ValueError(f"sleep level={level!r}; allowed: 1 (the K/V pool), 2 (the K/V pool and the weights)")
        with self._step_lock:
            busy = len(self.scheduler.running) + len(self.scheduler.waiting) + len(self._inbox)
            if busy:
                raise RuntimeError(f"sleep() with {busy} request(s) in flight; finish or abort them first")
            if self.sleeping:
                raise RuntimeError(f"the engine sleeps already (level {self.sleeping}); call wake_up() first")
            self.scheduler.forget_prefixes()  # their K/V is about to go
            weights = self._weights() if level == 2 else []  # and the kernel's packed copies of them
            freed = self.runner.pool.free() + forget_packed(weights) + free_storage(weights)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.sleeping = level
            return freed

    def _weights(self) -> list[torch.Tensor]:
        """What sleep(level=2) frees: the model's parameters and a TP leader's whole embedding
        and head (update_weights refills both)."""
        extra = list(self.draft_target.parameters()) if isinstance(self.draft_target, LeaderTarget) else []
        return [*self.model.parameters(), *extra]

    def wake_up(self) -> None:
        """Take the memory `sleep` gave back: the K/V pool zeroed and, after level 2, the weights'
        storage, whose values are undefined until `update_weights` fills them (steps are refused
        until then)."""
        with self._step_lock:
            if not self.sleeping:
                return
            self.runner.pool.restore()
            if self.sleeping == 2:
                restore_storage(self._weights())
                self.weights_missing = True
            self.runner.woke()
            self.sleeping = 0

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
