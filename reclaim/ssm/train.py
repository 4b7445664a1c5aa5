"""`reclaim ssm-train`: train a state-space LM (Mamba-1, Mamba-2 or a Nemotron-H hybrid of Mamba-2,
attention and MLP layers) on a text corpus at a chosen context length.

One loop, four ways to get the gradient (`grad_mode`): plain backprop, backprop with per-layer
activation checkpointing, the exact chunked adjoint, and the truncated adjoint (window T-bar).
Checkpoints are HF-layout `checkpoint-{step}/` directories written atomically; `--resume` picks
the latest and continues with exactly the losses an uninterrupted run would have logged.

Under torchrun (WORLD_SIZE > 1; gloo on the CPU, nccl with cuda:LOCAL_RANK) `sharding` says how
the processes share the work:
- "none": data parallel. Rank r of W takes global batch (step * accum + micro) * W + r, gradients
  and losses are averaged, so a step equals one process accumulating W * accum batches. Any
  grad_mode.
- "fsdp": the same data parallel run fully sharded (`sharded.ShardedParams`): each rank keeps
  1/W of the parameters and of the AdamW state, gathers the full parameters for a step and
  reduce-scatters the gradients' mean onto its slice. Any grad_mode; checkpoints are the
  unsharded trainer's, so a run resumes at any world size, with or without sharding.
- "layer": pipeline over layer blocks (`parallel.layer_sharded_loss_backward`); every rank reads
  the same batch, holds only its block's parameters and its block's optimizer state, clips by the
  global norm. A checkpoint gathers the model to rank 0; optimizer states stay per rank
  (optimizer-rank{r}.pt), so resuming needs the same number of processes.
- "time": context parallel (`parallel.time_sharded_loss_backward`); every rank holds the model
  and reads the same batch, and owns a time segment of it. Every family: Mamba states pass from
  rank to rank, an attention layer's earlier keys and values too (and their gradients back).
"layer" and "time" need grad_mode adjoint or truncated and torchrun with >= 2 processes (a
single process gets an error rather than a silent fallback). Rank 0 alone writes log.jsonl,
train_config.json, the progress bar and the checkpoint directory; output_dir must be one
filesystem for all ranks (they resume from it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from reclaim.checkpoints import CHECKPOINT_PREFIX, checkpoints, run_dir, save_checkpoint, trim_log
from reclaim.schedule import SCHEDULES, lr_scheduler
from reclaim.ssm.adjoint import RECOMPUTE, adjoint_loss_backward, aligned_labels, chunk_bounds
from reclaim.trackers import RunLog, progress_bar, report_to_list

GRAD_MODES = ("backprop", "checkpoint", "adjoint", "truncated")
SHARDINGS = ("none", "fsdp", "layer", "time")
DATA_PARALLEL = ("none", "fsdp")  # every rank its own batches
ADJOINT_MODES = ("adjoint", "truncated")


@dataclass
class SSMTrainConfig:
    """Training run for an SSM LM; names follow transformers' TrainingArguments where they exist.

    Load one with `reclaim.config.load_config(SSMTrainConfig, path_or_name, overrides)`.
    """

    output_dir: str = "runs/ssm"
    # Model: a pretrained HF directory of any supported SSM (`load_ssm`), or random init (model=None)
    # of `architecture`: MambaForCausalLM of d_model, n_layer, d_state, expand; Mamba2ForCausalLM and
    # NemotronHForCausalLM of `model_config`, their HF config.json fields (vocab_size: the
    # tokenizer's). model_config fields also override Mamba-1's.
    model: str | None = None
    architecture: str = "MambaForCausalLM"
    model_config: dict[str, Any] | None = None
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
    # What the adjoint's backward holds a graph for: "chunk" (all layers of one chunk, fastest) or
    # "layer" (one layer of one chunk, ~1/n_layer of that memory, one more no-grad forward).
    # Layer and time sharding always hold one layer's graph.
    adjoint_recompute: str = "chunk"
    loss_chunk: int = 1024  # tokens per logits sub-chunk, so the vocabulary never spans the sequence
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    max_steps: int = 100
    warmup_steps: int = 0  # learning rate rises from 0 over these steps, as in transformers
    lr_scheduler_type: str = "linear"  # linear | cosine | constant | constant_with_warmup
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    seed: int = 42
    logging_steps: int = 1
    report_to: str | list[str] = "none"  # none | tensorboard | wandb | trackio, or a list (reclaim/trackers.py)
    save_steps: int = 0  # 0: save only at the end
    save_total_limit: int | None = None
    resume_from_checkpoint: bool = False
    device: str = "cpu"
    dtype: str = "float32"
    sharding: str = "none"  # under torchrun: none (data parallel) | fsdp | layer | time; see module doc

    def __post_init__(self) -> None:
        report_to_list(self.report_to)
        if self.grad_mode not in GRAD_MODES:
            raise ValueError(f"grad_mode {self.grad_mode!r} is not one of {list(GRAD_MODES)}")
        from reclaim.models.ssm import FAMILIES

        if self.architecture not in FAMILIES:
            raise ValueError(f"architecture {self.architecture!r} is not one of {list(FAMILIES)}")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding {self.sharding!r} is not one of {list(SHARDINGS)}")
        if self.sharding not in DATA_PARALLEL and self.grad_mode not in ADJOINT_MODES:
            raise ValueError(f"sharding {self.sharding!r} shards the adjoint: it needs grad_mode in "
                             f"{list(ADJOINT_MODES)}, got {self.grad_mode!r} (use sharding none or "
                             f"fsdp for data parallel {self.grad_mode})")
        if self.lr_scheduler_type not in SCHEDULES:
            raise ValueError(f"lr_scheduler_type {self.lr_scheduler_type!r} is not one of "
                             f"{list(SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.adjoint_recompute not in RECOMPUTE:
            raise ValueError(f"adjoint_recompute {self.adjoint_recompute!r} is not one of "
                             f"{list(RECOMPUTE)}")
        if self.grad_mode == "truncated" and not self.window:
            raise ValueError("grad_mode 'truncated' needs window (T-bar) >= 1; got "
                             f"{self.window!r}")
        for name in ("context_length", "chunk_size", "loss_chunk", "max_steps",
                     "per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


# ---- model, data, gradient ---------------------------------------------------------------------

def build_model(cfg: SSMTrainConfig, vocab_size: int) -> torch.nn.Module:
    """The LM: loaded from cfg.model, else randomly initialised (seeded) as cfg.architecture."""
    from reclaim.models.ssm import build_ssm, load_ssm

    if cfg.model is not None:
        return load_ssm(cfg.model)
    torch.manual_seed(cfg.seed)
    fields = {} if cfg.architecture != "MambaForCausalLM" else dict(
        hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer, state_size=cfg.d_state,
        expand=cfg.expand)
    return build_ssm(cfg.architecture, {**fields, **(cfg.model_config or {}), "vocab_size": vocab_size})


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
    """Accumulate the gradient of the mean next-token CE on input_ids the way cfg.grad_mode (and,
    in a process group, cfg.sharding) says."""
    if cfg.grad_mode in ("backprop", "checkpoint"):
        return autograd_loss_backward(model, input_ids, checkpoint_layers=cfg.grad_mode == "checkpoint",
                                      loss_chunk=cfg.loss_chunk)
    from reclaim.ssm import parallel

    window = cfg.window if cfg.grad_mode == "truncated" else None
    if cfg.sharding in DATA_PARALLEL:
        return adjoint_loss_backward(model, input_ids, chunk=cfg.chunk_size, window=window,
                                     loss_chunk=cfg.loss_chunk, recompute=cfg.adjoint_recompute)
    fn = {"layer": parallel.layer_sharded_loss_backward,
          "time": parallel.time_sharded_loss_backward}[cfg.sharding]
    return fn(model, input_ids, chunk=cfg.chunk_size, window=window, loss_chunk=cfg.loss_chunk)


# ---- checkpoints -------------------------------------------------------------------------------



def _load_weights(model: torch.nn.Module, path: Path) -> None:
    """Copy a checkpoint's tensors into model in place, in model's dtype (no float32 detour)."""
    from reclaim.models.loading import SafetensorsSource
    from reclaim.models.ssm import family_of

    src = SafetensorsSource(path)
    file_name = family_of(model).file_name
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied head is listed once, as the embedding
            try:
                saved = src[file_name(name)]
            except KeyError as e:
                raise ValueError(f"checkpoint {str(path)!r} has no tensor {name!r}") from e
            if saved.shape != p.shape:
                raise ValueError(f"checkpoint {str(path)!r} holds {name!r} of shape {list(saved.shape)}; this "
                                 f"config's model has {list(p.shape)} (resume with the config it was written with)")
            p.copy_(saved)


def _model_writer(model: Any, tokenizer: Any) -> Callable[[Path], None]:
    """How a checkpoint writes the model: its family's HF directory, with the tokenizer if there is one."""
    from reclaim.models.ssm import family_of

    def write(tmp: Path) -> None:
        family_of(model).write(model, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)

    return write


