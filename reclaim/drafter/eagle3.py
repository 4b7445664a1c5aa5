"""Training an EAGLE-3 drafter: the token loss over a training-time test of several steps.

A sample is a sequence, the target's final hidden states over it (for its next-token
distribution) and the states entering its three aux layers (the drafter's input). Step 0 feeds
the pairs (fc(aux_i), embed(x_{i+1})) at positions i with causal attention, as drafting does over
the true prefix; step k feeds the drafter's own step-(k-1) state at row i with token x_{i+1+k}
at position i + k, attending to step 0's keys up to row i and to the keys steps 1..k made at row
i (`StepCache`): what the k-th draft token sees at inference. Each step's loss is the soft
cross-entropy against the target's distribution at position i + 1 + k over the draft vocabulary
(renormalised there), on response positions; step k weighs decay^k (EAGLE-3's 0.8, SafeAILab
EAGLE eagle/traineagle3), and gradients flow through the fed-back states.

Data (`data`): "answers", the target's own answers to the prompts as the EAGLE-2 trainer makes
them (engine decoding), then one forward per sequence for the aux states; or "prefill", one
forward per window of existing text (`prefill_corpus`: the Python standard library's sources
by default, reclaim.data.corpus), its loss over every position. Both record how long they took
per token. `reclaim drafter train --config drafter-smollm2-eagle3` runs `train`; with
`baseline_eagle2` an EAGLE-2 drafter trains on the same samples for comparison.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from reclaim.drafter.acceptance import greedy_acceptance
from reclaim.drafter.data import DrafterBuffer, DrafterSample
from reclaim.drafter.loss import make_optimizer, train_drafter
from reclaim.drafter.train import DRAFTER_TYPES, DrafterTrainConfig, _place_final, _rollouts, _start, fit, train
from reclaim.models.drafter import most_frequent, new_drafter, save_drafter
from reclaim.models.eagle3 import Eagle3Drafter, default_aux_layers, load_eagle3, new_eagle3, save_eagle3
from reclaim.models.llama import check_aux_layers
from reclaim.schedule import lr_scheduler

DATA_SOURCES = ("answers", "prefill")


@dataclass
class Eagle3Sample(DrafterSample):
    """A DrafterSample (tokens, final hidden states, loss mask) with the aux states [T, 3H]."""

    aux: torch.Tensor

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.aux.dim() != 2 or self.aux.shape[0] != self.num_tokens:
            raise ValueError(f"an EAGLE-3 sample needs aux states [T={self.num_tokens}, 3H]; got "
                             f"{tuple(self.aux.shape)}")


@torch.no_grad()
def with_aux(target: torch.nn.Module, samples: Iterable[DrafterSample], aux_layers: Sequence[int],
             store: str | torch.device = "cpu") -> list[Eagle3Sample]:
    """The samples with the target's aux states: one forward per sequence (its final states
    are taken from the same forward)."""
    device = next(target.parameters()).device
    out = []
    for s in samples:
        got = target(s.token_ids[None].to(device), return_hidden=True, compute_logits=False,
                     aux_layers=tuple(aux_layers))
        out.append(Eagle3Sample(s.token_ids, got.hidden[0].to(store), s.loss_mask, got.aux[0].to(store)))
    return out


@torch.no_grad()
def prefill_samples(target: torch.nn.Module, windows: torch.Tensor, aux_layers: Sequence[int], *,
                    batch_size: int = 8, store: str | torch.device = "cpu") -> list[Eagle3Sample]:
    """Samples of existing text: one forward per window (rows of `windows` [N, T], batched), the
    loss over every position (the target's distribution is learnt wherever it predicts)."""
    device = next(target.parameters()).device
    out = []
    for i in range(0, windows.shape[0], batch_size):
        ids = windows[i:i + batch_size].long()
        got = target(ids.to(device), return_hidden=True, compute_logits=False, aux_layers=tuple(aux_layers))
        mask = torch.ones(ids.shape[1], dtype=torch.bool)
        out += [Eagle3Sample(ids[j], got.hidden[j].to(store), mask, got.aux[j].to(store)) for j in range(ids.shape[0])]
    return out


# ---- the training-time test --------------------------------------------------------------------

class StepCache:
    """The attention of a training-time test: step 0 is causal over the rows; step k's query at
    row i also sees the keys steps 1..k made at row i (its own draft chain), nothing else."""

    sliding_window = None

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, layer, k, v):
        self.keys.append(k)
        self.values.append(v)
        if len(self.keys) == 1:
            return k, v, None
        n = k.shape[2]
        causal = torch.ones(n, n, dtype=torch.bool, device=k.device).tril()
        own = torch.eye(n, dtype=torch.bool, device=k.device)
        mask = torch.cat([causal] + [own] * (len(self.keys) - 1), dim=-1)
        return torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2), mask[None, None]


