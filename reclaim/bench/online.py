"""`reclaim bench online`: training on feedback by reusing the server's prefill, against the
baseline a separate trainer is (the same trainer recomputing the whole forward, logits only on
response tokens), and serving latency with and without training co-located, in one process.

Workload (ShareGPT-shaped). Conversations are (user, assistant) turns: with `--sharegpt FILE` the
first (human, gpt) pair of each of the file's conversations (`reclaim.data.sharegpt.load_sharegpt`);
otherwise synthetic turns whose token lengths follow `reclaim.data.sharegpt.synthetic_lengths`
(log-normal, user median 130 / sigma 1.0, assistant median 150 / sigma 0.8, times `scale`), of
plain English words. A prompt is a conversation's history: consecutive turns chained as earlier
user/assistant messages before a last user message, chat-templated.

- Training mixes (P/R, default 256/256, 1024/256, 2048/512): a history of at least P tokens, its
  last P kept (the new user turn and the generation prompt at the end), and R tokens of the
  assistant replies that follow. Per mix, batch 1: the recompute step (forward + backward), the
  prompt's forward alone (what reuse saves: the ceiling is step / (step - prompt forward)), the
  server's recording prefill, the reuse step (response-only forward attending to the record,
  backward into the prompt's graph), medians of `repeats` runs, sides alternating; training
  tokens/s (response tokens per second of step); what the planner (the trainer's measured cost
  model) picks; peak training memory (the c10 CPU allocator's live bytes as torch.profiler's
  `profile_memory` reports them, the record held for reuse included, weights and optimizer state
  excluded); trainable response tokens under `memory_budget` (samples of the mix that fit, from
  the per-sample peak less the gradients, which do not grow with the batch); record bytes per
  prompt token, full and selective, against what autograd saves for the prompt.
- Serving: `requests` requests, each a conversation's turn k (k uniform in 1..max_turns) with the
  history before it as the prompt and the assistant turn's length as max_tokens (EOS ignored),
  arriving as a Poisson stream at `rate` requests/s; run serving only, recording only, and with
  `serve --learn`'s co-location (`feedback_share` of the requests ask to be retained for
  training, so their prefills are recorded, and get feedback with rating 1 when they finish;
  training between engine steps within `max_ttft_slowdown`), `serve_repeats` times each,
  interleaved with the order rotated each repeat. TTFT (arrival to first token) and TPOT per
  request, by percentile over all passes; each pass against the serving-only pass of its repeat;
  and the noise floor: serving alone's odd passes pooled against its even ones (the same work on
  both sides: at serving utilization ~0.8 queueing turns small changes in the machine's speed into
  large ones in TTFT).
"""

from __future__ import annotations

import gc
import math
import random
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from reclaim.bench.meta import finish_metadata, run_metadata, write_result
from reclaim.online.recorder import record_prompt, recompute_loss, reuse_gradient_errors, reuse_loss

MIXES = ((256, 256), (1024, 256), (2048, 512))


