"""Continuous batching: decide, each step, which tokens of which sequences the model runs.

As in vLLM v1, a sequence is its token list and how many of those tokens are in the cache;
prefill, chunked prefill, decode and recompute after preemption are all "run the uncomputed
tokens". `schedule()` returns a plain `SchedulerOutput`; the engine runs it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from reclaim.engine.kv_cache import BlockManager
from reclaim.engine.request import SamplingParams


@dataclass
class Sequence:
    """One request as the scheduler sees it: tokens so far and how many are cached."""

    request_id: str
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_preemptions: int = 0
    prompt_hashes: list[int] | None = None  # of its full prompt blocks (prefix sharing), made once
    record: bool = False  # its prefill is recorded for training (the whole prompt, never shared)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass
class ScheduledChunk:
    """Run tokens token_ids[start : start + num_tokens] of one sequence."""

    request_id: str
    start: int
    num_tokens: int
    sample: bool  # the chunk reaches the sequence's last token: sample the next one
    is_prefill: bool = False  # the chunk starts inside the prompt
    lookahead: int = 0  # draft tokens a decode may verify after its token (blocks and budget held)


@dataclass
class SchedulerOutput:
    """What to run this step, and which sequences lost their cache to make room."""

    chunks: list[ScheduledChunk]
    preempted: list[str]
    # Sequences admitted with another's prompt blocks: (sequence, the one it shares with, tokens).
    shared: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """First come, first served with a token budget per step; preempts the newest under pressure."""

    def __init__(
        self,
        blocks: BlockManager,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 2048,
    ) -> None:
        capacity = blocks.num_blocks * blocks.block_size
        if max_model_len > capacity:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the cache's {capacity} tokens "
                f"({blocks.num_blocks} blocks x {blocks.block_size}); lower it or add blocks"
            )
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_seqs={max_num_seqs}, max_num_batched_tokens={max_num_batched_tokens}; "
                "both must be >= 1"
            )
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self.num_shared_tokens = 0  # prompt tokens not computed thanks to prefix sharing
        self._computing: list[tuple[Sequence, int]] = []  # prompt blocks full after this step's chunks

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; its prompt must leave room for one generated token."""
        if not 1 <= seq.num_tokens < self.max_model_len:
            raise ValueError(
                f"request {seq.request_id!r} has {seq.num_tokens} prompt tokens; allowed: 1 to "
                f"{self.max_model_len - 1} (max_model_len={self.max_model_len})"
            )
        self.waiting.append(seq)

    def remove(self, request_id: str) -> Sequence | None:
        """Drop a sequence (finished or aborted) wherever it is and free its blocks."""
        self.blocks.free(request_id)
        for i, seq in enumerate(self.running):
            if seq.request_id == request_id:
                return self.running.pop(i)
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq.request_id)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self, lookahead: int | Callable[[Sequence], int] = 0) -> SchedulerOutput:
        """Pick this step's chunks, decode first: every running sequence that needs one token gets
        it (preempting the newest under block pressure), then running prefills (chunked) and
        waiting sequences share what is left of the token budget, oldest first. A long prompt
        therefore never delays the streams already decoding by more than one budget's forward.

        lookahead: room for up to that many speculative tokens after each decode (capped by the
        context and the request's max_tokens), or a function of the sequence giving its own; a
        decode whose extra blocks are not free gets none.
        Advances each scheduled sequence's `num_computed`, as the engine will run the chunk (the
        engine moves it back over draft tokens it rejects).
        """
        self._index_computed()
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        shared: list[tuple[str, str, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:  # decodes
            seq = self.running[i]
            if seq.num_tokens - seq.num_computed != 1:
                i += 1
                continue
            while not self.blocks.allocate(seq.request_id, seq.num_computed + 1):
                victim = self.running.pop()  # the newest; sequences before i keep their chunks
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    break
            else:
                chunk = self._chunk(seq, 1)
                want = lookahead(seq) if callable(lookahead) else lookahead
                chunk.lookahead = self._lookahead(seq, min(want, budget - 1)) if want else 0
                chunks.append(chunk)
                budget -= 1 + chunk.lookahead
                i += 1
        for seq in self.running:  # prefills under way (chunked) and recomputes; decodes are done
            left = seq.num_tokens - seq.num_computed
            if left < 2 or budget == 0:
                continue
            n = min(left, budget)
            if self.blocks.allocate(seq.request_id, seq.num_computed + n):  # else: wait for blocks
                chunks.append(self._chunk(seq, n))
                budget -= n
        # Admitting new work right after preempting would only thrash the cache.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            share = self._shareable(seq, chunks)
            if share is None:
                break  # its prefix is being computed by this very step: share it from the next one
            if share:
                self.blocks.share(seq.request_id, share)
                seq.num_computed = len(share) * self.blocks.block_size
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self.blocks.allocate(seq.request_id, seq.num_computed + n):
                if share:  # undo: it waits whole
                    self.blocks.free(seq.request_id)
                    seq.num_computed = 0
                break  # wait for blocks; the running sequences will free them
            if share:
                self.num_shared_tokens += seq.num_computed
                shared.append((seq.request_id, self.blocks.owner[share[-1]], seq.num_computed))
            self.waiting.popleft()
            self.running.append(seq)
            chunks.append(self._chunk(seq, n))
            budget -= n
        return SchedulerOutput(chunks, preempted, shared)

    def _hashes(self, seq: Sequence) -> list[int]:
        if seq.prompt_hashes is None:
            seq.prompt_hashes = self.blocks.prefix_hashes(
                seq.token_ids, seq.num_prompt_tokens // self.blocks.block_size)
        return seq.prompt_hashes

    def _shareable(self, seq: Sequence, chunks: list[ScheduledChunk]) -> list[int] | None:
        """Computed prompt blocks a new sequence can take from others ([] for none), or None when
        the next block it needs is being computed in this step (it waits a step and shares it).
        The last prompt token is always left to compute: its logits give the first token."""
        if seq.num_computed or self.blocks.tables.get(seq.request_id) or seq.params.prompt_logprobs is not None \
                or seq.record:
            return []  # (prompt logprobs and records need every prompt position computed)
        hashes = self._hashes(seq)[: (seq.num_prompt_tokens - 1) // self.blocks.block_size]
        found = self.blocks.cached_prefix(hashes)
        if len(found) < len(hashes):
            bs = self.blocks.block_size
            wanted = hashes[len(found)]
            for c in chunks:
                other = self._find(c.request_id)
                if other is not None and c.is_prefill and other.prompt_hashes and wanted in \
                        other.prompt_hashes[c.start // bs:(c.start + c.num_tokens) // bs]:
                    return None
        return found

    def _find(self, request_id: str) -> Sequence | None:
        return next((s for s in self.running if s.request_id == request_id), None)

    def _index_computed(self) -> None:
        """Index the full prompt blocks that the last step's chunks computed (they can be shared)."""
        for seq, n in self._computing:
            if any(r is seq for r in self.running) and self.blocks.tables.get(seq.request_id):
                self.blocks.index(seq.request_id, self._hashes(seq)[:n])
        self._computing = []

    def _lookahead(self, seq: Sequence, want: int) -> int:
        """Draft tokens worth verifying after `seq`'s decode, with their blocks allocated."""
        left = seq.params.max_tokens - (seq.num_tokens - seq.num_prompt_tokens)  # incl. this step's
        n = max(0, min(want, left - 1, self.max_model_len - seq.num_tokens - 1))
        while n > 0 and not self.blocks.allocate(seq.request_id, seq.num_computed + n):
            n //= 2
        return n

    def recompute_all(self) -> None:
        """Forget every running sequence's cached K/V (keeping its blocks): the next steps run
        its tokens again, e.g. with new weights."""
        for seq in self.running:
            seq.num_computed = 0
        self.forget_prefixes()

    def forget_prefixes(self) -> None:
        """No new sequence may share K/V computed so far (the weights changed)."""
        self.blocks.forget_prefixes()
        self._computing = []

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        chunk = ScheduledChunk(seq.request_id, seq.num_computed, n, seq.num_computed + n == seq.num_tokens,
                               seq.num_computed < seq.num_prompt_tokens)
        seq.num_computed += n
        if chunk.is_prefill:
            full = min(seq.num_computed, seq.num_prompt_tokens) // self.blocks.block_size
            if full > chunk.start // self.blocks.block_size:
                self._hashes(seq)
                self._computing.append((seq, full))
        return chunk