# ---- processes ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ranks:
    """This process's place in a torchrun launch (rank 0 of 1 without one)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> "Ranks":
        """Read torchrun's RANK, WORLD_SIZE and LOCAL_RANK."""
        env = os.environ
        return cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)),
                   int(env.get("LOCAL_RANK", 0)))


def _start(cfg: SSMTrainConfig, ranks: Ranks) -> tuple[torch.device, bool]:
    """This rank's device, and whether a process group was started here (to be destroyed here)."""
    if cfg.sharding != "none" and ranks.world < 2:
        raise ValueError(
            f"sharding {cfg.sharding!r} splits the model over torchrun processes, but WORLD_SIZE "
            f"is {ranks.world}; launch `torchrun --nproc_per_node=N -m reclaim.cli ssm-train ...` "
            "with N >= 2, or use sharding none")
    device = torch.device(cfg.device)
    if ranks.world == 1:
        return device, False
    import torch.distributed as dist

    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", ranks.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return device, False
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device, True


def _check_split(cfg: SSMTrainConfig, model: torch.nn.Module, world: int) -> None:
    """Fail before training if the layers or the chunks cannot be spread over the ranks."""
    from reclaim.ssm import parallel

    try:
        if cfg.sharding == "layer":
            parallel.layer_blocks(len(model.backbone.layers), world)
        elif cfg.sharding == "time":
            parallel.time_segments(len(chunk_bounds(cfg.context_length, cfg.chunk_size)), world)
    except ValueError as e:
        raise ValueError(f"sharding {cfg.sharding!r} on {world} processes: {e}") from e