@dataclass
class OnlineBenchSpec:
    """One `reclaim bench online` run."""

    model: str | None = None  # HF directory; None: the bundled SmolLM2
    mixes: list[tuple[int, int]] = field(default_factory=lambda: list(MIXES))
    sharegpt: str | None = None  # a ShareGPT JSON file; None: synthetic conversations
    repeats: int = 2  # timed runs per path and mix (medians)
    threads: int | None = 2
    memory_budget_gib: float = 2.0  # activation budget for "trainable tokens under a budget"
    requests: int = 24  # the serving stream (0: no serving side)
    rate: float = 0.5  # Poisson arrivals, requests per second
    scale: float = 0.15  # multiplies the ShareGPT medians of the serving stream's turns
    max_turns: int = 3  # a request is turn 1..max_turns of its conversation
    feedback_share: float = 0.5
    max_ttft_slowdown: float = 0.1
    serve_repeats: int = 1  # passes of the stream per side (interleaved, order rotated; pooled)
    train_batch: int = 4  # per_device_train_batch_size while serving
    learning_rate: float = 1e-5
    max_num_seqs: int = 8
    seed: int = 0
    out_dir: str = "benchmarks"
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields (--engine-config)

    def __post_init__(self) -> None:
        self.mixes = [tuple(m) for m in self.mixes]
        for p, r in self.mixes:
            if p < 1 or r < 1:
                raise ValueError(f"mix {p}/{r}: prompt and response tokens must be >= 1")
        for name in ("repeats", "serve_repeats", "max_turns", "train_batch", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.requests < 0:
            raise ValueError(f"requests={self.requests}: must be >= 0 (0 skips the serving side)")
        if not 0 <= self.feedback_share <= 1:
            raise ValueError(f"feedback_share={self.feedback_share}: must be in [0, 1]")
        for name in ("rate", "scale", "memory_budget_gib"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0")


def parse_mixes(text: str) -> list[tuple[int, int]]:
    """'256/256,1024/256' -> [(256, 256), (1024, 256)]."""
    out = []
    for part in text.split(","):
        p, sep, r = part.strip().partition("/")
        if not sep or not p.isdigit() or not r.isdigit():
            raise ValueError(f"mix {part!r}: expected PROMPT/RESPONSE token counts, e.g. 1024/256")
        out.append((int(p), int(r)))
    return out


# ---- workload --------------------------------------------------------------------------------

def conversation_turns(tokenizer: Any, n: int, *, sharegpt: str | None, scale: float,
                       seed: int) -> list[tuple[str, str]]:
    """`n` (user, assistant) turns: the file's first pairs (cycled), or synthetic ones."""
    from reclaim.data.sharegpt import load_sharegpt, synthetic_lengths, user_message

    if sharegpt is not None:
        pairs = [(c.prompt, c.completion) for c in load_sharegpt(sharegpt) if c.prompt and c.completion]
        if not pairs:
            raise ValueError(f"{sharegpt}: no conversation starts with a human turn and a gpt reply")
        return [pairs[i % len(pairs)] for i in range(n)]
    rng = random.Random(seed + 1)
    return [(user_message(tokenizer, x.prompt_tokens, rng), user_message(tokenizer, x.output_tokens, rng))
            for x in synthetic_lengths(n, seed=seed, scale=scale)]


def history_prompt(tokenizer: Any, turns: Sequence[tuple[str, str]], *,
                   min_tokens: int | None = None) -> list[int]:
    """Chat prompt ids: the last turn's user message after the earlier turns as history (all of
    them; with `min_tokens`, the fewest that reach it, and the last min_tokens ids kept)."""
    from reclaim.models.tokenizer import encode_chat

    last = len(turns) - 1
    for k in range(last + 1) if min_tokens is not None else (last,):  # k earlier turns
        msgs = []
        for user, reply in turns[last - k:last]:
            msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        ids = encode_chat(tokenizer, msgs + [{"role": "user", "content": turns[last][0]}])
        if min_tokens is not None and len(ids) >= min_tokens:
            return ids[-min_tokens:]
    if min_tokens is not None:
        raise ValueError(f"{len(turns)} turns make {len(ids)} prompt tokens, fewer than {min_tokens}")
    return ids


def mix_sample(tokenizer: Any, turns: Sequence[tuple[str, str]], prompt_tokens: int,
               response_tokens: int) -> tuple[list[int], list[int]]:
    """A training sample of exactly the mix's lengths: a history prompt ending at the last turn's
    user message, and that turn's reply continued by the other replies (cycled) to the length."""
    prompt = history_prompt(tokenizer, turns, min_tokens=prompt_tokens)
    reply: list[int] = []
    i = len(turns) - 1
    while len(reply) < response_tokens:
        reply += tokenizer.encode(turns[i % len(turns)][1], add_special_tokens=False)
        i += 1
    return prompt, reply[:response_tokens]


# ---- training ---------------------------------------------------------------------------------

def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _step(loss_fn: Callable[[], tuple[torch.Tensor, int]]) -> None:
    loss, n = loss_fn()
    (loss / n).backward()


def _forward(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """The prompt's forward (with autograd unless turned off), its output dropped at once."""
    model(ids, return_hidden=True, compute_logits=False)


def peak_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Peak live bytes `fn` allocated above what was live before it (the c10 CPU allocator's
    allocations and frees as torch.profiler records them, profile_memory, summed in time order;
    frees of older blocks are not reported), and what `fn` returned."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak, out


def train_mix(model: torch.nn.Module, prompt: list[int], resp: list[int], repeats: int,
              cost: Any, grad_bytes: int, budget: float, warmup: bool) -> dict[str, Any]:
    """Every training figure of one mix (see the module docstring)."""
    from reclaim.online.store import RecordInfo
    from reclaim.online.trainer import Sample, plan

    p, r = len(prompt), len(resp)
    ids = torch.tensor([prompt])
    times: dict[str, list[float]] = {k: [] for k in (
        "recompute_s", "prompt_forward_s", "inference_prefill_s", "record_s", "reuse_s",
        "selective_record_s", "selective_reuse_s")}
    for i in range(repeats + warmup):
        model.zero_grad(set_to_none=True)
        t_rec, _ = _timed(lambda: _step(lambda: recompute_loss(model, [prompt], [resp])))
        # what recomputing spends on the prompt: its forward with autograd, graph then dropped
        t_fwd, _ = _timed(lambda: _forward(model, ids))
        with torch.inference_mode():  # the prefill serving runs when it does not record
            t_inf, _ = _timed(lambda: _forward(model, ids))
        t_record, record = _timed(lambda: record_prompt(model, prompt, response_id="b", version=0))
        model.zero_grad(set_to_none=True)
        t_reuse, _ = _timed(lambda: _step(lambda: reuse_loss(model, [record], [resp])))
        t_srec, sel = _timed(lambda: record_prompt(model, prompt, response_id="s", version=0,
                                                   selective=True))
        model.zero_grad(set_to_none=True)
        t_sel, _ = _timed(lambda: _step(lambda: reuse_loss(model, [sel], [resp])))
        if i >= warmup:
            for k, v in zip(times, (t_rec, t_fwd, t_inf, t_record, t_reuse, t_srec, t_sel)):
                times[k].append(v)
        del record, sel  # their K/V: the next round's recording must not sit beside them
    med = {k: statistics.median(v) for k, v in times.items()}
    step, fwd, reuse = med["recompute_s"], med["prompt_forward_s"], med["reuse_s"]
    ceiling = step / (step - fwd) if step > fwd else math.inf
    # memory: separate runs (the profiler slows them); reuse's run records the prompt first (the
    # record is held from the prefill to the step), so the record's bytes and frees are seen
    def with_record(**kw: Any) -> Callable[[], Any]:
        def run() -> Any:
            rec = record_prompt(model, prompt, response_id="m", version=0, **kw)
            _step(lambda: reuse_loss(model, [rec], [resp]))
            return rec
        return run

    model.zero_grad(set_to_none=True)
    mem_recompute, _ = peak_bytes(lambda: _step(lambda: recompute_loss(model, [prompt], [resp])))
    model.zero_grad(set_to_none=True)
    mem_reuse, record = peak_bytes(with_record())
    model.zero_grad(set_to_none=True)
    mem_sel, sel = peak_bytes(with_record(selective=True))
    model.zero_grad(set_to_none=True)
    # the planner, as the trainer runs it: one decision for a sample with its record on the device
    decision = plan([Sample(0, "b", prompt, resp)],
                    [RecordInfo("present", 0, "device", record.nbytes, p)], 0, 0, cost)[0]
    planned = reuse if decision.action == "reuse" else step

    def budget_tokens(peak: int) -> int:
        per_sample = max(peak - grad_bytes, 1)
        return int(budget // per_sample) * r

    full = record.saved_bytes / p
    return dict(
        prompt=p, response=r, **med,
        recompute_tokens_per_s=r / step, reuse_tokens_per_s=r / reuse,
        selective_tokens_per_s=r / med["selective_reuse_s"], planned_tokens_per_s=r / planned,
        speedup=step / reuse, selective_speedup=step / med["selective_reuse_s"],
        planned_speedup=step / planned, ceiling=ceiling, of_ceiling=(step / reuse) / ceiling,
        record_slowdown_of_prefill=med["record_s"] / med["inference_prefill_s"],
        planner=dict(action=decision.action, reason=decision.reason, saved_s=decision.saved_s,
                     cost_s=decision.cost_s),
        peak_train_bytes=dict(recompute=mem_recompute, reuse=mem_reuse, reuse_selective=mem_sel),
        trainable_tokens_under_budget=dict(recompute=budget_tokens(mem_recompute),
                                           reuse=budget_tokens(mem_reuse),
                                           reuse_selective=budget_tokens(mem_sel)),
        autograd_saved_bytes_per_prompt_token=full,
        selective_saved_bytes_per_prompt_token=sel.saved_bytes / p,
        selective_of_autograd=sel.saved_bytes / record.saved_bytes,
        kv_bytes_per_prompt_token=record.kv_bytes / p, samples=times)


def bench_training(model: torch.nn.Module, tokenizer: Any, spec: OnlineBenchSpec,
                   log: Callable[[str], None]) -> dict[str, Any]:
    """The training side: every mix, gradient errors on the first, the optimizer step apart."""
    from reclaim.online.trainer import CostModel
    from reclaim.optim import adamw

    model.train()
    longest = max(p + r for p, r in spec.mixes)
    # enough turns for the longest mix's history and replies (synthetic turns at ShareGPT's size)
    turns = conversation_turns(tokenizer, max(8, longest // 40), sharegpt=spec.sharegpt, scale=1.0,
                               seed=spec.seed)
    t_cost, cost = _timed(lambda: CostModel.measure(model))  # what `serve --learn` measures
    trainable = [q for q in model.parameters() if q.requires_grad]
    grad_bytes = sum(q.numel() * q.element_size() for q in trainable)
    budget = spec.memory_budget_gib * 2**30
    rows = []
    for p, r in spec.mixes:
        prompt, resp = mix_sample(tokenizer, turns, p, r)
        row = train_mix(model, prompt, resp, spec.repeats, cost, grad_bytes, budget, warmup=not rows)
        if not rows:
            row.update(reuse_gradient_errors(model, prompt, resp, {
                "exact_reuse_rel_err": {}, "selective_reuse_rel_err": {"selective": True},
                "prefix_grad_false_rel_err": {"prefix_grad": False}}))
        rows.append(row)
        log(f"mix {p}/{r}: recompute {row['recompute_tokens_per_s']:.1f} tok/s, reuse "
            f"{row['reuse_tokens_per_s']:.1f} ({row['speedup']:.2f}x, ceiling {row['ceiling']:.2f}x, "
            f"{100 * row['of_ceiling']:.0f}% of it), planner {row['planner']['action']} "
            f"({row['planned_speedup']:.2f}x); peak MiB recompute "
            f"{row['peak_train_bytes']['recompute'] / 2**20:.0f} / reuse "
            f"{row['peak_train_bytes']['reuse'] / 2**20:.0f} / selective "
            f"{row['peak_train_bytes']['reuse_selective'] / 2**20:.0f}; record "
            f"{row['selective_of_autograd']:.0%} of autograd's bytes (selective)")
    opt = adamw(trainable, lr=0.0)  # the trainer's optimizer; lr 0: the weights stay as they are
    for q in trainable:
        q.grad = torch.zeros_like(q)
    t_opt, _ = _timed(opt.step)  # the same on both paths: reported apart
    model.zero_grad(set_to_none=True)
    return dict(cost_model=asdict(cost), cost_model_measure_s=t_cost, grad_bytes=grad_bytes,
                memory_budget_bytes=budget, optimizer_step_s=t_opt, mixes=rows)


# ---- serving ----------------------------------------------------------------------------------

def request_stream(tokenizer: Any, spec: OnlineBenchSpec, max_len: int
                   ) -> list[tuple[float, list[int], int]]:
    """(arrival second, prompt ids, output tokens) per request: turn k of a conversation with its
    history, Poisson arrivals at spec.rate."""
    turns = conversation_turns(tokenizer, spec.requests * spec.max_turns, sharegpt=spec.sharegpt,
                               scale=spec.scale, seed=spec.seed + 7)
    lengths = [len(tokenizer.encode(reply, add_special_tokens=False)) for _, reply in turns]
    rng = random.Random(spec.seed)
    t, out = 0.0, []
    for i in range(spec.requests):
        base = i * spec.max_turns
        k = rng.randint(1, spec.max_turns)
        prompt = history_prompt(tokenizer, turns[base:base + k])
        prompt = prompt[-(max_len // 2):]  # keep room for the output in the context
        out.append((t, prompt, max(1, min(lengths[base + k - 1], max_len - len(prompt) - 1))))
        t += rng.expovariate(spec.rate)
    return out


def _percentiles(xs: Sequence[float]) -> dict[str, float | None]:
    if not xs:
        return dict(p50=None, p90=None, p99=None, mean=None)
    s = sorted(xs)

    def q(f: float) -> float:
        return s[min(len(s) - 1, int(f * len(s)))]

    return dict(p50=statistics.median(s), p90=q(0.9), p99=q(0.99), mean=statistics.fmean(s))


def serve_stream(model: torch.nn.Module, tokenizer: Any, stream: Sequence[tuple[float, list[int], int]],
                 spec: OnlineBenchSpec, learn: bool, cost: Any = None, train: bool = True
                 ) -> dict[str, Any]:
    """Replay the stream on an engine stepped here as the server's engine thread steps it; with
    `learn`, the server's co-location (record the prefills of requests that will get feedback,
    feedback on a share, train; with train=False no training: what recording alone costs)."""
    from reclaim.engine.config import EngineConfig
    from reclaim.engine.engine import Engine
    from reclaim.engine.request import SamplingParams

    base = EngineConfig(**{"seed": spec.seed, "max_model_len": model.config.max_position_embeddings, **spec.engine})
    engine = Engine(model, tokenizer, base, max_num_seqs=spec.max_num_seqs)
    colocated, tmp = None, None
    if learn:
        from reclaim.online.colocate import Colocated, key_of_request
        from reclaim.online.learner import OnlineLearner
        from reclaim.online.trainer import OnlineTrainConfig

        tmp = tempfile.TemporaryDirectory(prefix="reclaim-bench-online-")
        cfg = OnlineTrainConfig(output_dir=tmp.name, per_device_train_batch_size=spec.train_batch,
                                micro_batch_size=1, learning_rate=spec.learning_rate,
                                record="requested", save_steps=0)
        learner = OnlineLearner(model, cfg, tokenize=lambda s: tokenizer.encode(s, add_special_tokens=False),
                                cost=cost)
        colocated = Colocated(learner, engine, max_ttft_slowdown=spec.max_ttft_slowdown)
    engine.generate([stream[0][1]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    rng = random.Random(spec.seed + 3)
    give_feedback = {i for i in range(len(stream)) if rng.random() < spec.feedback_share}
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    ntok: dict[int, int] = {}
    t0 = time.perf_counter()
    i = 0

    def admit() -> float:
        """Add the requests that have arrived (a server's inbox fills while a step runs)."""
        nonlocal i
        now = time.perf_counter() - t0
        while i < len(stream) and stream[i][0] <= now:
            params = SamplingParams(temperature=0, max_tokens=stream[i][2], ignore_eos=True)
            # a client that means to give feedback asks for retain_for_training (--record
            # requested, the bundled config's policy): only those prefills are recorded
            engine.add_request(f"b{i}-0", stream[i][1], params, record=learn and i in give_feedback)
            i += 1
        return now

    try:
        while i < len(stream) or engine.has_unfinished():
            now = admit()
            if engine.has_unfinished():
                t = time.perf_counter()
                outs = engine.step()
                step_s = time.perf_counter() - t
                now = time.perf_counter() - t0
                for o in outs:
                    j = int(o.request_id[1:].split("-")[0])
                    if o.new_token_ids:
                        first.setdefault(j, now)
                        last[j] = now
                        ntok[j] = ntok.get(j, 0) + len(o.new_token_ids)
                if colocated is not None:
                    colocated.log_finished(outs)
                    for o in outs:
                        j = int(o.request_id[1:].split("-")[0])
                        if o.finished and j in give_feedback:
                            colocated.learner.feedback(key_of_request(o.request_id), 1)
                    admit()  # what arrived during the step is waiting: training lets it go first
                    if train:
                        colocated.after_step(step_s)
            elif colocated is not None and train and colocated.busy:
                colocated.after_step(0.0)  # idle: a short training slice
            else:
                time.sleep(max(0.0, min(0.01, stream[i][0] - now)) if i < len(stream) else 0.0)
        wall = time.perf_counter() - t0
        ttft = [first[j] - stream[j][0] for j in sorted(first)]
        tpot = [(last[j] - first[j]) / (ntok[j] - 1) for j in sorted(first) if ntok[j] > 1]
        out = dict(requests=len(stream), output_tokens=sum(ntok.values()), seconds=wall,
                   output_tokens_per_s=sum(ntok.values()) / wall, ttft_s=_percentiles(ttft),
                   tpot_s=_percentiles(tpot), feedback_given=len(give_feedback),
                   ttft_each_s=ttft, tpot_each_s=tpot)
        if colocated is not None:
            # retained requests served unrecorded while another waited (record_when_queued false)
            out["learning"] = {**colocated.metrics(), "record_skipped": engine.num_record_skipped}
        return out
    finally:
        if tmp is not None:
            colocated.close()
            colocated.learner.log.close()
            tmp.cleanup()


def ratios_of(run: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    """TTFT and TPOT percentiles of `run` over `base`'s."""
    return {f"{k}_{s}": run[k][s] / base[k][s] if base[k][s] and run[k][s] is not None else None
            for k in ("ttft_s", "tpot_s") for s in ("p50", "p90", "mean")}


def bench_serving(model: torch.nn.Module, tokenizer: Any, spec: OnlineBenchSpec, cost: Any,
                  log: Callable[[str], None]) -> dict[str, Any]:
    """The stream served alone, recording the retained prompts without training, and with
    co-located training, serve_repeats times each (interleaved); the slowdowns of the last two,
    pooled and per pass, and serving alone against itself (the noise floor)."""
    stream = request_stream(tokenizer, spec, model.config.max_position_embeddings)
    model.eval()
    sides = {"serve_only": dict(learn=False), "serve_and_record": dict(learn=True, train=False),
             "serve_and_learn": dict(learn=True)}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in sides}
    names = list(sides)
    for rep in range(spec.serve_repeats):  # interleaved, the order rotated each repeat, so
        k = rep % len(names)  # drifting load hits every side alike
        for side in names[k:] + names[:k]:
            kw = sides[side]
            r = serve_stream(model, tokenizer, stream, spec, cost=cost, **kw)
            r["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # so far
            # what the pass left to the collector; freed memory stays with malloc for the next
            # pass (reclaim/hugepages.py), as in a server that keeps running: handing it back
            # (malloc_trim, as this did before) made the next pass's recorded prefills touch fresh
            # memory, ~2x an unrecorded prefill on this project's VMs; the record store's budgets
            # bound what passes hold (peak RSS per pass: max_rss_bytes)
            gc.collect()
            runs[side].append(r)
            log(f"{side}: TTFT p50 {r['ttft_s']['p50']:.3f} s, mean {r['ttft_s']['mean']:.3f} s; TPOT p50 "
                f"{r['tpot_s']['p50']:.3f} s" + (f"; {r['learning']['train_steps']} training steps"
                                                  if kw.get("train", kw["learn"]) else ""))

    def pooled(rs: list[dict[str, Any]]) -> dict[str, Any]:
        """Every request of every repeat together (one pass's percentiles swing by tens of % with
        where the training steps fall); each pass's own figures under `runs`."""
        keep = ("ttft_s", "tpot_s", "seconds", "learning", "max_rss_bytes")
        out = {**rs[-1], "runs": [{k: r[k] for k in keep if k in r} for r in rs]}
        for key in ("ttft", "tpot"):
            out[f"{key}_s"] = _percentiles([x for r in rs for x in r[f"{key}_each_s"]])
            del out[f"{key}_each_s"]
        return out

    plain, record, learn = (pooled(runs[k]) for k in sides)

    def per_pass(side: str) -> dict[str, list[float]]:
        """Each repeat's pass against serving alone in the same repeat."""
        return {f"{k}_{s}": [r[k][s] / p[k][s] for r, p in zip(runs[side], runs["serve_only"])]
                for k in ("ttft_s", "tpot_s") for s in ("p50", "mean")}

    prompts = [len(p) for _, p, _ in stream]
    out = dict(prompt_tokens=_percentiles(prompts), output_tokens=[n for _, _, n in stream],
               serve_only=plain, serve_and_record=record, serve_and_learn=learn,
               slowdown=ratios_of(learn, plain), slowdown_recording_only=ratios_of(record, plain),
               slowdown_per_pass=per_pass("serve_and_learn"),
               slowdown_recording_only_per_pass=per_pass("serve_and_record"))
    if spec.serve_repeats >= 2:  # the noise floor: serving alone against itself, same work both
        # sides (its odd passes pooled against its even ones, as a side's pooled passes are compared)
        out["serve_only_odd_vs_even"] = ratios_of(pooled(runs["serve_only"][1::2]),
                                                  pooled(runs["serve_only"][0::2]))
    return out


# ---- run, plot, write -------------------------------------------------------------------------

def measure(spec: OnlineBenchSpec, log: Callable[[str], None] | None = None,
            partial: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Training side, then serving side; `partial` gets the result with the training side alone
    (so a run cut short in the serving side keeps it)."""
    from reclaim.models.loading import load_model, resolve_model_dir

    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    if spec.threads:
        torch.set_num_threads(spec.threads)
    meta = run_metadata()
    model, tokenizer = load_model(spec.model)
    for p in model.parameters():
        p.requires_grad_(True)
    from reclaim.online.embedding_grad import RowGradEmbedding

    RowGradEmbedding(model)  # as the online trainer does, for both sides
    training = bench_training(model, tokenizer, spec, log)
    result = dict(spec=asdict(spec), model=str(resolve_model_dir(spec.model)),
                  dtype=str(next(model.parameters()).dtype), training=training, serving=None, meta=meta)
    if partial is not None:
        partial(result)
    from reclaim.online.trainer import CostModel

    if spec.requests:
        result["serving"] = bench_serving(model, tokenizer, spec, CostModel(**training["cost_model"]), log)
    result["meta"] = finish_metadata(meta)
    return result


def _plot_serving(ax: Any, s: dict[str, Any] | None) -> None:
    """TTFT and TPOT percentiles, serving alone and with training co-located."""
    if s is None:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "serving side not run (--requests 0)", ha="center")
        return
    stats = ("p50", "p90", "mean")
    runs = [(k, label) for k, label in (("serve_only", "serving only"), ("serve_and_record", "+ recording"),
                                         ("serve_and_learn", "+ recording + training")) if k in s]
    w = 0.8 / len(runs)
    for k, (key, label) in enumerate(runs):
        off = (k - (len(runs) - 1) / 2) * w
        ax.bar([j + off for j in range(3)], [s[key]["ttft_s"][q] for q in stats], w, label=f"TTFT, {label}")
        ax.bar([3.5 + j + off for j in range(3)], [s[key]["tpot_s"][q] for q in stats],
               w, label=f"TPOT, {label}", hatch="//", alpha=0.7)
    ax.set_xticks([0, 1, 2, 3.5, 4.5, 5.5], [f"TTFT {q}" for q in stats] + [f"TPOT {q}" for q in stats],
                  fontsize=7)
    ax.set_ylabel("seconds")
    ax.legend(fontsize=6)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["training"]["mixes"]
    names = [f"{m['prompt']}/{m['response']}" for m in rows]
    xs = range(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    ax = axes[0]
    w = 0.2
    for k, (key, label) in enumerate((("recompute_tokens_per_s", "recompute (baseline)"),
                                      ("reuse_tokens_per_s", "exact reuse"),
                                      ("selective_tokens_per_s", "reuse, selective record"),
                                      ("planned_tokens_per_s", "planner's choice"))):
        ax.bar([x + (k - 1.5) * w for x in xs], [m[key] for m in rows], w, label=label)
    for x, m in zip(xs, rows):  # the ceiling: recompute's tokens/s times step / (step - prompt fwd)
        ax.plot([x - 2 * w, x + 2 * w], [m["recompute_tokens_per_s"] * m["ceiling"]] * 2, "k--", lw=1)
    ax.set_xticks(list(xs), names)
    ax.set_xlabel("prompt / response tokens")
    ax.set_ylabel("training tokens/s (dashed: reuse's ceiling)")
    ax.legend(fontsize=7)
    ax = axes[1]
    for k, (key, label) in enumerate((("recompute", "recompute"), ("reuse", "exact reuse"),
                                      ("reuse_selective", "reuse, selective record"))):
        ax.bar([x + (k - 1) * 0.25 for x in xs], [m["peak_train_bytes"][key] / 2**20 for m in rows],
               0.25, label=label)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("peak training MiB (grads + activations + record)")
    ax.legend(fontsize=7)
    _plot_serving(axes[2], result["serving"])
    fig.suptitle("Online learning while serving (reclaim bench online): reuse vs recompute; serving latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(spec: OnlineBenchSpec, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    result = measure(spec, log, partial=lambda r: write_result(spec.out_dir, "online", r))
    write_result(spec.out_dir, "online", result, plot)
    return result
