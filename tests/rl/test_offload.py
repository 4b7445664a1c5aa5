"""Offload of the policy's parameters and AdamW's moments to host memory while rolling out
(reclaim/rl/offload.py). On this CPU the host is the device: every move is a no-op, so what is
tested is the bookkeeping (what is where, the bytes each way) and that a GRPO run with offload is
the run without it; two FSDP ranks with offload are checked in test_grpo_fsdp.py."""

from __future__ import annotations

import json

import torch
from rl_helpers import tiny_target

from reclaim.config import load_config
from reclaim.fsdp import training_bytes
from reclaim.optim import adamw
from reclaim.rl.grpo import train
from reclaim.rl.grpo_config import GRPOConfig
from reclaim.rl.offload import Offload


def _stepped():
    model = tiny_target(50)
    opt = adamw(list(model.parameters()), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    return model, opt


def test_the_moves_are_counted_both_ways_and_the_moments_come_back_last():
    model, opt = _stepped()
    held = training_bytes(model, opt)
    off = Offload(params=True, optimizer=True)
    ptrs = [p.data_ptr() for p in model.parameters()]
    off.to_host(model, opt)
    assert off.on_host == {"params", "optimizer"}
    assert off.bytes_moved == held["params_bytes"] + held["optimizer_bytes"]
    off.to_host(model, opt)  # already there: nothing moves twice
    assert off.bytes_moved == held["params_bytes"] + held["optimizer_bytes"]
    off.params_to_device(model)
    assert off.on_host == {"optimizer"}  # the moments wait through the forwards and backwards
    off.optimizer_to_device(opt)
    assert not off.on_host
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # CPU: the host is the device, a no-op
    logged = off.take()
    assert logged["offload/bytes"] == 2 * (held["params_bytes"] + held["optimizer_bytes"])
    assert logged["offload/s"] >= 0 and off.take()["offload/bytes"] == 0


def test_only_what_is_asked_moves():
    model, opt = _stepped()
    held = training_bytes(model, opt)
    off = Offload(params=False, optimizer=True)
    off.to_host(model, opt)
    off.params_to_device(model)
    off.optimizer_to_device(opt)
    assert off.take()["offload/bytes"] == 2 * held["optimizer_bytes"]
    assert not Offload().enabled


def test_a_run_with_offload_is_the_run_without(tiny_model_dir, tmp_path, one_thread):
    (tmp_path / "even.py").write_text("def even(prompts, completions, completion_ids, **kw):\n"
                                      "    return [sum(t % 2 == 0 for t in c) / len(c) for c in completion_ids]\n")
    fields = {"model": str(tiny_model_dir), "reward_funcs": [f"{tmp_path / 'even.py'}:even"], "max_steps": 2}
    for name, kw in (("plain", {}), ("offload", {"param_offload": True, "optimizer_offload": True})):
        train(load_config(GRPOConfig, "grpo-tiny", {**fields, **kw, "output_dir": str(tmp_path / name)}),
              progress=False)
    plain, off = ([json.loads(x) for x in (tmp_path / n / "log.jsonl").read_text().splitlines()]
                  for n in ("plain", "offload"))
    for a, b in zip(plain, off, strict=True):
        assert (a["loss"], a["reward"], a["grad_norm"]) == (b["loss"], b["reward"], b["grad_norm"])
    for r in off:  # each step both, each way (reclaim's AdamW holds its moments from the start)
        assert r["offload/bytes"] == 2 * (r["memory/params_bytes"] + r["memory/optimizer_bytes"]) > 0
    assert "offload/bytes" not in plain[0]
