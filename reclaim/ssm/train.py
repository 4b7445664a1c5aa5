"""`reclaim ssm-train`: train a Mamba LM on a text corpus at a chosen context length.

One loop, four ways to get the gradient (`grad_mode`): plain backprop, backprop with per-layer
activation checkpointing, the exact chunked adjoint, and the truncated adjoint (window T-bar).
Checkpoints are HF-layout `checkpoint-{step}/` directories written atomically; `--resume` picks
the latest and continues with exactly the losses an uninterrupted run would have logged.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

GRAD_MODES = ("backprop", "checkpoint", "adjoint", "truncated")


@dataclass
class SSMTrainConfig:
    """Training run for a Mamba LM; names follow transformers' TrainingArguments where they exist."""

    output_dir: str = "runs/ssm"
    # Model: a pretrained HF Mamba directory, or random init of this size (model=None).
    model: str | None = None
    d_model: int = 256
    n_layer: int = 4
    d_state: int = 16
    expand: int = 2
    tokenizer: str | None = None  # HF dir holding the tokenizer; None = the default model's
    corpus: str = "stdlib"  # "stdlib", a text file, or a directory of text files
    context_length: int = 4096
    grad_mode: str = "adjoint"
    chunk_size: int = 1024  # Q: tokens per recomputed chunk (adjoint, truncated)
    window: int | None = None  # T-bar: adjoint window (truncated); None = exact
    loss_chunk: int = 1024  # tokens per logits sub-chunk, so the vocabulary never spans the sequence
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    max_steps: int = 100
    warmup_steps: int = 0
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    seed: int = 42
    logging_steps: int = 1
    save_steps: int = 0  # 0: save only at the end
    save_total_limit: int | None = None
    resume_from_checkpoint: bool = False
    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.grad_mode not in GRAD_MODES:
            raise ValueError(f"grad_mode {self.grad_mode!r} is not one of {list(GRAD_MODES)}")
        if self.grad_mode == "truncated" and not self.window:
            raise ValueError("grad_mode 'truncated' needs window (T-bar) >= 1; got "
                             f"{self.window!r}")
        for name in ("context_length", "chunk_size", "loss_chunk", "max_steps",
                     "per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


# ---- config files ------------------------------------------------------------------------------

def _coerce(value: Any, hint: str, name: str) -> Any:
    """Turn a YAML or command-line value into the field's declared type (int, float, bool, str)."""
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
        if "None" not in hint:
            raise ValueError(f"{name} cannot be None; it takes {hint}")
        return None
    base = hint.replace(" | None", "").strip()
    if base == "bool":
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "1", "yes"):
            return True
        if str(value).lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"{name} takes true/false, got {value!r}")
    kinds = {"int": int, "float": float, "str": str}
    try:
        return kinds[base](float(value) if base == "int" and isinstance(value, str) and "e" in value
                           else value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} takes {base}, got {value!r}") from e


def load_config(path: str | os.PathLike | None, overrides: dict[str, Any] | None = None
                ) -> SSMTrainConfig:
    """Config from a YAML file (or defaults when path is None) with field overrides applied."""
    import yaml

    raw: dict[str, Any] = {}
    if path is not None:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"config file {str(path)!r} must hold a mapping of field: value")
    raw.update(overrides or {})
    hints = {f.name: str(f.type) for f in dataclasses.fields(SSMTrainConfig)}
    unknown = sorted(set(raw) - set(hints))
    if unknown:
        raise ValueError(f"unknown config fields {unknown}; allowed: {sorted(hints)}")
    return SSMTrainConfig(**{k: _coerce(v, hints[k], k) for k, v in raw.items()})


def parse_overrides(args: list[str]) -> dict[str, str]:
    """`--field value` / `--field=value` pairs from the command line (dashes become underscores)."""
    out, i = {}, 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ValueError(f"expected --field value, got {arg!r}")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ValueError(f"{arg} needs a value")
            value, i = args[i + 1], i + 1
        out[key.replace("-", "_")] = value
        i += 1
    return out


# ---- model, data, gradient ---------------------------------------------------------------------

def build_model(cfg: SSMTrainConfig, vocab_size: int) -> torch.nn.Module:
    """A Mamba LM: loaded from cfg.model, else randomly initialised (seeded) at the config's size."""
    from reclaim.models import mamba

    if cfg.model is not None:
        return mamba.load_mamba(cfg.model)
    torch.manual_seed(cfg.seed)
    config = mamba.MambaConfig(vocab_size=vocab_size, hidden_size=cfg.d_model,
                               num_hidden_layers=cfg.n_layer, state_size=cfg.d_state,
                               expand=cfg.expand)
    return mamba.MambaForCausalLM(config)


