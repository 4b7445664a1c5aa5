"""Micro-benchmark of exact prompt reuse (to become `reclaim bench online`): one training sample's
forward + backward, reusing a recorded prompt against recomputing it, at several prompt:response
mixes, with the ceiling of reuse (step / (step - prompt forward)) measured in the same run.

    python -m reclaim.online.bench --threads 2 --repeats 2 > online.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Sequence

import torch

from reclaim.online.recorder import record_prompt, recompute_loss, reuse_loss

MIXES = ((256, 256), (1024, 256), (2048, 512))


def _timed(fn) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _step(model, loss_fn) -> None:
    loss, n = loss_fn()
    (loss / n).backward()


def _gradient_errors(model, prompt, resp) -> dict[str, float]:
    """Relative error of the whole gradient against recompute's: exact reuse, and the cheaper
    prefix_grad=False (gradient stopped at the prompt)."""
    model.zero_grad(set_to_none=True)
    _step(model, lambda: recompute_loss(model, [prompt], [resp]))
    want = [p.grad.clone() for p in model.parameters()]
    norm = sum(float(w.square().sum()) for w in want) ** 0.5
    out = {}
    for name, prefix_grad in (("exact_reuse_rel_err", True), ("prefix_grad_false_rel_err", False)):
        model.zero_grad(set_to_none=True)
        rec = record_prompt(model, prompt, response_id="g", version=0, prefix_grad=prefix_grad)
        _step(model, lambda: reuse_loss(model, [rec], [resp]))
        diff = sum(float((p.grad - w).square().sum()) for p, w in zip(model.parameters(), want))
        out[name] = diff ** 0.5 / norm
    model.zero_grad(set_to_none=True)
    return out


def bench_online(model: torch.nn.Module | None = None, mixes: Sequence[tuple[int, int]] = MIXES,
                 threads: int = 2, repeats: int = 2, seed: int = 0) -> dict[str, Any]:
    """Per mix, median seconds of: the recompute step, its prompt forward, recording the prompt,
    the reuse step (steps are forward + backward, batch 1); the speed-up, its ceiling and the
    record's bytes per prompt token. The optimizer step (the same on both paths) is apart."""
    if model is None:
        from reclaim.models.loading import load_model

        model = load_model(None)[0]
    torch.set_num_threads(threads)
    model.train()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    rows = []
    for p, r in mixes:
        prompt = torch.randint(vocab, (p,), generator=g).tolist()
        resp = torch.randint(vocab, (r,), generator=g).tolist()
        ids = torch.tensor([prompt])
        times: dict[str, list[float]] = dict(recompute_s=[], prompt_forward_s=[], record_s=[],
                                             reuse_s=[])
        warmup = 1 if not rows else 0  # the first mix's first round warms up, untimed
        for i in range(repeats + warmup):
            model.zero_grad(set_to_none=True)
            t_rec, _ = _timed(lambda: _step(model, lambda: recompute_loss(model, [prompt], [resp])))
            # what recomputing spends on the prompt: its forward with autograd, graph then dropped
            t_fwd, _ = _timed(lambda: model(ids, return_hidden=True, compute_logits=False))
            # what the server spends to record it (the same forward, saved tensors captured)
            t_record, record = _timed(lambda: record_prompt(model, prompt, response_id="b",
                                                            version=0))
            model.zero_grad(set_to_none=True)
            t_reuse, _ = _timed(lambda: _step(model, lambda: reuse_loss(model, [record], [resp])))
            if i >= warmup:
                for k, v in zip(times, (t_rec, t_fwd, t_record, t_reuse)):
                    times[k].append(v)
        step, fwd, reuse = (statistics.median(times[k]) for k in ("recompute_s",
                                                                   "prompt_forward_s", "reuse_s"))
        ceiling = step / (step - fwd) if step > fwd else float("inf")
        rows.append(dict(prompt=p, response=r, recompute_s=step, prompt_forward_s=fwd,
                         record_s=statistics.median(times["record_s"]), reuse_s=reuse,
                         speedup=step / reuse, ceiling=ceiling, of_ceiling=(step / reuse) / ceiling,
                         record_saved_bytes_per_token=record.saved_bytes / p,
                         record_kv_bytes_per_token=record.kv_bytes / p, samples=times))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "samples"}), file=sys.stderr,
              flush=True)  # progress: a run cut short still shows the mixes it finished
        if len(rows) == 1:  # on the first mix: gradient errors, and a selective record
            rows[0].update(_gradient_errors(model, prompt, resp))
            t_sel_record, sel = _timed(lambda: record_prompt(model, prompt, response_id="s",
                                                             version=0, selective=True))
            model.zero_grad(set_to_none=True)
            t_sel, _ = _timed(lambda: _step(model, lambda: reuse_loss(model, [sel], [resp])))
            rows[0].update(selective_record_s=t_sel_record, selective_reuse_s=t_sel,
                           selective_speedup=step / t_sel,
                           selective_saved_bytes_per_token=sel.saved_bytes / p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    t_opt, _ = _timed(opt.step)  # constant per step on both paths, reported apart
    model.zero_grad(set_to_none=True)
    return dict(threads=threads, repeats=repeats, dtype=str(next(model.parameters()).dtype),
                optimizer_step_s=t_opt, mixes=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--mixes", default=",".join(f"{p}/{r}" for p, r in MIXES),
                    help="prompt/response token counts, comma-separated")
    args = ap.parse_args()
    mixes = [tuple(int(x) for x in m.split("/")) for m in args.mixes.split(",")]
    print(json.dumps(bench_online(mixes=mixes, threads=args.threads, repeats=args.repeats),
                     indent=2))


if __name__ == "__main__":
    main()
