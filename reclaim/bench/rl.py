"""`reclaim bench rl`: GRPO steps with plain, static-speculative and adaptive rollouts, and TRL.

Every arm runs the same GRPO config (a bundled one, `grpo-smollm2-add` by default: one-step
additions in words, whose answers run from a few tokens to the length cap, a long tail) on the
same model and the same prompts for `steps` RL steps, one after the other in one process:

- plain: reclaim's engine, no speculation;
- static: speculation in the tail with one fixed config (an EAGLE chain of `static_depth`, the
  best fixed point of `reclaim bench spec` on this CPU), whenever at most `spec_threshold`
  sequences are in flight;
- adaptive: TLT's rollout, a bandit per batch-size bucket choosing plain or a draft depth in the
  tail (and the drafter trained online on the rollouts, where GRPOConfig has `drafter_online`);
- suffix: the history drafter (the group's other completions, the prompt's earlier steps), the
  bandit choosing plain or it per bucket;
- hybrid: suffix and EAGLE drafts merged into one verify tree, the bandit choosing among plain,
  suffix, EAGLE per depth and the merged tree (needs an EAGLE drafter);
- trl: TRL's `GRPOTrainer` (transformers `generate`) with the same config, prompts in the same order.

Reported per RL step: rollout tokens/s, the time and tokens/s in the long tail (at most
`spec_threshold` sequences in flight), the mean accepted length tau (tokens committed per
verifying forward), reward and step time. The reclaim arms sample with per-request seeds and
speculation is lossless, so their completions must be identical (counted per step); a greedy
rollout of `greedy_prompts` prompts through each arm's rollout runner is compared token for token.

`held_out_accuracy` (bench/rl_accuracy.py, `reclaim bench rl --accuracy RUN_DIR`) scores a GRPO run: greedy accuracy on
prompts of its task that it never trained on, for the starting model and the run's last checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from reclaim.bench.meta import finish_metadata, run_metadata, write_result

ARMS = ("plain", "static", "adaptive", "suffix", "hybrid", "trl")
SPECULATING = ("static", "adaptive", "suffix", "hybrid")
# The per-step metrics the figures and the summary use (reclaim's log names; TRL's are mapped to them).
STEP_KEYS = ("rollout_tokens_per_s", "rollout_s", "rollout_tail_s", "rollout_tail_tokens_per_s", "rollout_spec_tau",
             "reward", "step_time", "train_s", "completions/mean_length", "completions/min_length",
             "completions/max_length")


@dataclass
class RLBenchSpec:
    """What to run: the GRPO config the arms share, its sizes here, the arms, where to write."""

    config: str = "grpo-smollm2-add"  # bundled name or YAML path (GRPOConfig fields)
    model: str | None = None  # None: the config's (the bundled SmolLM2-135M-Instruct)
    drafter: str | None = None  # EAGLE drafter dir, or "ngram"; None: the default model's cached one, else ngram
    steps: int = 3
    prompts_per_step: int = 1
    num_generations: int = 8
    max_completion_length: int | None = None  # None: the config's
    num_prompts: int | None = None  # the dataset's size (None: the config's); fewer than steps repeats prompts
    spec_threshold: int = 4
    static_depth: int = 4
    adaptive_depths: list[int] = field(default_factory=lambda: [2, 4])
    greedy_prompts: int = 4
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    threads: int | None = 1
    bf16: bool = False  # every arm trains under bfloat16 autocast (GRPOConfig.bf16; TRL's bf16 too)
    out_dir: str = "benchmarks"

    def __post_init__(self) -> None:
        bad = [a for a in self.arms if a not in ARMS]
        if bad or not self.arms or "plain" not in self.arms:
            raise ValueError(f"arms={self.arms}: allowed {list(ARMS)}, and 'plain' (the baseline) must be one")
        for name in ("steps", "prompts_per_step", "max_completion_length", "num_prompts", "spec_threshold",
                     "static_depth"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_generations < 2:
            raise ValueError(f"num_generations must be >= 2, got {self.num_generations}")
        if self.greedy_prompts < 0 or not self.adaptive_depths or min(self.adaptive_depths) < 1:
            raise ValueError(f"greedy_prompts={self.greedy_prompts} must be >= 0 and adaptive_depths="
                             f"{self.adaptive_depths} non-empty depths >= 1")


def quick_spec(**kw: Any) -> RLBenchSpec:
    """A smoke-sized run (seconds on a tiny model): 2 steps of 1 prompt x 4 completions of 12 tokens,
    all of it counted as tail (threshold 4) so that the speculating arms always speculate."""
    base = dict(steps=2, prompts_per_step=1, num_generations=4, max_completion_length=12, spec_threshold=4,
                static_depth=2, adaptive_depths=[1, 2], greedy_prompts=2)
    return RLBenchSpec(**{**base, **kw})


# ---- the arms' configs -------------------------------------------------------------------------

def _speculative(spec: RLBenchSpec) -> str:
    """GRPOConfig.speculative for the speculating arms: the drafter asked for, the default model's
    cached EAGLE drafter, or ngram (prompt lookup) when there is none."""
    if spec.drafter == "ngram":
        return "ngram"
    if spec.drafter is not None:
        return f"eagle:{spec.drafter}"
    from reclaim.models.loading import DEFAULT_NAMES
    from reclaim.drafter.bundled import default_drafter_path

    if spec.model in DEFAULT_NAMES and (default_drafter_path() / "config.json").exists():
        return f"eagle:{default_drafter_path()}"
    return "ngram"


def arm_configs(spec: RLBenchSpec, out: Path) -> dict[str, Any]:
    """The GRPOConfig of each reclaim arm: the shared config resized, speculation per arm."""
    from reclaim.config import load_config
    from reclaim.rl.grpo_config import GRPOConfig

    g = spec.num_generations
    shared = {"max_steps": spec.steps, "num_generations": g, "per_device_train_batch_size": g,
              "gradient_accumulation_steps": spec.prompts_per_step, "save_steps": 0, "save_total_limit": 1, "logging_steps": 1, "log_completions": True,
              "threads": spec.threads, "spec_threshold": spec.spec_threshold, "speculative": "none",
              "bf16": spec.bf16}
    for name in ("model", "max_completion_length", "num_prompts"):
        if getattr(spec, name) is not None:
            shared[name] = getattr(spec, name)
    base = load_config(GRPOConfig, spec.config, shared)
    drafter = _speculative(spec)
    per_arm = {"plain": {},
               "static": {"speculative": drafter, "adaptive": False, "spec_depths": [spec.static_depth]},
               "adaptive": {"speculative": drafter, "adaptive": True, "spec_depths": sorted(spec.adaptive_depths)}}
    if "drafter_online" in {f.name for f in dataclasses.fields(GRPOConfig)}:
        per_arm["adaptive"]["drafter_online"] = drafter.startswith("eagle")
    per_arm["suffix"] = {"speculative": "suffix", "adaptive": True}
    if drafter.startswith("eagle"):  # hybrid merges the history drafter with this EAGLE drafter
        per_arm["hybrid"] = {"speculative": "hybrid" + drafter.removeprefix("eagle"), "adaptive": True,
                             "spec_depths": sorted(spec.adaptive_depths)}
    elif "hybrid" in spec.arms:
        raise ValueError("the hybrid arm needs an EAGLE drafter (--drafter PATH, or the default model's cached one)")
    return {arm: dataclasses.replace(base, output_dir=str(out / arm), **kw)
            for arm, kw in per_arm.items() if arm in spec.arms}


# ---- the reclaim arms --------------------------------------------------------------------------

def run_reclaim(cfg: Any) -> dict[str, Any]:
    """`reclaim grpo` with cfg; its per-step log and each step's completions."""
    from reclaim.rl.grpo import train

    t = time.perf_counter()
    train(cfg, progress=False, log=lambda s: print(s, flush=True))
    seconds = time.perf_counter() - t
    out = Path(cfg.output_dir)
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    completions: dict[int, list[str]] = {}
    for line in (out / "completions.jsonl").read_text().splitlines():
        rec = json.loads(line)
        completions.setdefault(rec["step"], []).append(rec["completion"])
    steps = [{k: rec[k] for k in rec if k in STEP_KEYS or k == "step" or any(w in k for w in ("drafter", "spec", "suffix"))}
             for rec in log]
    return {"steps": steps, "completions": completions, "seconds": seconds}