def _ahead(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [B, N, ...] moved k rows earlier along dim 1, zero (False) filled at the end."""
    return torch.cat([x[:, k:], x.new_zeros((x.shape[0], min(k, x.shape[1])) + x.shape[2:])], dim=1)


def ttt_states(drafter: Eagle3Drafter, embeds: torch.Tensor, aux: torch.Tensor, steps: int) -> Iterator[torch.Tensor]:
    """Each step's drafter states [B, N, H] over rows i < N, from the embeddings of x_1..x_N and
    the aux states at 0..N-1: step k at row i is the state drafting computes for its (k+1)-th
    token after x_{i+1}, had it drafted x_{i+2}..x_{i+1+k} before it."""
    b, n = embeds.shape[:2]
    positions = torch.arange(n, device=embeds.device).expand(b, n)
    cache, feats = StepCache(), aux
    for k in range(steps):
        feats = drafter(_ahead(embeds, k), feats, positions + k, cache)
        yield feats


def eagle3_loss(drafter: Eagle3Drafter, target: torch.nn.Module, batch: Sequence[Eagle3Sample], *,
                ttt_steps: int = 5, decay: float = 0.8) -> tuple[torch.Tensor, dict[str, Any]]:
    """The training-time test's weighted token loss on a batch (see the module docstring) and its
    parts: ce_loss (step 0), accuracy (step 0's top-1 equals the target's), acc_<k> and ce_<k> per
    step, tokens (step 0's response positions)."""
    if ttt_steps < 1:
        raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
    p = next(drafter.parameters())
    ids = pad_sequence([s.token_ids for s in batch], batch_first=True).to(p.device)
    final = pad_sequence([s.hidden for s in batch], batch_first=True).to(p.device, p.dtype)
    mask = pad_sequence([s.loss_mask for s in batch], batch_first=True).to(p.device)
    aux = pad_sequence([s.aux for s in batch], batch_first=True).to(p.device, p.dtype)
    b, n = ids.shape[0], ids.shape[1] - 1  # rows i = 0..T-2: pairs (aux_i, x_{i+1})
    head = target.lm_head.weight.detach()
    if drafter.draft_ids is not None:
        head = head[drafter.draft_ids.to(head.device)]
    sel = mask[:, 1:]  # row i's step-0 target is position i + 1's distribution
    with torch.no_grad():
        embeds = F.embedding(ids[:, 1:], target.model.embed_tokens.weight.detach())
        want = torch.softmax(F.linear(final[:, 1:][sel], head).float(), dim=-1)  # [S, N], S = sel.sum()
        where = torch.full((b, n), -1, dtype=torch.long, device=p.device)  # row of `want` at each position
        where[sel] = torch.arange(want.shape[0], device=p.device)
    loss = torch.zeros((), device=p.device)
    parts: dict[str, Any] = {"tokens": int(sel.sum())}
    for k, g in enumerate(ttt_states(drafter, embeds, aux[:, :-1], ttt_steps)):
        on = _ahead(sel, k)
        if on.any():
            logq = torch.log_softmax(drafter.head(g[on])[0], dim=-1)
            p_k = want[_ahead(where, k)[on]]
            ce = -(p_k * logq).sum(-1).mean()
            loss = loss + decay ** k * ce
            parts[f"ce_{k}"] = ce.item()
            parts[f"acc_{k}"] = (logq.argmax(-1) == p_k.argmax(-1)).float().mean().item()
    parts["ce_loss"], parts["accuracy"] = parts.get("ce_0", 0.0), parts.get("acc_0", 0.0)
    return loss, parts


def eagle3_acceptance(drafter: Eagle3Drafter, target: torch.nn.Module, samples: Iterable[Eagle3Sample],
                      num_speculative_tokens: int = 4) -> dict[str, float]:
    """`greedy_acceptance` for an EAGLE-3 drafter: its aux features and its own head."""
    return greedy_acceptance(drafter, target, samples, num_speculative_tokens, features=lambda s: s.aux,
                             head=drafter.head)


# ---- `reclaim drafter train` with drafter_type: eagle3 ----------------------------------------

@dataclass
class Eagle3TrainConfig(DrafterTrainConfig):
    """`reclaim drafter train` for EAGLE-3: DrafterTrainConfig's fields (feature_noise,
    unroll_steps, ce_vocab, reg_loss_weight and ce_loss_weight only shape the EAGLE-2 baseline)
    and these. draft_vocab_size (0: the whole vocabulary) is the head's size from the start."""

    drafter_type: str = "eagle3"
    data: str = "answers"  # answers: the target's own answers to `prompts` | prefill: existing text
    prefill_corpus: str = "stdlib"  # prefill: "stdlib", a text file or a directory (reclaim.data.corpus)
    prefill_sequences: int = 128  # prefill: windows of the corpus
    prefill_seq_len: int = 256  # prefill: tokens per window
    ttt_steps: int = 5  # training-time test steps (EAGLE-3: 7)
    ttt_decay: float = 0.8  # step k's loss weighs ttt_decay ** k
    aux_layers: list[int] | None = None  # the target layers whose input states it takes; None: vLLM's default
    baseline_eagle2: bool = False  # also train an EAGLE-2 drafter on the same samples (output_dir/eagle2)
    baseline_steps: int = 0  # the baseline's steps (0: max_steps); a CPU runs EAGLE-2's several times faster

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.drafter_type != "eagle3":
            raise ValueError(f"Eagle3TrainConfig has drafter_type {self.drafter_type!r}; allowed: 'eagle3'")
        if self.data not in DATA_SOURCES:
            raise ValueError(f"data {self.data!r} is not one of {list(DATA_SOURCES)}")
        if self.baseline_steps < 0:
            raise ValueError(f"baseline_steps must be >= 0, got {self.baseline_steps}")
        for name in ("prefill_sequences", "prefill_seq_len", "ttt_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.ttt_decay <= 1:
            raise ValueError(f"ttt_decay must be in (0, 1], got {self.ttt_decay}")


def _data(cfg: Eagle3TrainConfig, target: torch.nn.Module, tokenizer: Any, out: Path, aux: tuple[int, ...],
          log: Callable[[str], None]) -> tuple[list[Eagle3Sample], list[Eagle3Sample], dict[str, Any]]:
    """Training and held-out samples, and what the training data cost (seconds per token; the
    decoding's only when this run answered every prompt, not when it read answers back)."""
    read_back = cfg.resume_from_checkpoint and (out / "rollouts").exists()
    t0 = time.perf_counter()
    train_s, held = _rollouts(cfg, target, tokenizer, out, log, train=cfg.data == "answers")
    answered = time.perf_counter() - t0
    answers = sum(int(s.loss_mask.sum()) + 1 for s in train_s + held)  # + 1: the last token, never run
    t1 = time.perf_counter()
    if cfg.data == "answers":
        train_s = with_aux(target, train_s, aux)
        cost = {"source": "answers", "answer_tokens": answers}
        if not read_back:  # held-out answers included: the same greedy decoding
            cost.update(decode_s=answered, decode_ms_per_token=1e3 * answered / max(answers, 1))
    else:
        from reclaim.data.corpus import tokenize_corpus, window_batch

        tokens = tokenize_corpus(cfg.prefill_corpus, tokenizer)
        windows = window_batch(tokens, cfg.prefill_seq_len, cfg.prefill_sequences, cfg.seed, 0)
        train_s = prefill_samples(target, windows, aux)
        cost = {"source": f"prefill:{cfg.prefill_corpus}"}
    forward_s = time.perf_counter() - t1
    n = sum(s.num_tokens for s in train_s)
    cost.update(forward_s=forward_s, tokens=n, loss_tokens=sum(int(s.loss_mask.sum()) for s in train_s),
                forward_ms_per_token=1e3 * forward_s / max(n, 1))
    log(f"{cost['source']} data: {n} tokens, aux forward {forward_s:.1f} s"
        + (f", decoding {answered:.1f} s for {answers} answer tokens" if "decode_s" in cost else ""))
    return train_s, with_aux(target, held, aux), cost


def train_eagle3(cfg: Eagle3TrainConfig, *, progress: bool = True,
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run `reclaim drafter train` for EAGLE-3 per cfg; returns a summary (steps, last record,
    held-out tau, data cost, seconds; the EAGLE-2 baseline's with baseline_eagle2). The drafter
    (EAGLE-3 layout) is in cfg.output_dir."""
    t_start = time.perf_counter()
    out, target, tokenizer = _start(cfg)
    aux = tuple(cfg.aux_layers) if cfg.aux_layers else default_aux_layers(target.config.num_hidden_layers)
    check_aux_layers(aux, target.config.num_hidden_layers)
    samples, held_out, cost = _data(cfg, target, tokenizer, out, aux, log)
    buffer = DrafterBuffer(cfg.buffer_tokens)
    buffer.add(samples)
    vocab = None if not cfg.draft_vocab_size else most_frequent(
        [s.token_ids[s.loss_mask].tolist() for s in buffer], cfg.draft_vocab_size, target.config.vocab_size)
    batch = dict(batch_size=cfg.per_device_train_batch_size, batch_tokens=cfg.max_batch_tokens,
                 max_grad_norm=cfg.max_grad_norm, seed=cfg.seed, bf16=cfg.bf16)

    def run(drafter, opt, sched, step, on_step):
        loss = lambda b: eagle3_loss(drafter, target, b, ttt_steps=cfg.ttt_steps, decay=cfg.ttt_decay)  # noqa: E731
        train_drafter(drafter, target, buffer, steps=cfg.max_steps - step, optimizer=opt, scheduler=sched,
                      start_step=step, on_step=on_step, loss_fn=loss, **batch)

    drafter, history, train_s = fit(cfg, out, new=lambda: new_eagle3(target, aux, vocab),
                                    load=lambda p: load_eagle3(p, target), save=save_eagle3, run=run,
                                    keys=("loss", "ce_loss", "accuracy", "grad_norm", "step_s"), progress=progress)
    _place_final(drafter, out, save_eagle3)
    summary: dict[str, Any] = {"drafter_type": "eagle3", "aux_layers": list(aux), "steps": cfg.max_steps,
                               "train_s": train_s, "last": history[-1] if history else None, "data": cost,
                               "train_sequences": len(buffer), "train_tokens": buffer.num_tokens,
                               "draft_vocab_size": drafter.lm_head.out_features}
    k = cfg.num_speculative_tokens
    if held_out:
        summary["eval"] = {"prompts": len(held_out), "num_speculative_tokens": k,
                           **eagle3_acceptance(drafter, target, held_out, k)}
    if cfg.baseline_eagle2:
        summary["eagle2"] = _baseline(cfg, target, buffer, held_out, out / "eagle2", batch)
    summary["total_s"] = time.perf_counter() - t_start
    (out / "eval.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _baseline(cfg: Eagle3TrainConfig, target: torch.nn.Module, buffer: DrafterBuffer,
              held_out: Sequence[DrafterSample], where: Path, batch: dict[str, Any]) -> dict[str, Any]:
    """An EAGLE-2 drafter trained on the same samples for baseline_steps (cfg's EAGLE-2 fields),
    saved to `where`, and its held-out tau (over the whole vocabulary, as the EAGLE-2 trainer's)."""
    steps = cfg.baseline_steps or cfg.max_steps
    warmup = cfg.warmup_steps if cfg.warmup_steps > 0 else math.ceil(cfg.warmup_ratio * steps)
    torch.manual_seed(cfg.seed)
    drafter = new_drafter(target)
    opt = make_optimizer(drafter, cfg.learning_rate, weight_decay=cfg.weight_decay, betas=(cfg.adam_beta1, cfg.adam_beta2))
    sched = lr_scheduler(opt, cfg.lr_scheduler_type, warmup_steps=warmup, total_steps=steps)
    t0 = time.perf_counter()
    recs = train_drafter(drafter, target, buffer, steps=steps, optimizer=opt, scheduler=sched,
                         feature_noise=cfg.feature_noise, reg_weight=cfg.reg_loss_weight, ce_weight=cfg.ce_loss_weight,
                         ce_vocab=buffer.vocab() if cfg.ce_vocab == "buffer" else None,
                         unroll_steps=cfg.unroll_steps, **batch)
    got: dict[str, Any] = {"steps": steps, "train_s": time.perf_counter() - t0,
                           "last_loss": recs[-1]["loss"] if recs else None}
    save_drafter(drafter, where)
    if held_out:
        got["eval"] = greedy_acceptance(drafter, target, held_out, cfg.num_speculative_tokens)
    return got


def train_command(config: str | None, args: Sequence[str]) -> tuple[type, Callable[..., dict[str, Any]]]:
    """The config class and train function `reclaim drafter train` runs for this config and these
    `--field value` arguments: by their drafter_type (eagle, the default, or eagle3)."""
    import yaml

    from reclaim.config import ConfigError, read_config_text

    try:
        kind = yaml.safe_load(read_config_text(config)[1]) if config is not None else None
    except yaml.YAMLError:
        kind = None  # load_config names the YAML error
    kind = kind.get("drafter_type", "eagle") if isinstance(kind, dict) else "eagle"
    for i, a in enumerate(args):  # the command line wins, as it does for every field
        if a.startswith("--drafter_type=") or a.startswith("--drafter-type="):
            kind = a.partition("=")[2]
        elif a in ("--drafter_type", "--drafter-type") and i + 1 < len(args):
            kind = args[i + 1]
    if kind not in DRAFTER_TYPES:
        raise ConfigError(f"drafter_type {kind!r} is not one of {list(DRAFTER_TYPES)}")
    return (Eagle3TrainConfig, train_eagle3) if kind == "eagle3" else (DrafterTrainConfig, train)
