"""The `reclaim` command. Each command imports its engine lazily so `reclaim --help` stays fast."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from reclaim.bench.cli import bench_app
from reclaim.cli_options import (DEVICE_OPT, DTYPE_OPT, DTYPES, GPU_UTIL_OPT, KV_MEMORY_OPT, MAX_LEN_OPT, _cuda,
                                 _engine_config, _fail, _file_fields, _fit, OneLineErrors, bundled,
                                 engine_options)

app = typer.Typer(help="reclaim: post-training engine that turns wasted compute into training.",
                  no_args_is_help=True, add_completion=False, cls=OneLineErrors)
app.add_typer(bench_app, name="bench")


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show the traceback of an error that is "
                                     "otherwise one line (a missing model directory or file).")) -> None:
    """reclaim: post-training engine that turns wasted compute into training."""

# ---- inference: generate, chat, demo (owner: engine) ----

MODEL_ARG = typer.Option(None, "--model", "-m", help="HF model directory; omitted: the bundled SmolLM2-135M-Instruct.")
SPEC_OPT = typer.Option(None, "--speculative", help="Speculative decoding: none, ngram (prompt lookup), "
                        "suffix (history: the prompt, other completions of it and recent outputs; no model), "
                        "eagle:PATH (an EAGLE-1/2 drafter directory), eagle (the default model's drafter, "
                        "trained and cached on first use), eagle3:PATH (an EAGLE-3 drafter directory), "
                        "hybrid:PATH or hybrid (suffix and eagle drafts merged into one verify tree). "
                        "Lossless: same outputs as plain decoding.")
SPEC_TOKENS_OPT = typer.Option(None, "--num-speculative-tokens", help="Draft depth per step (default 4; suffix "
                               "and hybrid 16).")
SUFFIX_CACHE_OPT = typer.Option(None, "--suffix-cache-tokens", help="suffix, hybrid: tokens of finished "
                                "sequences kept as history (default 262144; least recently used out).")
SUFFIX_HISTORY_OPT = typer.Option(None, "--suffix-history", help="suffix, hybrid: a JSON-lines file of earlier "
                                  "outputs the history starts with, a {\"token_ids\": [...]} or {\"text\": ...} "
                                  "per line (`reclaim serve` writes one with --save-suffix-history).")
SPEC_BATCH_OPT = typer.Option(None, "--spec-max-batch", help="Speculation turns off above this many running "
                              "sequences (default 4).")
SPEC_TOPK_OPT = typer.Option(None, "--eagle-topk", help="eagle: branches per draft node; > 1 drafts a tree.")
SPEC_TREE_OPT = typer.Option(None, "--num-draft-tokens", help="eagle tree: tokens verified per step.")
SPEC_FIXED_OPT = typer.Option(False, "--spec-fixed-depth", help="Draft the full depth every step. Default: each "
                              "request's depth follows its own acceptance (one the drafter keeps missing "
                              "decodes plainly, probed now and then).")


def _speculative(spec: str | None, model: str | None, **fields: int | str | None):
    """The SpeculativeConfig for --speculative and its flags; 'eagle' alone is the default drafter."""
    from reclaim.engine.speculative import parse_speculative

    if spec in ("eagle", "hybrid", "suffix+eagle"):
        if model not in (None, "default"):
            raise typer.BadParameter(f"--speculative {spec} (no path) is the default model's drafter; "
                                     f"for another model give {spec}:PATH")
        from reclaim.drafter.bundled import default_drafter_dir

        spec = f"{spec}:{default_drafter_dir()}"
    if fields.get("suffix_cache_tokens") is not None and (spec or "none").partition(":")[0] not in \
            ("suffix", "hybrid", "suffix+eagle"):
        raise typer.BadParameter(f"--suffix-cache-tokens is for --speculative suffix or hybrid, not {spec!r}")
    try:
        return parse_speculative(spec, num_speculative_tokens=fields.get("num_speculative_tokens"),
                                 max_batch=fields.get("max_batch"), eagle_topk=fields.get("eagle_topk"),
                                 num_draft_tokens=fields.get("num_draft_tokens"),
                                 suffix_cache_tokens=fields.get("suffix_cache_tokens"),
                                 suffix_history=fields.get("suffix_history"),
                                 dynamic_depth=False if fields.get("fixed_depth") else None)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e


def _learn_config(learn: bool, config: str | None, **flags: str | None):
    """The OnlineTrainConfig for `serve --learn` (config file or bundled name, flags on top)."""
    if not learn:
        given = [k for k, v in flags.items() if v is not None] + (["config"] if config else [])
        if given:
            raise typer.BadParameter(f"--{given[0].replace('_', '-')} only applies with --learn")
        return None
    from importlib.resources import files

    from reclaim.config import load_config
    from reclaim.online.trainer import OnlineTrainConfig

    if config is None and files("reclaim.configs").joinpath("online-smollm2.yaml").is_file():
        config = "online-smollm2"
    try:
        cfg = load_config(OnlineTrainConfig, config, {k: v for k, v in flags.items() if v is not None})
        if cfg.probe_path is not None:  # refused now, with its line number, not after loading the model
            from reclaim.online.probe import load_probes

            load_probes(cfg.probe_path)
        return cfg
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e


def _sampling(max_tokens: int, temperature: float, top_p: float, seed: int | None):
    from reclaim.engine.request import SamplingParams

    try:
        return SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_tokens=max_tokens)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e


def _engine(model: str | None, dtype: str = "auto", kv_cache_memory: float | None = None,
            speculative=None, *, device: str | None = None, max_model_len: int | None = None,
            gpu_memory_utilization: float | None = None):
    from reclaim.engine.engine import Engine
    from reclaim.models.loading import load_model

    # One conversation at a time: a small cache starts fast.
    path, max_len, kv_bytes, dev, dtype = _fit(
        model, dtype, kv_cache_memory, max_num_seqs=1, device=device, gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=lambda cfg: max_model_len or min(4096, cfg.max_position_embeddings))
    m, tok = load_model(path, dtype=dtype, device=dev)
    try:
        return Engine(m, tok, max_num_seqs=1, max_model_len=max_len, kv_cache_bytes=kv_bytes, speculative=speculative,
                      device=dev)
    except (ValueError, FileNotFoundError) as e:  # a drafter that does not fit, or is not there
        typer.echo(f"Error: {e}", err=True)
        raise typer.Exit(1) from e


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt (a user message, unless --raw)."),
    model: str = MODEL_ARG,
    dtype: str = DTYPE_OPT,
    device: str = DEVICE_OPT,
    max_model_len: int = MAX_LEN_OPT,
    kv_cache_memory: float = KV_MEMORY_OPT,
    gpu_memory_utilization: float = GPU_UTIL_OPT,
    max_tokens: int = typer.Option(256, help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass (1 = off)."),
    seed: int = typer.Option(None, help="Seed for reproducible sampling."),
    raw: bool = typer.Option(False, "--raw", help="Feed the prompt as is, without the chat template."),
    speculative: str = SPEC_OPT,
    num_speculative_tokens: int = SPEC_TOKENS_OPT,
    eagle_topk: int = SPEC_TOPK_OPT,
    num_draft_tokens: int = SPEC_TREE_OPT,
    spec_fixed_depth: bool = SPEC_FIXED_OPT,
    suffix_cache_tokens: int = SUFFIX_CACHE_OPT,
    suffix_history: str = SUFFIX_HISTORY_OPT,
) -> None:
    """Generate a reply to PROMPT, streamed to stdout."""
    import sys

    from reclaim.engine.quickstart import stream
    from reclaim.models.tokenizer import encode_chat

    params = _sampling(max_tokens, temperature, top_p, seed)
    spec = _speculative(speculative, model, num_speculative_tokens=num_speculative_tokens, eagle_topk=eagle_topk,
                        num_draft_tokens=num_draft_tokens, fixed_depth=spec_fixed_depth,
                        suffix_cache_tokens=suffix_cache_tokens, suffix_history=suffix_history)
    engine = _engine(model, dtype, kv_cache_memory, spec, device=device, max_model_len=max_model_len,
                     gpu_memory_utilization=gpu_memory_utilization)
    ids = engine.tokenizer.encode(prompt) if raw else encode_chat(engine.tokenizer, [{"role": "user", "content": prompt}])
    stream(engine, ids, params, sys.stdout)


@app.command()
def chat(
    model: str = MODEL_ARG,
    dtype: str = DTYPE_OPT,
    device: str = DEVICE_OPT,
    max_model_len: int = MAX_LEN_OPT,
    kv_cache_memory: float = KV_MEMORY_OPT,
    gpu_memory_utilization: float = GPU_UTIL_OPT,
    max_tokens: int = typer.Option(512, help="Most tokens per reply."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass (1 = off)."),
    seed: int = typer.Option(None, help="Seed for reproducible sampling."),
    speculative: str = SPEC_OPT,
    num_speculative_tokens: int = SPEC_TOKENS_OPT,
    eagle_topk: int = SPEC_TOPK_OPT,
    num_draft_tokens: int = SPEC_TREE_OPT,
    spec_fixed_depth: bool = SPEC_FIXED_OPT,
    suffix_cache_tokens: int = SUFFIX_CACHE_OPT,
    suffix_history: str = SUFFIX_HISTORY_OPT,
) -> None:
    """Chat on stdin: one message per line, replies streamed, history kept ('/reset' clears it)."""
    import sys

    from reclaim.engine.quickstart import chat_loop

    params = _sampling(max_tokens, temperature, top_p, seed)
    spec = _speculative(speculative, model, num_speculative_tokens=num_speculative_tokens, eagle_topk=eagle_topk,
                        num_draft_tokens=num_draft_tokens, fixed_depth=spec_fixed_depth,
                        suffix_cache_tokens=suffix_cache_tokens, suffix_history=suffix_history)
    engine = _engine(model, dtype, kv_cache_memory, spec, device=device, max_model_len=max_model_len,
                     gpu_memory_utilization=gpu_memory_utilization)
    chat_loop(engine, params, sys.stdin, sys.stdout, interactive=sys.stdin.isatty())


@app.command()
def demo(
    max_tokens: int = typer.Option(64, help="Most tokens per answer."),
    ssm_steps: int = typer.Option(5, help="Adjoint training steps of the SSM part (0 skips it)."),
    online_rounds: int = typer.Option(4, help="Feedback rounds of the online-learning part (0 skips it)."),
    grpo_steps: int = typer.Option(1, help="GRPO steps of the RL part (0 skips it)."),
    speculative: str = typer.Option("suffix", "--speculative", help="The speculative part: suffix (history: "
                                    "nothing to train), eagle (trains and caches the default drafter on first use, "
                                    "about 2-6 min), hybrid, ngram, eagle:PATH, eagle3:PATH, hybrid:PATH or "
                                    "none (skips it)."),
    speculative_tokens: int = typer.Option(96, min=1, help="Most tokens per answer of the speculative part."),
    device: str = DEVICE_OPT,
    dtype: str = DTYPE_OPT,
    max_model_len: int = typer.Option(None, "--max-model-len", help="Context length of the inference parts "
                                      "(default 1024 for the batch, 2048 for the speculative chat)."),
) -> None:
    """The main job on the default model: batched generation, speculative decoding next to plain,
    learning from feedback while serving, a GRPO step with adaptive speculative rollouts, then a
    few exact-adjoint SSM steps."""
    from reclaim import devices
    from reclaim.engine.quickstart import demo as run_demo
    from reclaim.engine.quickstart import speculative_demo
    from reclaim.models.loading import load_model, read_config, resolve_model_dir

    if dtype not in DTYPES:
        _fail(f"--dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    try:
        dev = devices.resolve_device(device)
    except ValueError as e:
        _fail(str(e))
    model, tok = load_model(None, device=dev,
                            dtype=devices.resolve_dtype(dtype, dev, read_config(resolve_model_dir(None)).torch_dtype))
    typer.echo("== inference engine: a batch of chat prompts on the default model ==")
    run_demo(model, tok, max_tokens=max_tokens, max_model_len=max_model_len)
    if speculative == "auto":  # the old default's name
        speculative = "suffix"
    if speculative != "none":
        typer.echo("\n== speculative decoding: a two-turn chat plain and speculative (lossless) ==")
        speculative_demo(model, tok, _speculative(speculative, None), max_tokens=speculative_tokens,
                         max_model_len=max_model_len)
    if online_rounds > 0:
        from reclaim.online.demo import demo_online

        typer.echo("\n== online learning while serving: feedback trains the model, reusing the prefill ==")
        demo_online(model, tok, rounds=online_rounds)
    if grpo_steps > 0:
        from reclaim.rl.demo import demo_grpo

        typer.echo("\n== GRPO with adaptive speculative rollouts (TLT) ==")
        demo_grpo(model, tok, steps=grpo_steps)
    if ssm_steps > 0:
        from reclaim.ssm.train import demo_ssm

        typer.echo("\n== long-context SSM training: exact adjoint on the stdlib corpus ==")
        demo_ssm(steps=ssm_steps)


# ---- server: serve (owner: server) ----

@app.command()
@engine_options
def serve(
    model: str = typer.Argument(None, help="HF model directory (or give it as --model); omitted: the "
                                "bundled SmolLM2-135M-Instruct."),
    model_opt: str = MODEL_ARG,
    host: str = typer.Option("127.0.0.1", help="Address to listen on (loopback by default)."),
    port: int = typer.Option(8000, help="TCP port."),
    api_key: str = typer.Option(None, "--api-key", envvar="RECLAIM_API_KEY",
                                help="Require 'Authorization: Bearer KEY' on every route but /health. "
                                     "Prefer the RECLAIM_API_KEY variable: an option shows in `ps`."),
    served_model_name: str = typer.Option(None, help="Model name clients send (default: MODEL)."),
    shutdown_timeout: float = typer.Option(30.0, help="Seconds in-flight requests get after SIGTERM; "
                                           "then streams end with finish_reason 'abort'."),
    limit_concurrency: int = typer.Option(1024, help="Most open connections; more get 503 + Retry-After."),
    header_timeout: float = typer.Option(10.0, help="Seconds a client has to send a request's headers."),
    body_timeout: float = typer.Option(30.0, help="Seconds a client has to send a request's body."),
    timeout_keep_alive: float = typer.Option(5.0, help="Idle seconds before a keep-alive connection closes."),
    allowed_origins: list[str] = typer.Option(None, "--allowed-origins",
                                              help="Web origins allowed to call the API from a browser "
                                                   "(CORS), comma-separated or repeated; none by default."),
    split_special_tokens: bool = typer.Option(False, "--split-special-tokens",
                                              help="Encode special-token text in chat messages (e.g. "
                                                   "'<|im_start|>') as plain text; off by default, as vLLM."),
    enable_force_include_usage: bool = typer.Option(False, "--enable-force-include-usage",
                                                    help="Usage in every stream's last chunk, asked for "
                                                         "(stream_options.include_usage) or not."),
    disable_access_log: bool = typer.Option(False, "--disable-access-log", "--no-access-log",
                                            help="No access log (one line per request: client, method, "
                                                 "path, status, milliseconds, response id)."),
    speculative: str = SPEC_OPT,
    num_speculative_tokens: int = SPEC_TOKENS_OPT,
    spec_max_batch: int = SPEC_BATCH_OPT,
    eagle_topk: int = SPEC_TOPK_OPT,
    num_draft_tokens: int = SPEC_TREE_OPT,
    spec_fixed_depth: bool = SPEC_FIXED_OPT,
    suffix_cache_tokens: int = SUFFIX_CACHE_OPT,
    suffix_history: str = SUFFIX_HISTORY_OPT,
    save_suffix_history: str = typer.Option(None, "--save-suffix-history", help="suffix, hybrid: at shutdown, "
                                            "write the history's recent outputs to this file (for --suffix-history)."),
    learn: bool = typer.Option(False, "--learn", help="Learn from feedback while serving (POST /v1/feedback): "
                               "prompts recorded at prefill, trained between engine steps."),
    learn_config: str = typer.Option(None, "--config", help="With --learn: YAML file of OnlineTrainConfig "
                                     f"fields, or a bundled config: {bundled('online-')}; default online-smollm2."),
    record: str = typer.Option(None, "--record", help="With --learn: all | requested (body key "
                               "retain_for_training) | fraction:F."),
    record_budget: str = typer.Option(None, "--record-budget", help="With --learn: bytes of records kept."),
    record_host_budget: str = typer.Option(None, "--record-host-budget", help="With --learn: bytes offloaded to host."),
    max_ttft_slowdown: float = typer.Option(0.1, "--max-ttft-slowdown", help="With --learn: the latency training may "
                                            "add to serving, as a share (idle time is free)."),
    probe_path: str = typer.Option(None, "--probe-path", help="With --learn: held-out JSON lines ({\"prompt\", "
                                   "\"answer\"} or {\"text\"}); an update that raises their loss is undone."),
    max_probe_regression: float = typer.Option(None, "--max-probe-regression", help="With --learn and a probe set: "
                                             "nats per token an update may raise the probe loss (default 0.05)."),
    admin_key: str = typer.Option(None, "--admin-key", envvar="RECLAIM_ADMIN_KEY",
                                  help="A key that may roll weights back (POST /v1/weights/rollback) and give "
                                       "feedback on any response; it passes the gate too. Prefer RECLAIM_ADMIN_KEY."),
    feedback_rate_limit: float = typer.Option(None, "--feedback-rate-limit", help="With --learn: feedback a minute "
                                              "per API key (per client address without keys); 0: no limit "
                                              "(default 120)."),
    rollback_to: int = typer.Option(None, "--rollback-to", help="With --learn: at start-up, restore this weights "
                                    "version (a checkpoint's, or 0: the model as given) and reject the feedback "
                                    "trained after it."),
    log_level: str = typer.Option("info", help="Log level: debug, info, warning, error."),
    engine_config: str = typer.Option(None, "--engine-config", help="YAML file of EngineConfig fields "
                                      "(max_num_seqs, ...); the engine options below override it."),
    engine_fields: dict | None = None,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (chat, completions, models, metrics)."""
    from reclaim.engine.kv_cache import GIB
    from reclaim.models.loading import UnsupportedModelError
    from reclaim.server.connections import ConnectionLimits
    from reclaim.server.serve import serve as run_server

    if model is not None and model_opt is not None and model != model_opt:
        raise typer.BadParameter(f"the model is given twice, as {model!r} and --model {model_opt!r}; "
                                 "give it once")
    model = model or model_opt
    spec = _speculative(speculative, model, num_speculative_tokens=num_speculative_tokens, max_batch=spec_max_batch,
                        eagle_topk=eagle_topk, num_draft_tokens=num_draft_tokens, fixed_depth=spec_fixed_depth,
                        suffix_cache_tokens=suffix_cache_tokens, suffix_history=suffix_history)
    if save_suffix_history is not None and (spec is None or not spec.history):
        raise typer.BadParameter(f"--save-suffix-history is for --speculative suffix or hybrid, not {speculative!r}")
    if save_suffix_history is not None and not Path(save_suffix_history).expanduser().parent.is_dir():
        raise typer.BadParameter(f"--save-suffix-history {save_suffix_history!r}: its directory does not exist")
    learn_cfg = _learn_config(learn, learn_config, record=record, record_budget=record_budget,
                              record_host_budget=record_host_budget, probe_path=probe_path,
                              max_probe_regression=max_probe_regression)
    for flag, value in (("--rollback-to", rollback_to), ("--feedback-rate-limit", feedback_rate_limit)):
        if value is not None and not learn:
            raise typer.BadParameter(f"{flag} only applies with --learn")
    if rollback_to is not None and rollback_to < 0:
        raise typer.BadParameter(f"--rollback-to {rollback_to}: a weights version is >= 0")
    if feedback_rate_limit is not None and feedback_rate_limit < 0:
        raise typer.BadParameter(f"--feedback-rate-limit {feedback_rate_limit}: allowed: >= 0 (0: no limit)")
    try:
        args = _engine_config(engine_config, engine_fields).replace(speculative=spec)
        if args.tensor_parallel_size > 1:  # before any weights load: the split, torchrun, what TP cannot run
            from reclaim.engine.tensor_parallel import check_launch
            from reclaim.models.loading import read_config, resolve_model_dir

            check_launch(args.tensor_parallel_size, read_config(resolve_model_dir(model)), sys.argv[1:])
            if learn:
                raise ValueError("--learn needs the whole model on one rank; allowed with "
                                 "--tensor-parallel-size above 1: serving without it")
        # the budget given (a flag or the file), refused beside --num-blocks, which sets it; on CUDA
        # without one, --gpu-memory-utilization's share sizes it
        given = "kv_cache_bytes" in engine_fields or (engine_config is not None and "kv_cache_bytes" in
                                                      _file_fields(engine_config))
        kv_gib = args.kv_cache_bytes / GIB if given or (args.num_blocks is None and not _cuda(args.device)) else None
        _, _, kv_bytes, dev, dtype = _fit(model, args.dtype, kv_gib, max_num_seqs=args.max_num_seqs, device=args.device,
                                          block_size=args.block_size, num_blocks=args.num_blocks,
                                          gpu_memory_utilization=args.gpu_memory_utilization,
                                          max_model_len=lambda cfg: args.max_model_len or cfg.max_position_embeddings)
        args = args.replace(kv_cache_bytes=kv_bytes, device=dev, dtype=dtype)
        connections = ConnectionLimits(max_connections=limit_concurrency, header_timeout=header_timeout,
                                       body_timeout=body_timeout, keep_alive=timeout_keep_alive)
    except UnsupportedModelError:
        raise  # one line, as every command's (OneLineErrors)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    origins = tuple(o.strip() for arg in allowed_origins or [] for o in arg.split(",") if o.strip())
    raise typer.Exit(run_server(model, host=host, port=port, api_key=api_key,
                                served_model_name=served_model_name, engine_config=args,
                                shutdown_timeout=shutdown_timeout, log_level=log_level,
                                connections=connections, allowed_origins=origins,
                                split_special_tokens=split_special_tokens,
                                force_include_usage=enable_force_include_usage,
                                access_log=not disable_access_log, learn=learn_cfg,
                                max_ttft_slowdown=max_ttft_slowdown, save_suffix_history=save_suffix_history,
                                admin_key=admin_key, rollback_to=rollback_to,
                                feedback_rate_limit=120.0 if feedback_rate_limit is None else feedback_rate_limit))