def greedy_outputs(cfg: Any, model: torch.nn.Module, tokenizer: Any,
                   prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Greedy completions of `prompts` through cfg's rollout runner (plain or speculative in the
    tail) and how many drafts the target verified."""
    from reclaim.engine.engine import Engine
    from reclaim.engine.request import SamplingParams
    from reclaim.rl.rollout import rollout_runner

    from reclaim.engine.proposers import make_proposer
    from reclaim.rl.rollout import spec_arms

    runner = rollout_runner(cfg)
    # A drafter made mid-rollout has not seen the running sequences and cannot draft for them: the
    # speculating arms' engines get theirs at the start (the one training uses), so the check
    # compares drafted tokens.
    drafter = make_proposer(spec_arms(cfg)[-1], model) if cfg.speculative != "none" else None
    engine = Engine(model, tokenizer, cfg.engine_config(max(len(p) for p in prompts) + cfg.max_completion_length),
                    proposer=drafter)
    params = [SamplingParams(temperature=0.0, max_tokens=cfg.max_completion_length)] * len(prompts)
    outs, stats = runner.generate(engine, prompts, params)
    return [list(o.token_ids) for o in outs], stats.spec.get("verifies", 0)


def step_prompts(cfg: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]], torch.nn.Module, Any]:
    """The dataset rows of every RL step in order, the whole dataset, and the config's model and tokenizer."""
    from reclaim.models.loading import load_model
    from reclaim.rl.data import build_dataset, prompt_rows

    rows = build_dataset(cfg)
    per_step = cfg.generation_batch_size // cfg.num_generations
    order = [i for s in range(cfg.max_steps) for i in prompt_rows(len(rows), per_step, s, cfg.seed)]
    model, tok = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
    return [rows[i] for i in order], rows, model, tok


