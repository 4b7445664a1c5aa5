"""GPU checks the CPU CI cannot make: run on a CUDA machine with `python scripts/gpu_check.py`.

1. Adjoint gradients equal autograd's on CUDA (fp32, relative error per parameter).
2. Engine greedy output equals transformers' generate on CUDA (tiny random Llama, fp32; bf16 reported).
3. GRPO's packed log-probs (each prompt once, its completions behind it under a mask) and their
   gradients equal separate rows' on CUDA (fp32; under bf16 autocast reported).
Prints one JSON line per check; exits non-zero if a check fails.

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


def main() -> int:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(json.dumps({"torch": torch.__version__, "device": dev,
                      "name": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}), flush=True)
    results = [check_adjoint(dev), check_engine(dev, torch.float32), check_packed_logps(dev)]
    for r in results:
        print(json.dumps(r), flush=True)
    if dev == "cuda":  # bf16 kernels differ in accumulation order: informational, not a pass/fail
        print(json.dumps(check_engine(dev, torch.bfloat16)), flush=True)
        print(json.dumps(check_packed_logps(dev, bf16=True)), flush=True)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