def _optimizer_file(cfg: SSMTrainConfig, ranks: Ranks) -> str:
    return f"optimizer-rank{ranks.rank}.pt" if cfg.sharding == "layer" else "optimizer.pt"


def _resume_point(cfg: SSMTrainConfig, out: Path, ranks: Ranks) -> tuple[Path, dict[str, Any]]:
    """The latest checkpoint and its trainer state, checked against this launch's layout."""
    found = checkpoints(out)
    if not found:
        raise ValueError(f"resume_from_checkpoint is set but {str(out)!r} has no "
                         f"{CHECKPOINT_PREFIX}* directory")
    last = found[-1]
    state = json.loads((last / "trainer_state.json").read_text())
    was = (state.get("sharding", "none"), state.get("world_size", 1))
    name = _optimizer_file(cfg, ranks)
    if not (last / name).exists() or (cfg.sharding == "layer" and was != ("layer", ranks.world)):
        raise ValueError(f"{str(last)!r} was written with sharding {was[0]!r} on {was[1]} "
                         f"process(es) and lacks {name} for sharding {cfg.sharding!r} on "
                         f"{ranks.world}; resume with its sharding (layer: and process count)")
    return last, state


def _save(cfg: SSMTrainConfig, ranks: Ranks, out: Path, step: int, model, opt, sched,
          state: dict[str, Any], tokenizer: Any, shards: Any = None) -> None:
    """Rank 0 writes the checkpoint; by layer, every rank lends its block and its optimizer file;
    fully sharded, every rank lends its slices of the weights and of the optimizer state."""
    from reclaim.ssm import parallel

    if shards is not None:
        full = SimpleNamespace(state_dict=lambda: whole)  # what save_checkpoint reads of an optimizer
        whole = shards.full_optimizer_state(opt)
        with shards.gathered():
            if ranks.rank == 0:
                save_checkpoint(out, step, _model_writer(model, tokenizer), full, sched, state)
    elif cfg.sharding != "layer":
        if ranks.rank == 0:
            save_checkpoint(out, step, _model_writer(model, tokenizer), opt, sched, state)
    else:
        staged = {f"optimizer-rank{r}.pt": out / f".optimizer-rank{r}-step{step}.pt"
                  for r in range(1, ranks.world)}
        if ranks.rank > 0:
            torch.save(opt.state_dict(), staged[_optimizer_file(cfg, ranks)])
        with parallel.gathered_weights(model, ranks.rank, ranks.world) as full:
            if full:  # the gather also means every rank's optimizer file is written
                save_checkpoint(out, step, _model_writer(model, tokenizer), opt, sched, state,
                                optimizer_file=_optimizer_file(cfg, ranks), moved=staged)
    if ranks.world > 1:
        import torch.distributed as dist

        dist.barrier()  # the checkpoint exists for every rank once any goes on
    if ranks.rank == 0 and cfg.save_total_limit:
        for old in checkpoints(out)[:-cfg.save_total_limit]:
            shutil.rmtree(old, ignore_errors=True)


