"""The model runner: how one engine step runs on the model (vLLM v1's split).

It owns the K/V pool and the LM head kernel. Given rows of new tokens placed after each
sequence's cached prefix (prefill chunks, decode rows, speculative verify rows), it runs the
decoder over them in one forward, packed one after another (no padding), and returns their
final hidden states; `logits` applies the head only where the caller needs it. A drafter that declares
`aux_layers` (EAGLE-3) gets the states entering those layers from the same forward
(`run_features`).

`execute` is one engine step's forward: the scheduled chunks and their drafts in, a
`RunnerOutput` out (each request's tokens to commit, their logprobs, its hidden states and what
the proposer observes). Plain rows are sampled together, drafted rows verified by the lossless
rule (rejection.py); the engine commits what comes back.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from reclaim.engine.config import HEAD_KERNELS
from reclaim.engine.kv_cache import BlockManager, KVPool
from reclaim.engine.output import RequestState
from reclaim.engine.rejection import processed_chain, verify_batch
from reclaim.engine.request import SamplingParams
from reclaim.engine.sampling import Keyed, mask_logits, penalize, read, sample_deferred, token_logprobs
from reclaim.engine.scheduler import ScheduledChunk
from reclaim.engine.speculative import Draft
from reclaim.engine.tensor_parallel import TPChannel
from reclaim.models.kernels.linear import linear, torch_kernels



def head_kernel(kind: str = "auto") -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The matmul the engine uses for logits: 'auto' is the layers' own (reclaim's kernel for a
    few rows of float32 on a CPU, oneDNN for more), 'linear' plain `F.linear` (what transformers
    uses; benchmarks compare both)."""
    if kind not in HEAD_KERNELS:
        raise ValueError(f"head kernel {kind!r} is unknown; allowed: {list(HEAD_KERNELS)}")
    return linear if kind == "auto" else torch.nn.functional.linear


@dataclass
class Row:
    """New tokens of one sequence: token_ids placed at positions start, start + 1, ...

    parents: a tree of new tokens instead (a draft to verify): token i's parent among them (-1:
    none, it follows the cached prefix). Token i is stored in slot start + i but sits at position
    start + depth(i) and sees the prefix and its own ancestors only.
    """

    seq_id: str
    start: int
    token_ids: list[int]
    parents: list[int] | None = None


