"""The online trainer: per-sample reuse or recompute with the reason, the same gradient either
way, stale records never used at max_staleness=0, and crash-safe checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from online_helpers import grads, rel_err, tiny_model, token_lists

from reclaim.config import ConfigError, load_config
from reclaim.online.feedback import FeedbackLog
from reclaim.online.recorder import record_prompt
from reclaim.online.store import RecordInfo, RecordStore
from reclaim.online.trainer import (CostModel, OnlineTrainConfig, OnlineTrainer, Sample, plan,
                                    record_policy)

HERE = Path(__file__).parent


def tokenize(text: str) -> list[int]:
    return [2 + ord(c) % 90 for c in text]


def test_plan_says_why():
    samples = [Sample(i, f"r{i}", [3] * 10, [4] * 3) for i in range(7)]
    infos = [RecordInfo("present", 5, "device", 1000, 10), RecordInfo("missing"),
             RecordInfo("evicted"), RecordInfo("present", 4, "device", 1000, 10),
             RecordInfo("stale"), RecordInfo("present", 5, "host", 10**9, 10),
             RecordInfo("present", 5, "device", 1000, 9)]
    cost = CostModel(forward_fixed_s=0.0, forward_s_per_token=0.01, reuse_overhead_s=0.05,
                     reload_s_per_byte=1e-9)
    got = [(d.action, d.reason) for d in plan(samples, infos, 5, 0, cost)]
    assert got == [("reuse", "record"), ("recompute", "no_record"), ("recompute", "evicted"),
                   ("recompute", "stale"), ("recompute", "stale"),
                   ("recompute", "cost"),  # 1 s to bring back 1 GB > 0.1 s of prompt forward
                   ("recompute", "no_record")]  # a record of another prompt length
    assert plan(samples[3:4], infos[3:4], 5, 1, cost)[0].reason == "record_stale"
    short = CostModel(0.0, 0.001, 0.05, 0.0)  # a 10-token forward saves less than attaching costs
    assert plan(samples[:1], infos[:1], 5, 0, short)[0].reason == "cost"
    long = [Sample(0, "r0", [3] * 100, [4] * 3)]  # the same model: 100 tokens' forward pays
    assert plan(long, [RecordInfo("present", 5, "device", 1000, 100)], 5, 0, short)[0].action == "reuse"


def test_cost_model_is_measured_on_the_model():
    model = tiny_model()
    cost = CostModel.measure(model, prompt_tokens=(8, 32), response_tokens=8, repeats=3)
    assert cost.saved_s(32) > 0 and cost.reload_s_per_byte > 0 and cost.reuse_overhead_s >= 0
    assert cost.cost_s(RecordInfo("present", 0, "host", 10**6, 32)) > cost.cost_s(
        RecordInfo("present", 0, "device", 10**6, 32))
    assert all(p.grad is None for p in model.parameters())  # measuring leaves no gradients
    # serving's extra for a record: autograd's forward over inference's, plus a forward of its own
    # for the step's decode rows. The line through two timings may put all of the time in its
    # slope on a busy machine (a fixed part of 0), but the inference forward is measured.
    assert cost.inference_fixed_s + cost.inference_s_per_token * 32 > 0
    assert cost.record_extra_s(32) >= cost.inference_fixed_s


def test_record_extra_is_the_autograd_forward_over_inference_plus_a_decode_forward():
    cost = CostModel(0.02, 0.003, 0.0, 0.0, inference_fixed_s=0.01, inference_s_per_token=0.002)
    assert cost.record_extra_s(100) == pytest.approx((0.02 + 0.3) - (0.01 + 0.2) + 0.01)
    assert CostModel(0.02, 0.003, 0.0, 0.0).record_extra_s(100) == 0.0  # inference not measured
    assert CostModel.fixed("reuse").record_extra_s(100) == 0.0


def make_log(path, n, prompt_len=8):
    log = FeedbackLog(path)
    for i, (p, r) in enumerate(zip(token_lists([prompt_len] * n, seed=11),
                                   token_lists([3 + i % 4 for i in range(n)], seed=12))):
        log.add_response(f"r{i}", p, r, version=0)
    return log


def trainer(tmp_path, name, model, store, prefer, **cfg):
    cfg = OnlineTrainConfig(**{"output_dir": str(tmp_path / name), "save_steps": 0,
                               "cost_model": prefer, "learning_rate": 1e-3, **cfg})
    return OnlineTrainer(model, cfg, make_log(cfg.feedback_path, 6), store, tokenize=tokenize)


def test_reuse_trains_like_recompute_and_stale_evicted_or_missing_records_are_recomputed(tmp_path):
    a = trainer(tmp_path, "reuse", tiny_model(), RecordStore(), "reuse")
    b = trainer(tmp_path, "recompute", tiny_model(), RecordStore(), "recompute")
    resp = {i: a.feedback.response(f"r{i}") for i in range(6)}

    def record(i):
        return record_prompt(a.model, resp[i].prompt_ids, response_id=f"r{i}", version=a.version)

    old = record(1)  # made by version 0, to be used after step 1: stale
    a.store.put(record(0))
    a.store.put(old)
    for t in (a, b):
        t.feedback.append("r0", 1)
    step1 = a.train_step()
    b.train_step()
    assert [(d["action"], d["reason"]) for d in step1["decisions"]] == [("reuse", "record")]
    assert rel_err(grads(a.model), grads(b.model)) <= 1e-5

    b.model.load_state_dict(a.model.state_dict())  # same weights: compare the next gradients
    a.store = RecordStore(record_budget=2 * record(2).nbytes, record_host_budget=0)
    a.store.put(old)
    a.store.drop_older_than(a.version)  # what every step does: r1's record is now stale
    for i in (4, 2, 5):  # r4 oldest: evicted by r5
        a.store.put(record(i))
    for t in (a, b):
        for i in (1, 2, 3, 4):
            t.feedback.append(f"r{i}", 1)
        t.feedback.append("r5", 0, "a fix")  # a correction reuses the prompt's record
    step2 = a.train_step()
    b.train_step()
    assert [(d["response_id"], d["action"], d["reason"]) for d in step2["decisions"]] == [
        ("r1", "recompute", "stale"), ("r2", "reuse", "record"), ("r3", "recompute", "no_record"),
        ("r4", "recompute", "evicted"), ("r5", "reuse", "record")]
    assert rel_err(grads(a.model), grads(b.model)) <= 1e-5
    assert a.store.metrics()["stale"] == 1 and a.store.metrics()["evictions"] == 1
    m = a.metrics()
    assert (m["reuse"], m["recompute"], m["recompute:stale"], m["recompute:evicted"]) == (3, 3, 1, 1)
    assert a.feedback.pending() == [] and b.feedback.pending() == []


@pytest.mark.parametrize("kind", ["offloaded", "selective"])
def test_offloaded_and_selective_records_train_exactly(tmp_path, kind):
    a = trainer(tmp_path, "a", tiny_model(), RecordStore(), "reuse")
    b = trainer(tmp_path, "b", tiny_model(), RecordStore(), "recompute")
    recs = [record_prompt(a.model, a.feedback.response(f"r{i}").prompt_ids, response_id=f"r{i}",
                          version=0, selective=kind == "selective") for i in range(3)]
    size = recs[0].nbytes
    a.store = RecordStore(size if kind == "offloaded" else 10 * size, 10 * size)
    for r in recs:
        a.store.put(r)
    assert a.store.metrics()["offloads"] == (2 if kind == "offloaded" else 0)
    for t in (a, b):
        for i in range(3):
            t.feedback.append(f"r{i}", 1)
    step = a.train_step()
    b.train_step()
    assert [d["reason"] for d in step["decisions"]] == ["record"] * 3
    assert rel_err(grads(a.model), grads(b.model)) <= 1e-5


def test_stale_records_reused_with_max_staleness_stop_at_the_prompt(tmp_path):
    a = trainer(tmp_path, "a", tiny_model(), RecordStore(), "reuse", max_staleness=1)
    r = a.feedback.response("r0")
    a.feedback.append("r3", 1)
    a.train_step()
    a.store.put(record_prompt(a.model, r.prompt_ids, response_id="r0", version=0))
    a.feedback.append("r0", 1)
    step = a.train_step()  # the record is one version old: used, detached (else autograd refuses)
    assert step["decisions"][0]["reason"] == "record_stale"


CHILD = r"""
import sys
sys.path.insert(0, sys.argv[2])
from online_helpers import tiny_model
from reclaim.online.feedback import FeedbackLog
from reclaim.online.store import RecordStore
from reclaim.online.trainer import OnlineTrainConfig, OnlineTrainer
import time, torch
torch.set_num_threads(1)
cfg = OnlineTrainConfig(output_dir=sys.argv[1], per_device_train_batch_size=2, save_steps=3,
                        cost_model="recompute", learning_rate=1e-3)