# ---- the loop ----------------------------------------------------------------------------------

def train(cfg: SSMTrainConfig, *, tokens: torch.Tensor | None = None,
          progress: bool = True) -> list[dict[str, Any]]:
    """Train per cfg; returns the log records of the steps run here (also in output_dir/log.jsonl).

    `tokens` (a 1-D token stream) replaces the corpus when given; its vocabulary must fit. Under
    torchrun every rank calls this (see the module docstring for `sharding`); rank 0 logs and
    returns the records, the others return [].
    """
    ranks = Ranks.from_env()
    device, started = _start(cfg, ranks)
    try:
        with run_dir(cfg.output_dir, main=ranks.rank == 0):
            return _train(cfg, tokens, progress, ranks, device)
    finally:
        if started:
            import torch.distributed as dist

            dist.destroy_process_group()


def _memory(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank holds between steps: its parameters and its optimizer state, in bytes."""
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0)
    return {"memory/params_bytes": sum(p.numel() * p.element_size() for p in params if p.numel()),
            "memory/optimizer_bytes": state}


def _train(cfg: SSMTrainConfig, tokens: torch.Tensor | None, progress: bool, ranks: Ranks,
           device: torch.device) -> list[dict[str, Any]]:
    from reclaim.data.corpus import corpus_files, tokenize_corpus, window_batch
    from reclaim.models.loading import DEFAULT_NAMES, default_model_dir
    from reclaim.models.tokenizer import load_tokenizer
    from reclaim.ssm import parallel

    out = Path(cfg.output_dir)
    lead = ranks.rank == 0
    tokenizer = None
    # A bad --model or corpus fails before the tokenizer loads (seconds of imports).
    model = build_model(cfg, 0) if cfg.model is not None else None
    if tokens is None:
        files = corpus_files(cfg.corpus)
        tokenizer = load_tokenizer(default_model_dir() if cfg.tokenizer in DEFAULT_NAMES else cfg.tokenizer)
        tokens = tokenize_corpus(files, tokenizer)
        vocab = len(tokenizer)
    else:
        vocab = int(tokens.max()) + 1
    model = (model if model is not None else build_model(cfg, vocab)).to(dtype=getattr(torch, cfg.dtype))
    if cfg.model is not None and model.config.vocab_size <= int(tokens.max()):
        raise ValueError(f"model vocab_size {model.config.vocab_size} does not cover token id "
                         f"{int(tokens.max())} of the corpus; use the model's own tokenizer")
    _check_split(cfg, model, ranks.world)
    step, history = 0, []
    log_path = out / "log.jsonl"
    if cfg.resume_from_checkpoint:
        last, state = _resume_point(cfg, out, ranks)
        _load_weights(model, last)  # whole, on the CPU: by layer a rank then keeps its block
        step, history = state["global_step"], state["log_history"]
        if lead:
            trim_log(log_path, step)
    elif lead and log_path.exists():
        log_path.unlink()  # a fresh run starts a fresh log
    layer = cfg.sharding == "layer"
    if layer:
        parallel.free_other_stages(model, ranks.rank, ranks.world)
    model.to(device)
    full_params = list(model.parameters())
    shards = None
    if cfg.sharding == "fsdp":
        from reclaim.ssm.sharded import ShardedParams

        shards = ShardedParams(full_params, ranks.rank, ranks.world)
    params = (parallel.stage_parameters(model, ranks.rank, ranks.world) if layer
              else shards.shards if shards is not None else full_params)
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                            weight_decay=cfg.weight_decay)
    sched = lr_scheduler(opt, cfg.lr_scheduler_type, warmup_steps=cfg.warmup_steps,
                         total_steps=cfg.max_steps)
    if cfg.resume_from_checkpoint:
        saved = torch.load(last / _optimizer_file(cfg, ranks), map_location=device)
        if shards is not None:
            shards.load_full_optimizer_state(opt, saved)
        else:
            opt.load_state_dict(saved)
        sched.load_state_dict(torch.load(last / "scheduler.pt"))
    config_dict = dataclasses.asdict(cfg)
    if lead:
        (out / "train_config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    # Data parallel: each rank its own batches; model parallel: all ranks the same batch.
    dp_rank, dp_world = (ranks.rank, ranks.world) if cfg.sharding in DATA_PARALLEL else (0, 1)
    records: list[dict[str, Any]] = []
    run_log = RunLog(cfg.report_to, out, config=config_dict, resume_step=step, main=lead)
    bar = progress_bar(cfg.max_steps, step, f"ssm-train {cfg.grad_mode}" + (
        f" {cfg.sharding} x{ranks.world}" if ranks.world > 1 else ""), show=progress and lead)
    t_start = time.perf_counter()
    tokens_seen = 0
    while step < cfg.max_steps:
        model.train()
        opt.zero_grad(set_to_none=True)
        if shards is not None:
            shards.gather()
        loss = 0.0
        for micro in range(cfg.gradient_accumulation_steps):
            index = (step * cfg.gradient_accumulation_steps + micro) * dp_world + dp_rank
            batch = window_batch(tokens, cfg.context_length, cfg.per_device_train_batch_size,
                                 cfg.seed, index).to(device)
            loss += loss_backward(model, batch, cfg) / cfg.gradient_accumulation_steps
            tokens_seen += batch.numel() * dp_world
        if cfg.gradient_accumulation_steps > 1:
            for p in full_params if shards is not None else params:
                if p.grad is not None:
                    p.grad /= cfg.gradient_accumulation_steps
        if shards is not None:
            loss = shards.reduce_gradients(loss)
        elif dp_world > 1:
            loss = parallel.average_gradients(params, loss)
        if layer or shards is not None:
            norm = parallel.clip_grad_norm_global(
                params, cfg.max_grad_norm,
                uncounted=parallel.counted_elsewhere(model, ranks.rank, ranks.world) if layer else ())
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")
        if step % cfg.logging_steps == 0 or step == cfg.max_steps:
            elapsed = time.perf_counter() - t_start
            rec = {"step": step, "loss": loss, "learning_rate": lr, "grad_norm": float(norm),
                   "tokens_per_s": tokens_seen / elapsed, **_memory(params, opt)}
            records.append(rec)
            history.append(rec)
            run_log.log(rec)
        if (cfg.save_steps and step % cfg.save_steps == 0) or step == cfg.max_steps:
            state = {"global_step": step, "max_steps": cfg.max_steps, "log_history": history,
                     "config": config_dict, "sharding": cfg.sharding, "world_size": ranks.world}
            _save(cfg, ranks, out, step, model, opt, sched, state, tokenizer, shards)
    bar.close()
    run_log.close()
    return records if lead else []


def demo_ssm(steps: int = 5, output_dir: str | None = None, log=print) -> list[dict[str, Any]]:
    """Train the bundled ssm-tiny config for a few steps with the exact adjoint; print the losses."""
    import tempfile

    from reclaim.config import load_config

    out = output_dir or tempfile.mkdtemp(prefix="reclaim-ssm-demo-")
    cfg = load_config(SSMTrainConfig, "ssm-tiny", {"max_steps": steps, "grad_mode": "adjoint",
                                                   "output_dir": out, "save_steps": 0})
    log(f"ssm demo: Mamba d_model={cfg.d_model} x {cfg.n_layer} layers, context {cfg.context_length}, "
        f"exact adjoint with chunk {cfg.chunk_size}, corpus {cfg.corpus}")
    records = train(cfg, progress=False)
    for r in records:
        log(f"  step {r['step']:3d}  loss {r['loss']:.4f}  ({r['tokens_per_s']:.0f} tokens/s)")
    return records