class ModelRunner:
    """Runs rows of new tokens through a reclaim causal LM against the paged K/V cache."""

    def __init__(self, model: torch.nn.Module, blocks: BlockManager, device: torch.device,
                 *, head: str = "auto", compile: bool = False, max_model_len: int | None = None,
                 channel: TPChannel | None = None) -> None:
        cfg = model.config
        dtype = next(model.parameters()).dtype
        self.device = device
        self.model = model.to(device).eval()
        self.blocks = blocks
        # Tensor parallel (tensor_parallel.py): this rank's K/V heads only; the leader announces
        # each model operation on `channel` before running it, the followers run it in `follow`.
        self.tp = getattr(model, "tensor_parallel", None)
        self.channel = channel
        self.pool = KVPool(cfg.num_hidden_layers, blocks.num_blocks, blocks.block_size,
                           cfg.num_key_value_heads if self.tp is None else self.tp.num_kv_heads, cfg.head_dim,
                           dtype=dtype, device=device)
        self._head = head_kernel(head)
        # head='linear' also keeps the layers on F.linear: transformers' kernels throughout.
        self._kernels = torch_kernels if head == "linear" else nullcontext
        self.sliding_window = getattr(cfg, "sliding_window", None)
        # The decode forward compiled (compile=True; None: eager). On CUDA it replays CUDA graphs,
        # which want static shapes: decode batches padded to a bucket, block tables to one width.
        self._decode = CompiledDecode(self.model, device) if compile else None
        self._table_width = -(-(max_model_len or cfg.max_position_embeddings) // blocks.block_size)
        # What `execute` reads, set by the engine: the requests by id, the stop tokens, the
        # generator of requests without their own, and the layers a proposer drafts from
        # (EAGLE-3; None: the final states).
        self.requests: dict[str, RequestState] = {}
        self.eos_token_ids: set[int] = set()
        self.generator: torch.Generator | None = None
        self.aux_layers: tuple[int, ...] | None = None

    def woke(self) -> None:
        """The pool (and perhaps the weights) have new storage after the engine's sleep: CUDA
        graphs captured over the old addresses are dropped (recaptured on the next decode)."""
        if self._decode is not None and self.device.type == "cuda":
            self._decode = CompiledDecode(self.model, self.device)

    def move_kv(self, seq_id: str, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of positions `src` of a sequence to positions `dst` (every layer): an
        accepted tree path moves into place after the prefix."""
        pairs = [(s, d) for s, d in zip(src, dst) if s != d]
        if pairs:
            self._move(self.blocks.tables[seq_id], [s for s, _ in pairs], [d for _, d in pairs])

    def _move(self, table: list[int], src: list[int], dst: list[int]) -> None:
        if self.channel is not None and self.channel.is_leader:
            self.channel.send("move", table, src, dst)
        self.pool.move(self.pool.slots(table, src), self.pool.slots(table, dst))

    def write_kv(self, seq_id: str, start: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Store K/V computed elsewhere (a recorded prefill) for positions start.. of a sequence:
        per layer [1, Hkv, T, D] (any dtype and device; copied, never kept)."""
        if self.channel is not None:
            raise ValueError("recorded prefills (online learning) are not supported on a tensor-parallel engine")
        t = keys[0].shape[2]
        where = self.pool.slots(self.blocks.tables[seq_id], list(range(start, start + t)))
        dtype = self.pool.dtype
        with torch.no_grad():
            for layer, (k, v) in enumerate(zip(keys, values)):
                self.pool.write(layer, where, k[0].detach().transpose(0, 1).to(self.device, dtype),
                                v[0].detach().transpose(0, 1).to(self.device, dtype))

    def forward(self, rows: list[Row]) -> list[torch.Tensor]:
        """One model forward over `rows`, packed; each row's final hidden states [len(token_ids), H]."""
        return [h for h, _ in self.run_features(rows)]

    def run(self, rows: list[Row]) -> list[torch.Tensor]:
        """Final hidden states of every row's tokens ([len(token_ids), H] each), one forward."""
        return self.forward(rows)

    def run_features(self, rows: list[Row], aux_layers: tuple[int, ...] | None = None
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each row's final hidden states and its drafter features from one forward over all rows
        packed together: the states entering `aux_layers`, concatenated ([len(token_ids),
        len(aux_layers) * H]), or the final states again without aux_layers."""
        decode = (self._decode is not None and aux_layers is None
                  and all(len(r.token_ids) == 1 and r.parents is None for r in rows))
        # A compiled decode sees few shapes: batches padded to a bucket (2 at least: a dimension
        # of 1 would get a graph of its own), block tables of one width.
        batch = dict(tables=[self.blocks.tables[r.seq_id] for r in rows], past=[r.start for r in rows],
                     new=[len(r.token_ids) for r in rows], trees=[r.parents for r in rows],
                     token_ids=[r.token_ids for r in rows], pad_to=max(2, bucket(len(rows))) if decode else None,
                     table_width=max(2, self._table_width) if decode else None)
        return self._run_batch(batch, aux_layers, decode)

    def _run_batch(self, batch: dict[str, Any], aux_layers: tuple[int, ...] | None, decode: bool
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """run_features' forward over the view of `batch` (KVPool.view's arguments), announced to
        the TP group first."""
        view = self.pool.view(**batch, sliding_window=self.sliding_window)
        if self.channel is not None and self.channel.is_leader:
            self.channel.send("forward", batch, aux_layers, decode)
        graphs = decode and self.device.type == "cuda"
        if decode:
            out = self._decode(view.input_ids, view.positions, view)
            # a CUDA graph's output is overwritten by its next replay: callers may keep theirs
            hidden = view.split((out.clone() if graphs else out)[None])
            return list(zip(hidden, hidden))
        taps = {} if aux_layers is None else {"aux_layers": aux_layers}  # only asked of models that have them
        with self._kernels():
            got = self.model(view.input_ids, view.positions, view,
                             return_hidden=True, compute_logits=False, **taps)
        hidden = view.split(got.hidden)
        return list(zip(hidden, hidden if aux_layers is None else view.split(got.aux)))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits from final hidden states [..., H], as the model's lm_head computes them
        (on a TP engine every rank's vocabulary slice, gathered)."""
        if self.channel is not None:
            self.channel.send("logits", tuple(hidden.shape), hidden.dtype)
            hidden = self.channel.share(hidden)
        return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.lm_head
        out = self._head(hidden, head.weight)
        if head.bias is not None:
            out = out + head.bias
        if self.tp is not None and self.tp.size > 1:
            out = self.tp.gather_vocab(out)
        return out.float()

    def follow(self) -> Any:
        """A follower rank of a TP engine: run the leader's model operations as it announces them
        until it sends 'stop'; returns what the stop carried."""
        with torch.inference_mode():
            while True:
                op, args = self.channel.recv()
                if op == "forward":
                    self._run_batch(*args)
                elif op == "logits":
                    self._logits(self.channel.share(None, *args))
                elif op == "move":
                    self._move(*args)
                elif op == "stop":
                    return args[0]
                else:
                    raise ValueError(f"unknown TP operation {op!r} from the leader")

    def release(self, result: Any = None) -> None:
        """The leader: let the followers out of `follow`, handing them `result`."""
        if self.channel is not None:
            self.channel.send("stop", result)

    # ---- one engine step: forward, then the tokens each sampling chunk commits ----

    def execute(self, chunks: list[ScheduledChunk], drafts: dict[str, Draft],
                recorded: dict[str, torch.Tensor] | None = None) -> RunnerOutput:
        """Run the scheduled chunks' forwards (a decode with a draft verifies it in the same
        forward) and choose the tokens each chunk that ends its sequence commits: sampled, or a
        draft's accepted prefix and the token after it (lossless, rejection.py). `recorded`: final
        hidden states [P, H] of prefills the recorder already ran (their K/V is cached). Reads
        the requests in `self.requests`; changes nothing of theirs but a verified tree's K/V,
        moved into place (the engine commits the output)."""
        recorded = recorded or {}
        out = RunnerOutput()
        rows = []
        for c in chunks:
            seq = self.requests[c.request_id].seq
            draft = drafts.get(c.request_id, Draft())
            rows.append(Row(c.request_id, c.start, seq.token_ids[c.start:c.start + c.num_tokens] + draft.tokens,
                            None if draft.parents is None else [-1] + [p + 1 for p in draft.parents]))
        with torch.inference_mode():
            run = [i for i, c in enumerate(chunks) if c.request_id not in recorded]
            hidden: list[torch.Tensor] = [None] * len(chunks)
            feats: list[torch.Tensor | None] = [None] * len(chunks)  # what the proposer observes
            for i, (h, f) in zip(run, self.run_features([rows[i] for i in run], self.aux_layers) if run else []):
                hidden[i], feats[i] = h, f
            for i, c in enumerate(chunks):
                if c.request_id in recorded:  # a recorded prefill has no aux states: EAGLE-3 does not draft it
                    hidden[i] = recorded[c.request_id]
                    feats[i] = hidden[i] if self.aux_layers is None else None
            for c, r, h, f in zip(chunks, rows, hidden, feats):
                out.hidden[c.request_id] = h[: c.num_tokens]
                if not c.sample and f is not None:
                    out.observed.append((c.request_id, c.start, r.token_ids, f))
                if c.is_prefill and self.requests[c.request_id].seq.params.prompt_logprobs is not None:
                    out.prompt_logprobs[c.request_id] = self._prompt_logprobs(self.requests[c.request_id], c, h)
            sampling = [i for i, c in enumerate(chunks) if c.sample]
            if sampling:
                self._choose(out, [chunks[i] for i in sampling], [rows[i] for i in sampling],
                             [hidden[i] for i in sampling], [feats[i] for i in sampling], drafts)
        return out

    def _choose(self, out: RunnerOutput, chunks: list[ScheduledChunk], rows: list[Row],
                hidden: list[torch.Tensor], feats: list[torch.Tensor | None], drafts: dict[str, Draft]) -> None:
        """The tokens of each sampling chunk from the logits at its last token and every draft
        token after it: plain rows sampled together and drafted rows verified together (the
        plain rows' uniforms drawn first), every choice read on the host at once."""
        spans = [(c.num_tokens - 1, len(r.token_ids)) for c, r in zip(chunks, rows)]
        x = self.logits(torch.cat([h[a:b] for h, (a, b) in zip(hidden, spans)]))
        per_row = list(torch.split(x, [b - a for a, b in spans]))
        reqs = [self.requests[c.request_id] for c in chunks]
        chosen: dict[int, list[int] | Exception] = {}
        plain, plain_x, drafted, checked = [], [], [], {}
        pending = {j: k for k, j in enumerate(j for j, c in enumerate(chunks) if c.request_id not in drafts)}
        penalized = self._penalized(torch.stack([per_row[j][0] for j in pending]), [reqs[j] for j in pending]) \
            if pending else None
        for j, c in enumerate(chunks):
            try:  # its logits processors and constraint: a failure fails it alone
                if c.request_id in drafts:
                    checked[j] = self._processed_draft(reqs[j], per_row[j], drafts[c.request_id])
                    drafted.append(j)
                else:
                    x_j = penalized[pending[j]]
                    params = reqs[j].seq.params
                    plain_x.append(mask_logits(x_j.clone(), params, reqs[j].seq.output_token_ids)
                                   if params.masks else x_j)
                    plain.append(j)
            except Exception as exc:  # noqa: BLE001
                chosen[j] = exc
        parts = []
        if plain:
            parts.append(sample_deferred(torch.stack(plain_x), [reqs[j].seq.params for j in plain],
                                         [randomness(reqs[j]) for j in plain], self.generator))
        if drafted:
            parts.append(verify_batch([checked[j][0] for j in drafted], [checked[j][1] for j in drafted],
                                      [reqs[j].seq.params for j in drafted],
                                      [reqs[j].seq.num_tokens for j in drafted],
                                      [reqs[j].generator for j in drafted], self.generator))
        results = read(parts)
        if plain:
            for j, t in zip(plain, results.pop(0)):
                chosen[j] = t if isinstance(t, Exception) else [t]
                if not isinstance(t, Exception) and feats[j] is not None:
                    out.observed.append((chunks[j].request_id, chunks[j].start, rows[j].token_ids, feats[j]))
        at_rows: dict[int, list[int]] = {}  # a verified row's logits rows: the pending token's, then its path's
        if drafted:
            for j, got in zip(drafted, results.pop(0)):
                chosen[j] = got if isinstance(got, Exception) else \
                    self._verified(out, chunks[j], reqs[j], checked[j][1], got, feats[j])
                if not isinstance(got, Exception):
                    at_rows[j] = [0] + [1 + i for i in got[1]]
        want = [j for j, req in enumerate(reqs)
                if req.seq.params.logprobs is not None and not isinstance(chosen[j], Exception)]
        lps = {}
        if want:  # every row's logprobs read together
            flat = token_logprobs(torch.cat([per_row[j][at_rows[j]] if j in at_rows else per_row[j][: len(chosen[j])]
                                             for j in want]),
                                  [t for j in want for t in chosen[j]],
                                  [reqs[j].seq.params.logprobs for j in want for _ in chosen[j]])
            at = 0
            for j in want:
                lps[j], at = flat[at: at + len(chosen[j])], at + len(chosen[j])
        for j, req in enumerate(reqs):
            out.tokens[req.seq.request_id], out.logprobs[req.seq.request_id] = chosen[j], lps.get(j)

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        return set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)

    def _penalized(self, logits: torch.Tensor, reqs: list[RequestState]) -> torch.Tensor:
        """Rows' logits [B, V] after the logit_bias, penalties and min_tokens of those that ask,
        together (as is when none does)."""
        ask = [i for i, r in enumerate(reqs) if r.seq.params.penalizes]
        if not ask:
            return logits
        seqs = [reqs[i].seq for i in ask]
        x = logits.clone()
        x[ask] = penalize(logits[ask], [s.params for s in seqs], [s.token_ids[: s.num_prompt_tokens] for s in seqs],
                          [s.output_token_ids for s in seqs], [self._stop_ids(s.params) for s in seqs])
        return x

    def _processed_draft(self, req: RequestState, logits: torch.Tensor, draft: Draft) -> tuple[torch.Tensor, Draft]:
        """A drafted row's verify logits processed position by position, and its draft cut where
        processing forbids a token (as is when it has no processors)."""
        seq, params = req.seq, req.seq.params
        if not params.processes_logits:
            return logits, draft
        return processed_chain(logits, draft, params, seq.token_ids[: seq.num_prompt_tokens],
                               seq.output_token_ids, self._stop_ids(params))

    def _verified(self, out: RunnerOutput, chunk: ScheduledChunk, req: RequestState, draft: Draft,
                  got: tuple[list[int], list[int]], feats: torch.Tensor | None) -> list[int]:
        """A verified draft's tokens: a tree's accepted path moved into place in the cache; the
        counts kept; `feats`, the row's proposer features, observed where kept."""
        seq = req.seq
        tokens, path = got
        if draft.parents is not None:
            self.move_kv(seq.request_id, [chunk.start + 1 + i for i in path],
                         [chunk.start + 1 + j for j in range(len(path))])
        out.accepted[seq.request_id] = Verified(len(draft.tokens), max(draft.depths(), default=0), len(tokens) - 1)
        if feats is not None:
            out.observed.append((seq.request_id, chunk.start, seq.token_ids[chunk.start:] + tokens[:-1],
                                 feats[[0] + [1 + i for i in path]]))
        return tokens

    def _prompt_logprobs(self, req: RequestState, chunk: ScheduledChunk, hidden: torch.Tensor) -> list:
        """Logprobs of the prompt tokens this prefill chunk predicts (position j predicts j + 1)
        that the request has not got yet."""
        seq, k, got = req.seq, req.seq.params.prompt_logprobs, []
        have = 1 + len(req.prompt_logprobs)  # prompt tokens with a logprob (the first has none)
        end = min(chunk.start + chunk.num_tokens, seq.num_prompt_tokens - 1)  # last predicting position + 1
        for a in range(max(chunk.start, have - 1), end, 256):  # bounded logits memory
            b = min(a + 256, end)
            x = self.logits(hidden[a - chunk.start: b - chunk.start])
            got += token_logprobs(x, seq.token_ids[a + 1: b + 1], [k] * (b - a))
        return got


# Decode batch sizes a captured graph is made for (vLLM's capture sizes): a batch runs the
# smallest that holds it, padded.
BUCKETS = (1, 2, 4, 8) + tuple(range(16, 257, 8)) + tuple(range(272, 1025, 16))


def bucket(n: int) -> int:
    """The smallest bucket of at least n rows (n itself past the largest)."""
    return next((b for b in BUCKETS if b >= n), n)


class CompiledDecode:
    """The model's decode forward under torch.compile: dynamic in the number of tokens (one graph
    for every batch size); on CUDA mode 'reduce-overhead' (CUDA graphs, one per bucket). A
    compile failure falls back to eager once, with one warning that says why."""

    def __init__(self, model: torch.nn.Module, device: torch.device, backend: Any = "inductor") -> None:
        self.model = model
        mode = "reduce-overhead" if device.type == "cuda" and backend == "inductor" else None
        self._fn = torch.compile(self._forward, dynamic=True, fullgraph=True, mode=mode, backend=backend)
        self.failed: str | None = None

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, view: Any) -> torch.Tensor:
        return self.model(input_ids, positions, view, return_hidden=True, compute_logits=False).hidden[0]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, view: Any) -> torch.Tensor:
        """Final hidden states [N, H] of a decode batch."""
        if self.failed is None:
            try:
                # The pool's shapes never change; sizes that happen to be equal (a batch of 2 and
                # 2 K/V heads) are not the same size: no duck sizing, or each bucket recompiles.
                for t in (*view.pool.k, *view.pool.v):
                    torch._dynamo.mark_static(t)
                with torch.fx.experimental._config.patch(use_duck_shape=False):
                    return self._fn(input_ids, positions, view)
            except Exception as e:  # noqa: BLE001 - any compile error: serve eagerly instead
                root = e.__cause__ or e  # a backend's own error, under dynamo's wrapper
                self.failed = f"{type(root).__name__}: {' '.join(str(root).split())[:300]}"
                warnings.warn(f"reclaim: torch.compile of the decode forward failed, running eagerly ({self.failed})",
                              stacklevel=2)
        return self._forward(input_ids, positions, view)


def randomness(req: RequestState) -> Any:
    """A seeded request draws its next token with the uniform keyed by (seed, position), so its
    output is the same with or without speculation; others use their generator."""
    seed = req.seq.params.seed
    return req.generator if seed is None else Keyed(seed, req.seq.num_tokens)


@dataclass
class Verified:
    """A verified draft: its tokens (after processing cut it), its depth, the tokens accepted."""

    drafted: int
    depth: int
    accepted: int


@dataclass
class RunnerOutput:
    """What one step's forward produced, by request id (vLLM v1's ModelRunnerOutput)."""

    hidden: dict[str, torch.Tensor] = field(default_factory=dict)  # each chunk's own tokens' final states
    tokens: dict[str, list[int] | Exception] = field(default_factory=dict)  # to commit, or what failed it alone
    logprobs: dict[str, list | None] = field(default_factory=dict)  # of those tokens, when asked
    prompt_logprobs: dict[str, list] = field(default_factory=dict)  # new ones, of prefill chunks that asked
    accepted: dict[str, Verified] = field(default_factory=dict)  # the drafts verified
    # what the proposer is shown: (request id, start, token ids, features of the positions kept)
    observed: list[tuple[str, int, list[int], torch.Tensor]] = field(default_factory=list)