t = OnlineTrainer(tiny_model(), cfg, FeedbackLog(cfg.feedback_path), RecordStore())
print("resumed", t.resume(), flush=True)
while (e := t.train_step()) is not None:
    print("step", e["step"], flush=True)
    time.sleep(0.02)
print("done", flush=True)
"""


def run_child(out, kill_after=None):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(out), str(HERE)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    steps = 0
    for line in proc.stdout:
        steps += line.startswith("step")
        if kill_after is not None and steps >= kill_after:
            os.kill(proc.pid, signal.SIGKILL)
            break
    _, err = proc.communicate()
    assert proc.returncode == (-signal.SIGKILL if kill_after else 0), err


def test_resume_after_a_lost_step_trains_each_feedback_once(tmp_path):
    """A restart after steps past the last checkpoint: those steps' feedback is trained again,
    once, and the weights equal an uninterrupted run's (the kill -9 version is marked slow)."""
    cfg = dict(per_device_train_batch_size=2, save_steps=2)
    runs = {}
    for name in ("crash", "plain"):
        t = trainer(tmp_path, name, tiny_model(), RecordStore(), "recompute", **cfg)
        for i in range(6):
            t.feedback.append(f"r{i}", 1)
        runs[name] = t
    crash = runs["crash"]
    for _ in range(3):  # checkpoint at step 2; step 3 is lost in the "crash"
        crash.train_step()
    again = OnlineTrainer(tiny_model(seed=1), crash.cfg, crash.feedback, RecordStore())
    assert again.resume() == 2 and [f.id for f in again.feedback.pending()] == [5, 6]
    for t in (again, runs["plain"]):
        while t.train_step():
            pass
    for p, q in zip(again.model.parameters(), runs["plain"].model.parameters()):
        torch.testing.assert_close(p, q)
    assert [f.trained_at_step for f in again.feedback.all()] == [1, 1, 2, 2, 3, 3]
    lines = (Path(crash.cfg.output_dir) / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == [1, 2, 3]  # step 3's line: the rerun's


def test_lora_checkpoint_is_servable_and_resumes_the_adapters(tmp_path):
    from reclaim.models.loading import load_checkpoint

    t = trainer(tmp_path, "lora", tiny_model(), RecordStore(), "reuse", lora_r=2,
                per_device_train_batch_size=2, save_steps=2, lora_target_modules=["q_proj", "up_proj"])
    assert {n for n, p in t.model.named_parameters() if p.requires_grad} == {
        f"model.layers.{i}.{m}.lora_{x}" for i in range(2)
        for m in ("self_attn.q_proj", "mlp.up_proj") for x in "AB"}
    for i in range(4):
        t.feedback.append(f"r{i}", 1)
    t.train_step(), t.train_step()
    path = Path(t.cfg.output_dir) / "checkpoint-2"
    ids = torch.tensor([token_lists([10], seed=9)[0]])
    with torch.no_grad():
        torch.testing.assert_close(load_checkpoint(path)(ids).logits, t.model(ids).logits)
    again = OnlineTrainer(tiny_model(), t.cfg, t.feedback, RecordStore())
    assert again.resume() == 2
    for p, q in zip(again.model.parameters(), t.model.parameters()):
        torch.testing.assert_close(p, q)
    plain = dict(t.cfg.__dict__, lora_r=0)
    with pytest.raises(ValueError, match="with LoRA adapters but lora_r=0"):
        OnlineTrainer(tiny_model(), OnlineTrainConfig(**plain), t.feedback, RecordStore()).resume()


@pytest.mark.slow
def test_kill_9_during_training_then_resume_trains_each_feedback_once(tmp_path):
    out, ref = tmp_path / "run", tmp_path / "ref"
    for d in (out, ref):
        log = make_log(d / "feedback.db", 24)
        for i in range(24):
            log.append(f"r{i}", 1)
        log.close()
    run_child(out, kill_after=5)  # checkpoint at step 3; steps 4-5 (and more) are lost
    run_child(out, kill_after=4)
    run_child(out)
    lines = [json.loads(ln) for ln in (out / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in lines] == list(range(1, 13))
    trained = [fid for e in lines for fid in e["feedback_ids"]]
    assert sorted(trained) == list(range(1, 25))  # each feedback exactly once
    log = FeedbackLog(out / "feedback.db")
    assert log.pending() == []
    assert {f.id: f.trained_at_step for f in log.all()} == {
        fid: e["step"] for e in lines for fid in e["feedback_ids"]}
    # the weights equal an uninterrupted run's
    cfg = OnlineTrainConfig(output_dir=str(ref), per_device_train_batch_size=2, save_steps=3,
                            cost_model="recompute", learning_rate=1e-3)
    plain = OnlineTrainer(tiny_model(), cfg, FeedbackLog(ref / "feedback.db"), RecordStore())
    while plain.train_step():
        pass
    resumed = OnlineTrainer(tiny_model(seed=1), cfg, log, RecordStore())
    resumed.out = out
    assert resumed.resume() == 12
    for p, q in zip(resumed.model.parameters(), plain.model.parameters()):
        torch.testing.assert_close(p, q)


def test_config_loads_bundled_and_refuses_bad_values():
    cfg = load_config(OnlineTrainConfig, "online-smollm2", ["--max_staleness", "1"])
    assert cfg.per_device_train_batch_size == 8 and cfg.max_staleness == 1 and cfg.prefix_grad
    with pytest.raises(ConfigError, match="record='some'; allowed: 'all', 'requested'"):
        load_config(OnlineTrainConfig, None, {"record": "some"})
    with pytest.raises(ConfigError, match="per_device_train_batch_size=0"):
        load_config(OnlineTrainConfig, None, {"per_device_train_batch_size": 0})
    with pytest.raises(ConfigError, match="bad size 'lots'"):
        load_config(OnlineTrainConfig, None, {"record_budget": "lots"})


def test_record_policy():
    assert record_policy("all")(False) and not record_policy("requested")(False)
    assert record_policy("requested")(True) and record_policy("fraction:0")(True)
    half = record_policy("fraction:0.5")
    picked = sum(half(False) for _ in range(1000))
    assert 400 < picked < 600
    with pytest.raises(ValueError, match="record='fraction:2'"):
        record_policy("fraction:2")


def test_micro_batches_of_one_give_the_whole_batchs_gradient(tmp_path):
    """A step run one sample per forward + backward (what co-located training uses) has the
    gradient of the step run as one batch, reused and recomputed samples alike."""
    whole = trainer(tmp_path, "whole", tiny_model(), RecordStore(), "reuse")
    ones = trainer(tmp_path, "ones", tiny_model(), RecordStore(), "reuse", micro_batch_size=1)
    for t in (whole, ones):
        for i in range(4):
            if i % 2 == 0:  # two reuse their records, two recompute
                r = t.feedback.response(f"r{i}")
                t.store.put(record_prompt(t.model, r.prompt_ids, response_id=f"r{i}", version=0))
            t.feedback.append(f"r{i}", 1)
    a, b = whole.train_step(), ones.train_step()
    assert [d["action"] for d in a["decisions"]] == ["reuse", "recompute"] * 2
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert rel_err(grads(whole.model), grads(ones.model)) <= 1e-5  # fp32 summation order
    with pytest.raises(ValueError, match="micro_batch_size=-1"):
        OnlineTrainConfig(micro_batch_size=-1)


def test_adamw_made_with_its_state_steps_as_torchs_own():
    """The trainer's AdamW holds its state from the start (no allocation in the first step
    between two serving steps) and steps exactly as torch's AdamW made the usual way."""
    from reclaim.optim import adamw

    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    ours = adamw(a, lr=1e-2, weight_decay=0.1)
    assert len(ours.state) == 2 and all(float(s["step"]) == 0 for s in ours.state.values())
    ref = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1)
    for k in range(3):
        for x, y in zip(a, b):
            x.grad = torch.full_like(x, 0.1 * (k + 1)) + x.detach()
            y.grad = x.grad.clone()
        ours.step()
        ref.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
    assert all(float(s["step"]) == 3 for s in ours.state.values())


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clipping_in_parts_equals_torchs_clip_grad_norm(max_norm):
    """Split into parts with a pause after each (a sliced step can stop inside the clipping),
    the clipping is torch's: the same total norm and, bitwise, the same scaled gradients."""
    from reclaim.online.trainer import clip_grad_norm_in_parts

    torch.manual_seed(0)
    a, b = tiny_model(), tiny_model()
    for pa, pb in zip(a.parameters(), b.parameters()):
        pa.grad = torch.randn_like(pa)
        pb.grad = pa.grad.clone()
    a.lm_head.weight.grad = None  # a parameter without a gradient is left out, as torch does
    b.lm_head.weight.grad = None
    want = torch.nn.utils.clip_grad_norm_(a.parameters(), max_norm)
    pauses = []
    got = clip_grad_norm_in_parts(list(b.parameters()), max_norm, pauses.append, parts=4)
    assert torch.equal(got, want) and pauses == ["clip"] * 8
    assert all(torch.equal(pa.grad, pb.grad) for pa, pb in zip(a.parameters(), b.parameters())
               if pa.grad is not None)


def test_report_to_tensorboard_gets_each_steps_numbers(tmp_path):
    from test_trackers import assert_log_in_tensorboard

    t = trainer(tmp_path, "run", tiny_model(), RecordStore(), "recompute", report_to="tensorboard",
                per_device_train_batch_size=2)
    for i in range(4):
        t.feedback.append(f"r{i}", 1)
    assert t.train_step()["step"] == 1 and t.train_step()["step"] == 2
    assert_log_in_tensorboard(tmp_path / "run", ("loss", "tokens", "seconds"), name="train_log.jsonl")


def test_a_restart_removes_the_temp_dir_of_a_save_killed_mid_write(tmp_path):
    from test_checkpoints import half_written_save

    (tmp_path / "run").mkdir()
    half_written_save(tmp_path / "run")
    t = trainer(tmp_path, "run", tiny_model(), RecordStore(), "recompute")
    assert [p.name for p in t.out.iterdir() if p.name.startswith(".checkpoint")] == []