# ---- TRL ---------------------------------------------------------------------------------------

def run_trl(cfg: Any, rows: list[dict[str, Any]], tokenizer: Any, out: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same model, prompts (in order) and config; per-step rollout and step
    time measured around its generation and its optimizer steps."""
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    from reclaim.models.hf import load_hf_model
    from reclaim.models.loading import resolve_model_dir
    from reclaim.rl.rewards import load_reward

    args = trl.GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=cfg.per_device_train_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, num_generations=cfg.num_generations,
        max_completion_length=cfg.max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
        loss_type=cfg.loss_type, beta=cfg.beta, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
        scale_rewards=cfg.scale_rewards, num_iterations=cfg.num_iterations, reward_weights=cfg.reward_weights,
        learning_rate=cfg.learning_rate, lr_scheduler_type=cfg.lr_scheduler_type, warmup_steps=cfg.num_warmup_steps,
        max_grad_norm=cfg.max_grad_norm, max_steps=cfg.max_steps, seed=cfg.seed, logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, bf16=cfg.bf16, gradient_checkpointing=False,
        shuffle_dataset=False, disable_tqdm=True)
    if tokenizer.pad_token is None:
        tokenizer = copy.copy(tokenizer)
        tokenizer.pad_token = tokenizer.eos_token
    data = Dataset.from_list([{k: v for k, v in r.items()} for r in rows])
    funcs = [load_reward(name) for name in cfg.reward_funcs]
    hf = load_hf_model(resolve_model_dir(cfg.model))
    trainer = trl.GRPOTrainer(model=hf, reward_funcs=funcs, args=args, train_dataset=data,
                              processing_class=tokenizer)
    gen: list[tuple[float, int]] = []
    generate = trainer._generate

    def timed_generate(prompts: list) -> Any:
        t = time.perf_counter()
        result = generate(prompts)
        gen.append((time.perf_counter() - t, sum(len(c) for c in result[1])))  # (.., completion_ids, ..)
        return result

    trainer._generate = timed_generate
    steps: list[dict[str, Any]] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            steps.append({"step": state.global_step, "step_time": time.perf_counter() - self.t})

        def on_log(self, args, state, control, logs=None, **kw):
            if steps and logs and "reward" in logs:
                steps[-1].update({k: logs[k] for k in ("reward", "completions/mean_length",
                                                       "completions/max_length") if k in logs})

    trainer.add_callback(Timer())
    t = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t
    for rec, (secs, tokens) in zip(steps, gen):
        rec.update({"rollout_s": secs, "rollout_tokens": tokens, "rollout_tokens_per_s": tokens / secs,
                    "train_s": rec["step_time"] - secs})
    return {"steps": steps, "seconds": seconds, "trl_version": trl.__version__}


# ---- the whole run -----------------------------------------------------------------------------

def _total(steps: list[dict[str, Any]], key: str) -> float:
    return sum(s.get(key, 0.0) for s in steps)


def summarize(arms: dict[str, dict[str, Any]], goals: bool = True) -> dict[str, Any]:
    """Per arm over all steps: rollout and tail tokens/s (totals), mean and median step time, step
    time per completion token, mean tau, mean reward; speed-ups against plain and TRL (step times by
    their medians, and per token against TRL); the issue's CPU goals and whether each is met."""
    out: dict[str, Any] = {}
    for name, arm in arms.items():
        st = arm["steps"]
        rollout_tokens = sum(s.get("rollout_tokens_per_s", 0) * s.get("rollout_s", 0) for s in st)
        tail_tokens = sum(s.get("rollout_tail_tokens_per_s", 0) * s.get("rollout_tail_s", 0) for s in st)
        taus = [s["rollout_spec_tau"] for s in st if s.get("rollout_spec_tau")]
        out[name] = {
            "rollout_tokens_per_s": rollout_tokens / max(_total(st, "rollout_s"), 1e-9),
            "tail_seconds": _total(st, "rollout_tail_s") if name != "trl" else None,
            "tail_tokens_per_s": (tail_tokens / _total(st, "rollout_tail_s")) if _total(st, "rollout_tail_s") else None,
            "rollout_seconds_per_step": _total(st, "rollout_s") / len(st),
            "step_time": statistics.mean(s["step_time"] for s in st),
            "step_time_median": statistics.median(s["step_time"] for s in st),
            # The arms sample different completions (TRL its own): step time per completion token
            # compares them at equal work.
            "step_seconds_per_token": _total(st, "step_time") / max(rollout_tokens, 1e-9),
            "mean_tau": statistics.mean(taus) if taus else None,
            "reward": statistics.mean(s["reward"] for s in st if "reward" in s) if any("reward" in s for s in st)
            else None}
        if _total(st, "rollout_tail_s") and any("rollout_spec_draft_s" in s for s in st):
            # drafting's share of the tail's time: what a draft costs against the step it rides on
            out[name]["draft_share_of_tail"] = _total(st, "rollout_spec_draft_s") / _total(st, "rollout_tail_s")
        if "suffix/bytes" in st[-1]:  # the history drafter's memory after the last step
            out[name]["history"] = {k.split("/", 1)[1]: v for k, v in st[-1].items() if k.startswith("suffix/")}
        online = [s["drafter/tau_online"] for s in st if "drafter/tau_online" in s]
        if online:  # drafter_online: held-out greedy tau of the trained drafter and of a frozen copy
            out[name].update({"tau_online": online, "tau_frozen": [s.get("drafter/tau_frozen") for s in st],
                              "drafter_seconds_per_step": statistics.mean(
                                  s.get("drafter/train_s", 0) + s.get("drafter/eval_s", 0) for s in st)})
    plain = out["plain"]
    if plain["tail_seconds"]:  # Amdahl: speculation speeds the tail only, so no arm's step can beat
        # plain's by more than step / (step - tail): tail seconds and step time per step, both means
        share = plain["tail_seconds"] / len(arms["plain"]["steps"]) / plain["step_time"]
        plain["tail_share_of_step"] = share
        plain["step_speedup_bound_if_tail_free"] = 1.0 / (1.0 - share)
    for name, s in out.items():  # step times compared by their medians: one load spike moves a mean
        s["step_speedup_vs_plain"] = plain["step_time_median"] / s["step_time_median"]
        s["rollout_speedup_vs_plain"] = s["rollout_tokens_per_s"] / plain["rollout_tokens_per_s"]
        if s["tail_tokens_per_s"] and plain["tail_tokens_per_s"]:
            s["tail_speedup_vs_plain"] = s["tail_tokens_per_s"] / plain["tail_tokens_per_s"]
        if "trl" in out:
            s["step_speedup_vs_trl"] = out["trl"]["step_time_median"] / s["step_time_median"]
            s["step_per_token_speedup_vs_trl"] = out["trl"]["step_seconds_per_token"] / s["step_seconds_per_token"]
    speculating = [n for n in out if n in SPECULATING]
    if goals and speculating:  # issue 26's goals, for the arm with the fastest tail
        best = max(speculating, key=lambda n: out[n].get("tail_speedup_vs_plain") or 0.0)
        b, bound = out[best], plain.get("step_speedup_bound_if_tail_free")
        out["best_arm"] = best
        out["goals"] = {"tail_throughput_2x_vs_plain": (b.get("tail_speedup_vs_plain"), 2.0),
                        "tail_tau_3": (b.get("mean_tau"), 3.0),
                        "rollout_1.5x_vs_plain": (b["rollout_speedup_vs_plain"], 1.5),
                        "step_90pct_of_the_tail_free_bound": (b["step_speedup_vs_plain"] / bound if bound else None, 0.9),
                        "step_time_1.5x_vs_plain": (b["step_speedup_vs_plain"], 1.5),
                        "step_time_3x_vs_trl": (b.get("step_speedup_vs_trl"), 3.0)}
        if out.get("adaptive", {}).get("tau_online"):
            tau = out["adaptive"]["tau_online"]
            out["goals"]["online_tau_within_10pct_of_start"] = (min(tau) / tau[0], 0.9)
        out["goals"] = {k: {"measured": v, "goal": g, "met": v is not None and v >= g, "arm": best}
                        for k, (v, g) in out["goals"].items()}
        if "draft_share_of_tail" in out.get("suffix", {}):  # a lookup costs under 5% of the step it drafts for
            share = out["suffix"]["draft_share_of_tail"]
            out["goals"]["history_lookup_under_5pct_of_a_step"] = {"measured": share, "goal": 0.05,
                                                                  "met": share < 0.05, "arm": "suffix"}
        if bound is not None:  # what the step goal can reach on this shape
            out["goals"]["step_time_1.5x_vs_plain"]["bound_if_tail_free"] = bound
    return out


def goal_lines(summary: dict[str, Any]) -> list[str]:
    """The issue's goals as printed lines: measured against the goal, met or not, and for the
    step goal the most a tail that cost nothing could give."""
    lines = []
    for name, g in summary.get("goals", {}).items():
        got = "n/a" if g["measured"] is None else f"{g['measured']:.3f}" if name.startswith("history") \
            else f"{g['measured']:.2f}x"
        bound = f" (a free tail would give at most {g['bound_if_tail_free']:.2f}x)" if "bound_if_tail_free" in g else ""
        lines.append(f"goal {name} ({g.get('arm', 'adaptive')}): {got} against {g['goal']}x, "
                     f"{'met' if g['met'] else 'not met'}{bound}")
    return lines


def measure(spec: RLBenchSpec) -> dict[str, Any]:
    if spec.threads:
        torch.set_num_threads(spec.threads)
    meta = run_metadata()
    with tempfile.TemporaryDirectory(prefix="reclaim-bench-rl-") as tmp:
        cfgs = arm_configs(spec, Path(tmp))
        base = cfgs["plain"]
        rows, dataset, model, tok = step_prompts(base)
        # A fresh model's first training step costs more until the process has held two models'
        # memory (one step on the same batch, model after model: 8.7, 7.9, 5.9, 6.1 s; second steps
        # 5.7-5.9): without this the first two arms paid it. Two one-step runs first, not counted.
        for n in range(2):
            print(f"== warm-up {n + 1} of 2: one plain step, not counted", flush=True)
            run_reclaim(dataclasses.replace(base, max_steps=1, output_dir=str(Path(tmp) / f"warm-up-{n}")))
        arms: dict[str, dict[str, Any]] = {}
        for name, cfg in cfgs.items():
            print(f"== {name}: {cfg.speculative}{' adaptive' if cfg.adaptive and cfg.speculative != 'none' else ''}",
                  flush=True)
            arms[name] = run_reclaim(cfg)
            for s in arms[name]["steps"]:
                _print(name, s)
        # Sampled completions: per-request seeds + lossless speculation = the same text in every arm.
        ref = arms["plain"].pop("completions")
        for name in cfgs:
            if name != "plain":
                got = arms[name].pop("completions")
                arms[name]["identical_completions"] = [
                    f"{sum(a == b for a, b in zip(got[s], ref[s]))}/{len(ref[s])}" for s in sorted(ref)]
        greedy = None
        if spec.greedy_prompts:
            from reclaim.models.tokenizer import encode_chat

            prompts = [encode_chat(tok, r["prompt"])[-(base.max_prompt_length or 10**9):]
                       for r in dataset[:spec.greedy_prompts]]
            outs = {name: greedy_outputs(cfg, model, tok, prompts) for name, cfg in cfgs.items()}
            plain = outs["plain"][0]
            greedy = {name: f"{sum(a == b for a, b in zip(o, plain))}/{len(prompts)}"
                      for name, (o, _) in outs.items() if name != "plain"}
            greedy["tokens"] = sum(len(o) for o in plain)
            greedy["verifies"] = {name: v for name, (_, v) in outs.items() if name != "plain"}
            print(f"greedy rollouts identical to plain: {greedy}", flush=True)
        if "trl" in spec.arms:
            print("== trl: GRPOTrainer, transformers generate", flush=True)
            arms["trl"] = run_trl(base, rows, tok, Path(tmp) / "trl")
            for s in arms["trl"]["steps"]:
                _print("trl", s)
    return {"spec": asdict(spec), "config": dataclasses.asdict(base),
            "arm_settings": {n: {"speculative": c.speculative, "adaptive": c.adaptive, "spec_depths": c.spec_depths,
                                 "drafter_online": getattr(c, "drafter_online", None)} for n, c in cfgs.items()},
            "arms": arms, "greedy_identical_to_plain": greedy, "summary": summarize(arms),
            "meta": finish_metadata(meta)}


def measure_rollouts(spec: RLBenchSpec) -> dict[str, Any]:
    """The rollouts alone, side by side: each step's prompts rolled out by every reclaim arm one
    after the other (the order rotated step by step, so drift in the machine's speed falls on
    every arm alike), each arm's engine and drafter kept across steps as in training; no training
    between steps (the policy stays the starting model). Per arm: rollout and tail seconds, tail
    tokens/s, tau, the history drafter's memory; the completions must be identical to plain's."""
    from reclaim.engine.request import SamplingParams
    from reclaim.models.tokenizer import encode_chat
    from reclaim.rl.data import request_seed
    from reclaim.rl.grpo import _open_engine
    from reclaim.rl.rollout import rollout_runner

    if spec.threads:
        torch.set_num_threads(spec.threads)
    meta = run_metadata()
    with tempfile.TemporaryDirectory(prefix="reclaim-bench-rl-") as tmp:
        cfgs = {n: dataclasses.replace(c, drafter_online=False) for n, c in arm_configs(spec, Path(tmp)).items()}
    base = cfgs["plain"]
    rows, _, model, tok = step_prompts(base)
    per_step = base.generation_batch_size // base.num_generations
    prompts = [encode_chat(tok, r["prompt"])[-(base.max_prompt_length or 10**9):] for r in rows]
    max_len = max(map(len, prompts)) + base.max_completion_length
    engines = {n: _open_engine(c, model, tok, max_len, None)[0] for n, c in cfgs.items()}
    runners = {n: rollout_runner(c) for n, c in cfgs.items()}
    names = list(cfgs)
    steps: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for step in range(spec.steps):
        ids = [p for p in prompts[step * per_step:(step + 1) * per_step] for _ in range(base.num_generations)]
        params = [SamplingParams(temperature=base.temperature, top_p=base.top_p, max_tokens=base.max_completion_length,
                                 seed=request_seed(base.seed, step, i)) for i in range(len(ids))]
        order = names[step % len(names):] + names[:step % len(names)]
        for name in order:
            engine = engines[name]
            next_round = getattr(engine.proposer, "next_round", None)
            if next_round is not None:
                next_round()
            outs, st = runners[name].generate(engine, ids, params)
            s = st.spec
            rec = {"step": step + 1, "rollout_s": st.seconds, "rollout_tokens": st.tokens,
                   "rollout_tail_s": st.tail_seconds, "rollout_tail_tokens": st.tail_tokens,
                   "rollout_spec_tau": (s["accepted"] + s["verifies"]) / s["verifies"] if s.get("verifies") else None,
                   "rollout_spec_draft_s": s.get("draft_seconds", 0.0), "completions": [o.token_ids for o in outs]}
            memory = getattr(engine.proposer, "memory", None)
            if memory is not None:
                rec["history"] = memory()
            steps[name].append(rec)
            tau = rec["rollout_spec_tau"]
            print(f"{name:<9} step {step + 1}: rollout {st.seconds:5.1f} s, tail {st.tail_seconds:5.1f} s "
                  f"({st.tail_tokens} tokens){'' if tau is None else f', tau {tau:.2f}'}", flush=True)
    summary = {}
    for name, st in steps.items():
        tail = sum(r["rollout_tail_s"] for r in st)
        taus = [r["rollout_spec_tau"] for r in st if r["rollout_spec_tau"]]
        summary[name] = {"rollout_seconds": sum(r["rollout_s"] for r in st), "tail_seconds": tail,
                         "tail_tokens_per_s": sum(r["rollout_tail_tokens"] for r in st) / tail if tail else None,
                         "mean_tau": statistics.mean(taus) if taus else None,
                         "draft_share_of_tail": sum(r["rollout_spec_draft_s"] for r in st) / tail if tail else None,
                         "identical_completions": [f"{sum(a == b for a, b in zip(r['completions'], p['completions']))}/"
                                                   f"{len(p['completions'])}" for r, p in zip(st, steps["plain"])]}
        if "history" in st[-1]:
            summary[name]["history"] = st[-1]["history"]
    plain = summary["plain"]
    for s in summary.values():
        s["rollout_speedup_vs_plain"] = plain["rollout_seconds"] / s["rollout_seconds"]
        if s["tail_tokens_per_s"] and plain["tail_tokens_per_s"]:
            s["tail_speedup_vs_plain"] = s["tail_tokens_per_s"] / plain["tail_tokens_per_s"]
    for st in steps.values():
        for r in st:
            r.pop("completions")
    return {"spec": asdict(spec), "config": dataclasses.asdict(base), "mode": "rollouts only",
            "arm_settings": {n: {"speculative": c.speculative, "adaptive": c.adaptive, "spec_depths": c.spec_depths}
                             for n, c in cfgs.items()},
            "arms": {n: {"steps": st} for n, st in steps.items()}, "summary": summary, "meta": finish_metadata(meta)}


def plot_rollouts(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (key, title) in zip(axes, (("rollout_s", "rollout (s)"), ("rollout_tail_s", "time in the tail (s)"),
                                        ("rollout_spec_tau", "mean accepted length tau"))):
        for name, arm in result["arms"].items():
            pts = [(r["step"], r[key]) for r in arm["steps"] if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", color=f"C{ARMS.index(name)}", label=name)
        ax.set_title(title)
        ax.set_xlabel("RL step (its prompts)")
        ax.legend(fontsize=7)
    fig.suptitle("GRPO rollouts alone, arms side by side (reclaim bench rl --rollouts-only)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main_rollouts(spec: RLBenchSpec) -> dict[str, Any]:
    result = measure_rollouts(spec)
    write_result(spec.out_dir, "rl-rollouts", result, plot_rollouts)
    return result


def _print(arm: str, s: dict[str, Any]) -> None:
    tau = f" tau {s['rollout_spec_tau']:.2f}" if s.get("rollout_spec_tau") else ""
    tail = f" tail {s['rollout_tail_s']:5.1f} s" if "rollout_tail_s" in s else ""
    print(f"{arm:<9} step {s['step']}: rollout {s.get('rollout_tokens_per_s', 0):6.1f} tok/s{tail}{tau} "
          f"reward {s.get('reward', float('nan')):.3f} step {s['step_time']:5.1f} s", flush=True)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("rollout_tokens_per_s", "rollout tokens/s"), ("rollout_tail_tokens_per_s", "tail tokens/s"),
              ("rollout_tail_s", "time in the tail (s)"), ("rollout_spec_tau", "mean accepted length tau"),
              ("reward", "reward"), ("step_time", "step time (s)")]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    for ax, (key, title) in zip(axes.flat, panels):
        for name, arm in result["arms"].items():
            pts = [(s["step"], s[key]) for s in arm["steps"] if s.get(key) is not None]
            color = f"C{ARMS.index(name)}"  # one colour per arm in every panel
            if pts:
                ax.plot(*zip(*pts), marker="o", color=color, label=name)
            if key == "rollout_spec_tau":  # the online drafter's held-out tau beside its frozen start
                for extra, style in (("drafter/tau_online", "--"), ("drafter/tau_frozen", ":")):
                    pts = [(s["step"], s[extra]) for s in arm["steps"] if s.get(extra) is not None]
                    if pts:
                        ax.plot(*zip(*pts), style, marker=".", color=color,
                                label=f"{name} {extra.split('/')[1]} (held out)")
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.set_xticks(range(1, result["spec"]["steps"] + 1))
        if ax.lines:
            ax.legend(fontsize=7)
    load = result["meta"]["machine"].get("load_average_at_start")
    fig.suptitle(f"GRPO rollouts (reclaim bench rl), threshold {result['spec']['spec_threshold']} sequences; "
                 f"load average at start {load}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(spec: RLBenchSpec) -> dict[str, Any]:
    result = measure(spec)
    write_result(spec.out_dir, "rl", result, plot)
    return result