# ---- ssm: ssm-train (owner: ssm) ----

@app.command("ssm-train", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def ssm_train(
    ctx: typer.Context,
    config: str = typer.Option(None, "--config", help="YAML file of SSMTrainConfig fields, or a "
                               f"bundled config: {bundled('ssm-')}."),
    grad_mode: str = typer.Option(None, "--grad-mode", help="backprop | checkpoint | adjoint | truncated."),
    resume: bool = typer.Option(False, "--resume", help="Continue from output_dir's latest checkpoint."),
) -> None:
    """Train a Mamba-1, Mamba-2 or Nemotron-H hybrid LM on a text corpus at a chosen context
    length (random init: --architecture and --model_config; --model DIR loads one). Any config field can be
    overridden as `--field value` (e.g. --context_length 65536 --window 2048; a bool field alone
    is true). Under `torchrun --nproc_per_node=N -m reclaim.cli ssm-train ...`, --sharding none |
    fsdp | layer | time picks data parallel, the same fully sharded, a pipeline over layer blocks,
    or context parallel."""
    from reclaim.config import load_config
    from reclaim.ssm.train import SSMTrainConfig, train

    args = list(ctx.args) + (["--grad_mode", grad_mode] if grad_mode is not None else []) + (
        ["--resume_from_checkpoint", "true"] if resume else [])
    try:
        cfg = load_config(SSMTrainConfig, config, args)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    records = train(cfg)
    if records:
        typer.echo(f"step {records[-1]['step']}: loss {records[-1]['loss']:.4f}; "
                   f"log {cfg.output_dir}/log.jsonl")




# ---- drafter: drafter train (owner: rl) ----

drafter_app = typer.Typer(help="EAGLE drafters for speculative decoding.", no_args_is_help=True)
app.add_typer(drafter_app, name="drafter")


@drafter_app.command("train", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def drafter_train(
    ctx: typer.Context,
    config: str = typer.Option(None, "--config", help="YAML file of DrafterTrainConfig fields, or a "
                               f"bundled config: {bundled('drafter-')}."),
    resume: bool = typer.Option(False, "--resume", help="Continue from output_dir's latest checkpoint."),
) -> None:
    """Train an EAGLE drafter on the target's hidden states over its own answers to chat prompts
    and reasoning tasks (drafter_type: eagle3, Eagle3TrainConfig: EAGLE-3, also from prefill over
    existing text). Any config field can be overridden as `--field value` (e.g. --model DIR
    --max_steps 500). The drafter (EAGLE or EAGLE-3 layout) lands in output_dir."""
    from reclaim.config import load_config
    from reclaim.drafter.eagle3 import train_command

    args = list(ctx.args) + (["--resume_from_checkpoint", "true"] if resume else [])
    try:
        config_class, train = train_command(config, args)
        cfg = load_config(config_class, config, args)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    summary = train(cfg, log=typer.echo)
    last = summary["last"] or {}
    line = f"step {summary['steps']}: loss {last.get('loss', float('nan')):.4f}"
    if "eval" in summary:
        ev = summary["eval"]
        line += (f"; held-out greedy tau {ev['tau']:.2f} (k={ev['num_speculative_tokens']}, "
                 f"{ev['prompts']} prompts)")
    typer.echo(f"{line}; drafter in {cfg.output_dir}, log {cfg.output_dir}/log.jsonl")



# ---- plan: memory per rank (owner: rl) ----

@app.command("plan", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def plan(
    ctx: typer.Context,
    config: str = typer.Option(..., "--config", help=f"The GRPO or ssm-train config to plan (YAML or a "
                               f"bundled name: {bundled('grpo-')}, {bundled('ssm-')})."),
    world_size: int = typer.Option(1, "--world-size", help="Ranks (torchrun's nnodes x nproc_per_node)."),
    model_config: str = typer.Option(None, "--model-config", help="An HF config.json, a model directory, or "
                                     "a bundled shape: qwen2.5-7b, qwen2.5-32b, llama-3.1-8b, nemotron-h-8b. "
                                     "Default: the "
                                     "config's model."),
    parallelism: str = typer.Option(None, "--parallelism", help="ddp or fsdp; default: the config's."),
    device_memory: str = typer.Option(None, "--device-memory", help="Memory per device, e.g. 141GB, 80GiB."),
    as_json: bool = typer.Option(False, "--json", help="Print the numbers as JSON."),
) -> None:
    """A GRPO run's memory per rank from the model's config.json (meta device, no weights):
    parameters, gradients, optimizer, reference model, rollout weights, KV and activations, and
    whether it fits. An ssm-train config (one with grad_mode) gets the long-context SSM plan
    (reclaim/ssm/plan.py: weights, boundary states, attention K/V, one chunk's graph; --sharding
    none | fsdp | time). Config fields can be overridden as `--field value`."""
    import json

    import yaml

    from reclaim.config import load_config, read_config_text
    from reclaim.plan import model_config_path, report
    from reclaim.plan import plan as make_plan
    from reclaim.rl.grpo_config import GRPOConfig
    from reclaim.ssm.plan import plan_ssm
    from reclaim.ssm.train import SSMTrainConfig
    from reclaim.storage import parse_size

    try:
        ssm = "grad_mode" in (yaml.safe_load(read_config_text(config)[1]) or {})
        cfg = load_config(SSMTrainConfig if ssm else GRPOConfig, config, list(ctx.args))
        memory = None if device_memory is None else parse_size(device_memory)
        if cfg.model is None and model_config is None:
            raise ValueError("the config names no model; give --model-config")
        if ssm:
            p = plan_ssm(cfg, model_config_path(model_config or cfg.model), world_size)
        else:
            p = make_plan(cfg, model_config_path(model_config or cfg.model), world_size,
                          parallelism or cfg.parallelism)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    typer.echo(json.dumps(p.to_dict(memory), indent=2) if as_json else report(p, memory))


# ---- rl: grpo (owner: rl) ----

@app.command("grpo", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def grpo(
    ctx: typer.Context,
    config: str = typer.Option(None, "--config", help="YAML file of GRPOConfig fields (TRL's names), or a "
                               f"bundled config: {bundled('grpo-')}."),
    resume: bool = typer.Option(False, "--resume", help="Continue from output_dir's latest checkpoint."),
) -> None:
    """Train a policy with GRPO on procedural reasoning tasks, rollouts on reclaim's engine. Any
    config field can be overridden as `--field value` (e.g. --max_steps 20 --beta 0.04)."""
    from reclaim.config import load_config
    from reclaim.rl.grpo import train
    from reclaim.rl.grpo_config import GRPOConfig
    from reclaim.rl.rewards import RewardError

    args = list(ctx.args) + (["--resume_from_checkpoint", "true"] if resume else [])
    try:
        cfg = load_config(GRPOConfig, config, args)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    try:
        summary = train(cfg, log=typer.echo)
    except (RewardError, ValueError, FileNotFoundError) as e:  # a bad reward, dataset, model or resume
        typer.echo(f"Error: {e}", err=True)
        raise typer.Exit(1) from e
    if int(os.environ.get("RANK", 0)) != 0:
        return  # under torchrun rank 0 reports (it also wrote the log)
    last = summary["last"] or {}
    typer.echo(f"step {summary['steps']}: reward {last.get('reward', float('nan')):.3f}, "
               f"step time {last.get('step_time', float('nan')):.1f} s; log {cfg.output_dir}/log.jsonl")


def main() -> None:
    """The `reclaim` command: malloc with transparent huge pages (see reclaim/hugepages.py), then
    the commands. A torchrun rank (WORLD_SIZE above 1) ends without interpreter finalization, after
    its atexit handlers: there gloo's C++ threads can still hold tensors and abort a process whose
    work is done ("terminate called without an active exception", pytorch/pytorch#190489); a
    tensor-parallel server's rank 0 exited with SIGABRT after draining in 3 of 8 runs."""
    from reclaim.hugepages import enable

    enable()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        app()
        return
    import atexit
    import traceback

    try:
        app()
        code = 0
    except SystemExit as e:  # typer ends every command with one
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