def load_tokenizer(name: str | None) -> Any:
    """The tokenizer of an HF directory; None is the default model's (SmolLM2)."""
    if name is None:
        from reclaim.models.loading import load_tokenizer as default

        return default(None)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, local_files_only=True)


def _head_ce(model: torch.nn.Module, r: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model.logits(model.backbone.norm_f(r))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                             ignore_index=-100, reduction="sum")


def autograd_loss_backward(model: torch.nn.Module, input_ids: torch.Tensor, *,
                           checkpoint_layers: bool, loss_chunk: int) -> float:
    """Plain backprop of the mean next-token CE (optionally checkpointing each layer).

    The loss head runs in checkpointed sub-chunks, as in the adjoint, so no mode materialises
    logits for the whole sequence and the modes differ only in how the layer stack is trained.
    """
    from torch.utils.checkpoint import checkpoint

    from reclaim.ssm.adjoint import aligned_labels, chunk_bounds

    labels = aligned_labels(input_ids, None)
    n_tokens = int((labels != -100).sum())
    r = model.backbone.embeddings(input_ids)
    for layer, state in zip(model.backbone.layers, model.zero_states(input_ids.shape[0])):
        if checkpoint_layers:
            r = checkpoint(layer.forward_chunk, r, *state, use_reentrant=False)[0]
        else:
            r = layer.forward_chunk(r, *state)[0]
    total = sum(checkpoint(_head_ce, model, r[:, s:e], labels[:, s:e], use_reentrant=False)
                for s, e in chunk_bounds(r.shape[1], loss_chunk))
    (total / n_tokens).backward()
    return total.item() / n_tokens


def loss_backward(model: torch.nn.Module, input_ids: torch.Tensor, cfg: SSMTrainConfig) -> float:
    """Accumulate the gradient of the mean next-token CE on input_ids the way cfg.grad_mode says."""
    if cfg.grad_mode in ("backprop", "checkpoint"):
        return autograd_loss_backward(model, input_ids, checkpoint_layers=cfg.grad_mode == "checkpoint",
                                      loss_chunk=cfg.loss_chunk)
    from reclaim.ssm.adjoint import adjoint_loss_backward

    window = cfg.window if cfg.grad_mode == "truncated" else None
    return adjoint_loss_backward(model, input_ids, chunk=cfg.chunk_size, window=window,
                                 loss_chunk=cfg.loss_chunk)


# ---- checkpoints -------------------------------------------------------------------------------

CHECKPOINT_PREFIX = "checkpoint-"


def _load_weights(model: torch.nn.Module, path: Path) -> None:
    from reclaim.models import mamba

    model.load_state_dict(mamba.load_mamba(path).state_dict())


def checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The run's complete checkpoint-{step} directories, oldest first."""
    root = Path(output_dir)
    found = [p for p in root.glob(f"{CHECKPOINT_PREFIX}*")
             if p.is_dir() and p.name[len(CHECKPOINT_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def save_checkpoint(output_dir: Path, step: int, model, optimizer, scheduler,
                    state: dict[str, Any], tokenizer: Any = None) -> Path:
    """Write checkpoint-{step}/ (HF model dir + optimizer + scheduler + trainer_state.json) atomically."""
    from reclaim.models.loading import atomic_dir
    from reclaim.models.mamba import write_mamba

    def write(tmp: Path) -> None:
        write_mamba(model, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")

    return atomic_dir(output_dir / f"{CHECKPOINT_PREFIX}{step}", write)


def _lr_lambda(cfg: SSMTrainConfig):
    def factor(step: int) -> float:  # linear warmup, then linear decay to 0 (HF's "linear")
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        return max(0.0, (cfg.max_steps - step) / max(1, cfg.max_steps - cfg.warmup_steps))
    return factor


def _trim_log(path: Path, step: int) -> None:
    """Drop log lines past `step` (written after the checkpoint we resume from)."""
    if path.exists():
        keep = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
        path.write_text("".join(ln + "\n" for ln in keep))


# ---- the loop ----------------------------------------------------------------------------------

def train(cfg: SSMTrainConfig, *, tokens: torch.Tensor | None = None,
          progress: bool = True) -> list[dict[str, Any]]:
    """Train per cfg; returns the log records of the steps run here (also in output_dir/log.jsonl).

    `tokens` (a 1-D token stream) replaces the corpus when given; its vocabulary must fit.
    """
    from tqdm import tqdm

    from reclaim.data.corpus import tokenize_corpus, window_batch

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = None
    if tokens is None:
        tokenizer = load_tokenizer(cfg.tokenizer)
        tokens = tokenize_corpus(cfg.corpus, tokenizer)
        vocab = len(tokenizer)
    else:
        vocab = int(tokens.max()) + 1
    device = torch.device(cfg.device)
    model = build_model(cfg, vocab).to(device=device, dtype=getattr(torch, cfg.dtype))
    if cfg.model is not None and model.config.vocab_size <= int(tokens.max()):
        raise ValueError(f"model vocab_size {model.config.vocab_size} does not cover token id "
                         f"{int(tokens.max())} of the corpus; use the model's own tokenizer")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate,
                            betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg))
    step, history = 0, []
    log_path = out / "log.jsonl"
    if cfg.resume_from_checkpoint:
        found = checkpoints(out)
        if not found:
            raise ValueError(f"resume_from_checkpoint is set but {str(out)!r} has no "
                             f"{CHECKPOINT_PREFIX}* directory")
        last = found[-1]
        _load_weights(model, last)
        opt.load_state_dict(torch.load(last / "optimizer.pt", map_location=device))
        sched.load_state_dict(torch.load(last / "scheduler.pt"))
        state = json.loads((last / "trainer_state.json").read_text())
        step, history = state["global_step"], state["log_history"]
        _trim_log(log_path, step)
    elif log_path.exists():
        log_path.unlink()  # a fresh run starts a fresh log
    config_dict = dataclasses.asdict(cfg)
    (out / "train_config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    records: list[dict[str, Any]] = []
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not progress, desc=f"ssm-train {cfg.grad_mode}")
    t_start = time.perf_counter()
    tokens_seen = 0
    while step < cfg.max_steps:
        model.train()
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for micro in range(cfg.gradient_accumulation_steps):
            index = step * cfg.gradient_accumulation_steps + micro
            batch = window_batch(tokens, cfg.context_length, cfg.per_device_train_batch_size,
                                 cfg.seed, index).to(device)
            loss += loss_backward(model, batch, cfg) / cfg.gradient_accumulation_steps
            tokens_seen += batch.numel()
        if cfg.gradient_accumulation_steps > 1:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad /= cfg.gradient_accumulation_steps
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")
        if step % cfg.logging_steps == 0 or step == cfg.max_steps:
            elapsed = time.perf_counter() - t_start
            rec = {"step": step, "loss": loss, "learning_rate": lr, "grad_norm": float(norm),
                   "tokens_per_s": tokens_seen / elapsed}
            records.append(rec)
            history.append(rec)
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        if (cfg.save_steps and step % cfg.save_steps == 0) or step == cfg.max_steps:
            state = {"global_step": step, "max_steps": cfg.max_steps, "log_history": history,
                     "config": config_dict}
            save_checkpoint(out, step, model, opt, sched, state, tokenizer)
            if cfg.save_total_limit:
                for old in checkpoints(out)[:-cfg.save_total_limit]:
                    shutil.rmtree(old, ignore_errors=True)
    bar.close()
    return records


def demo_ssm(steps: int = 5, output_dir: str | None = None, log=print) -> list[dict[str, Any]]:
    """Train configs/ssm-tiny.yaml for a few steps with the exact adjoint and print the losses."""
    import tempfile

    path = Path(__file__).resolve().parents[2] / "configs" / "ssm-tiny.yaml"
    out = output_dir or tempfile.mkdtemp(prefix="reclaim-ssm-demo-")
    cfg = load_config(path, {"max_steps": steps, "grad_mode": "adjoint", "output_dir": out,
                             "save_steps": 0})
    log(f"ssm demo: Mamba d_model={cfg.d_model} x {cfg.n_layer} layers, context {cfg.context_length}, "
        f"exact adjoint with chunk {cfg.chunk_size}, corpus {cfg.corpus}")
    records = train(cfg, progress=False)
    for r in records:
        log(f"  step {r['step']:3d}  loss {r['loss']:.4f}  ({r['tokens_per_s']:.0f} tokens/s)")
    return records
