"""Drafter training: the loss goes down, the target stays frozen, the buffer keeps the newest,
the engine's hidden states are the target's, a resumed run equals an uninterrupted one, the CLI
runs end to end, and (slow) a trained drafter gets tau > 2 on held-out prompts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from rl_helpers import fixed_depth, tiny_target
from typer.testing import CliRunner

from reclaim.config import ConfigError, load_config
from reclaim.engine.engine import Engine
from reclaim.engine.request import SamplingParams
from reclaim.checkpoints import checkpoints
from reclaim.drafter.acceptance import greedy_acceptance
from reclaim.drafter.data import DrafterBuffer, DrafterSample, HiddenRecorder, collect
from reclaim.drafter.loss import train_drafter
from reclaim.drafter.train import DrafterTrainConfig, train
from reclaim.models.drafter import load_drafter, new_drafter


@torch.no_grad()
def greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture
def target():
    return tiny_target(64)


def rollouts(model, n: int, seed: int = 1, prompt_len: int = 6, response_len: int = 16):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, model.config.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(n)]
    return prompts, [greedy(model, p, response_len) for p in prompts]


def sample(t: int, h: int = 4) -> DrafterSample:
    mask = torch.zeros(t, dtype=torch.bool)
    mask[t // 2:] = True
    return DrafterSample(torch.arange(t), torch.randn(t, h), mask)


@pytest.mark.parametrize("bf16", [False, True])
def test_loss_decreases_and_the_target_gets_no_gradient(target, one_thread, bf16):
    before = {k: v.clone() for k, v in target.state_dict().items()}
    buf = DrafterBuffer(100_000)
    buf.add(collect(target, *rollouts(target, 16)))
    torch.manual_seed(0)
    drafter = new_drafter(target)
    if bf16:  # under autocast the first step's loss is float32's to bfloat16 precision
        torch.manual_seed(0)
        ref = train_drafter(new_drafter(target), target, buf, steps=1, lr=3e-3, batch_size=4, seed=0)[0]
    recs = train_drafter(drafter, target, buf, steps=40, lr=3e-3, batch_size=4, seed=0, bf16=bf16)
    if bf16:
        assert recs[0]["loss"] == pytest.approx(ref["loss"], rel=2e-2) and recs[0]["loss"] != ref["loss"]
        assert all(p.dtype == torch.float32 for p in drafter.parameters())
    first = sum(r["loss"] for r in recs[:5]) / 5
    last = sum(r["loss"] for r in recs[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert recs[-1]["accuracy"] > recs[0]["accuracy"]
    assert all(p.grad is None for p in target.parameters())  # requires_grad is still True here
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())


def test_an_optimizer_over_target_weights_is_refused(target):
    buf = DrafterBuffer(1000)
    buf.add(collect(target, *rollouts(target, 2)))
    drafter = new_drafter(target)
    opt = torch.optim.AdamW(list(drafter.parameters()) + list(target.lm_head.parameters()))
    with pytest.raises(ValueError, match="not the drafter's"):
        train_drafter(drafter, target, buf, steps=1, optimizer=opt)


def test_buffer_keeps_the_newest_within_its_token_budget():
    buf = DrafterBuffer(max_tokens=25)
    assert buf.add([sample(10), sample(10)]) == 0
    newest = sample(8)
    assert buf.add([newest]) == 1  # 28 > 25: the oldest goes
    assert len(buf) == 2 and buf.num_tokens == 18 and buf[-1] is newest
    assert buf.add([sample(12)]) == 1 and buf.num_tokens == 20
    with pytest.raises(ValueError, match="exceeds the buffer's budget of 25"):
        buf.add([sample(26)])
    with pytest.raises(ValueError, match="response token"):
        DrafterSample(torch.arange(4), torch.zeros(4, 2), torch.tensor([True, False, False, False]))


def test_batches_respect_sizes_and_depend_only_on_seed_and_step():
    buf = DrafterBuffer(10_000)
    buf.add([sample(t) for t in (5, 9, 12, 20, 7, 30)])
    for step in range(5):
        b = buf.batch(step, seed=3, batch_size=3, batch_tokens=40)
        assert 1 <= len(b) <= 3 and (len(b) == 1 or max(s.num_tokens for s in b) * len(b) <= 40)
        assert [id(s) for s in b] == [id(s) for s in buf.batch(step, 3, 3, 40)]


def test_engine_hidden_states_are_the_targets_forward(target, one_thread):
    a, b, c = rollouts(target, 3)[0]
    # Prompts with common prefixes: the engine shares their blocks instead of computing them.
    prompts = [a + b, a + [5, 6, 7] + c, a + [5, 6, 7] + c[:5] + b]
    rec = HiddenRecorder()
    engine = Engine(target, None, max_num_seqs=3, max_model_len=64, on_forward=rec, block_size=4)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    assert engine.stats().get("num_shared_prefix_tokens", 1) > 0
    got = rec.samples([(o.request_id, o.prompt_token_ids, o.token_ids) for o in outs])
    want = collect(target, prompts, [o.token_ids[:-1] for o in outs])
    for x, y in zip(got, want):
        assert torch.equal(x.token_ids, y.token_ids) and torch.equal(x.loss_mask, y.loss_mask)
        torch.testing.assert_close(x.hidden, y.hidden, atol=1e-4, rtol=1e-4)
    if engine.stats().get("num_shared_prefix_tokens"):
        with pytest.raises(ValueError, match="were not recorded"):  # alone, its shared prefix is unknown
            rec.samples([(outs[2].request_id, outs[2].prompt_token_ids, outs[2].token_ids)])


def test_greedy_acceptance_counts_tokens_per_verify(target):
    samples = collect(target, *rollouts(target, 3, response_len=12))
    drafter = new_drafter(target)
    r = greedy_acceptance(drafter, target, samples, 4)
    # Every response token after the first is committed by exactly one verify (accepted or bonus).
    assert r["accepted"] + r["verifies"] == sum(int(s.loss_mask.sum()) - 1 for s in samples)
    assert 1.0 <= r["tau"] <= 5.0


# ---- the command: config, checkpoints, resume --------------------------------------------------

TINY_RUN = dict(prompts="tasks", num_prompts=6, eval_prompts=2, max_new_tokens=8, generation_batch_size=8,
                max_steps=6, per_device_train_batch_size=2, learning_rate=3e-3, warmup_steps=2,
                logging_steps=1, save_steps=3, seed=5)


def test_resume_from_a_checkpoint_equals_an_uninterrupted_run(tiny_model_dir, tmp_path, one_thread):
    a = tmp_path / "a"
    cfg = load_config(DrafterTrainConfig, None, {**TINY_RUN, "model": str(tiny_model_dir), "output_dir": str(a)})
    train(cfg, progress=False, log=lambda s: None)
    assert [p.name for p in checkpoints(a)] == ["checkpoint-3", "checkpoint-6"]
    # A crash after checkpoint-3: its later checkpoint and final weights are gone, its log ran on.
    b = tmp_path / "b"
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoint-6")
    (b / "model.safetensors").unlink()
    resumed = load_config(DrafterTrainConfig, None, {**TINY_RUN, "model": str(tiny_model_dir), "output_dir": str(b),
                                                     "resume_from_checkpoint": True})
    train(resumed, progress=False, log=lambda s: None)
    state = json.loads((b / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    assert [json.loads(ln)["step"] for ln in (b / "log.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    target, _ = _load(tiny_model_dir)
    da, db = load_drafter(a, target), load_drafter(b, target)
    for (k, va), vb in zip(da.state_dict().items(), db.state_dict().values()):
        torch.testing.assert_close(va, vb, atol=1e-6, rtol=1e-5, msg=k)
    assert (b / "log.jsonl").read_text() != ""
    la = [json.loads(ln)["loss"] for ln in (a / "log.jsonl").read_text().splitlines()]
    lb = [json.loads(ln)["loss"] for ln in (b / "log.jsonl").read_text().splitlines()]
    assert la == pytest.approx(lb, rel=1e-5)


def _load(path):
    from reclaim.models.loading import load_model

    return load_model(path)


def test_cli_trains_checkpoints_and_resumes(tiny_model_dir, tmp_path, one_thread):
    from reclaim.cli import app

    cfg_file = tmp_path / "tiny.yaml"
    out = tmp_path / "run"
    cfg_file.write_text("".join(f"{k}: {v}\n" for k, v in {**TINY_RUN, "max_steps": 4, "save_steps": 2}.items()))
    base = ["drafter", "train", "--config", str(cfg_file), "--model", str(tiny_model_dir), "--output_dir", str(out)]
    r = CliRunner().invoke(app, base)
    assert r.exit_code == 0, r.output
    assert "held-out greedy tau" in r.output and "target answered 6 of 6 training prompts" in r.output
    assert {"config.json", "model.safetensors", "log.jsonl", "eval.json", "rollouts", "train_config.json",
            "checkpoint-2", "checkpoint-4"} <= {p.name for p in out.iterdir()}
    ck = out / "checkpoint-4"
    assert {"config.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= {
        p.name for p in ck.iterdir()}
    rec = json.loads((out / "log.jsonl").read_text().splitlines()[-1])
    assert {"loss", "reg_loss", "ce_loss", "accuracy", "learning_rate"} <= set(rec)
    r = CliRunner().invoke(app, base + ["--resume", "--max_steps", "6"])
    assert r.exit_code == 0, r.output
    assert "target answered" not in r.output  # the rollouts are read back, not generated again
    assert json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())["global_step"] == 6
    assert [json.loads(ln)["step"] for ln in (out / "log.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    target, _ = _load(tiny_model_dir)
    load_drafter(out, target)


def test_a_bad_config_field_is_named(tmp_path):
    from reclaim.cli import app

    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rat: 1e-3\n")
    with pytest.raises(ConfigError, match="'learning_rat': did you mean 'learning_rate'"):
        load_config(DrafterTrainConfig, bad)
    r = CliRunner().invoke(app, ["drafter", "train", "--config", str(bad)])
    assert r.exit_code == 2 and "learning_rat" in r.output
    with pytest.raises(ConfigError, match="prompts 'nope'"):
        load_config(DrafterTrainConfig, None, {"prompts": "nope"})
    with pytest.raises(ConfigError, match="ce_vocab"):
        load_config(DrafterTrainConfig, None, ["--ce_vocab", "some"])
    assert load_config(DrafterTrainConfig, "drafter-smollm2").max_steps >= 1  # the bundled config loads


# ---- acceptance: the replay against the engine, and the oracle -------------------------

def _engine_tau(target, drafter, prompts, max_tokens: int, tmp_path, k: int = 4):
    """Greedy outputs and tau of the engine's own EAGLE speculation with `drafter`."""
    from reclaim.models.drafter import save_drafter

    path = save_drafter(drafter, tmp_path / "drafter")
    engine = Engine(target, None, max_num_seqs=16, max_model_len=128, speculative=fixed_depth(
        method="eagle", model=str(path), num_speculative_tokens=k, max_batch=16))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    st = engine.stats()
    return [o.token_ids for o in outs], (st["spec_accepted"] + st["spec_verifies"]) / st["spec_verifies"]


def _rollout_samples(target, prompts, max_tokens: int, tok=None, ignore_eos: bool = True):
    """Greedy answers and their samples (None for a one-token answer)."""
    rec = HiddenRecorder()
    engine = Engine(target, tok, max_num_seqs=16, max_model_len=max(128, max(map(len, prompts)) + max_tokens),
                    on_forward=rec)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos))
    samples = iter(rec.samples([(o.request_id, o.prompt_token_ids, o.token_ids) for o in outs if len(o.token_ids) > 1]))
    return [next(samples) if len(o.token_ids) > 1 else None for o in outs], [o.token_ids for o in outs]


@pytest.mark.parametrize("draft_vocab", [None, 8])
def test_the_replayed_tau_is_what_the_engine_gets(target, tmp_path, one_thread, draft_vocab):
    """Also over a draft vocabulary (the engine's proposer scores only those head rows)."""
    prompts, _ = rollouts(target, 6, response_len=0)
    samples, plain = _rollout_samples(target, prompts, 12)
    buf = DrafterBuffer(10_000)
    buf.add(samples)
    drafter = new_drafter(target)
    train_drafter(drafter, target, buf, steps=30, lr=3e-3, batch_size=4)
    if draft_vocab:
        from reclaim.models.drafter import most_frequent

        drafter.draft_ids = most_frequent([s.token_ids.tolist() for s in samples], draft_vocab, 64)
    replay = greedy_acceptance(drafter, target, samples, 4)
    outs, tau = _engine_tau(target, drafter, prompts, 12, tmp_path)
    assert outs == plain
    assert replay["tau"] == pytest.approx(tau, rel=0.02)


def induction_target(steps: int = 400, vocab: int = 32, seed: int = 0, layers: int = 2):
    """A fixed, predictable target: a tiny Llama trained to continue a repeated random pattern
    (it learns induction: copy what followed the last occurrence). Held-out prompts are fresh
    patterns, so a drafter has to learn the copying, not memorise sequences."""
    from reclaim.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512, eos_token_id=None))
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        x = torch.stack([pattern(g, vocab, 40) for _ in range(32)])
        loss = F.cross_entropy(model(x).logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval().requires_grad_(False)


def pattern(g: torch.Generator, vocab: int, length: int) -> torch.Tensor:
    n = int(torch.randint(3, 8, (1,), generator=g))
    return torch.randint(1, vocab, (n,), generator=g).repeat(length // n + 1)[:length]


@pytest.mark.slow
def test_a_trained_drafter_accepts_more_than_two_tokens_per_verify(tmp_path, one_thread):
    """The issue's oracle: mean accepted length tau > 2 (bonus token included) on held-out
    prompts, measured by the engine's own EAGLE speculation. Measured: tau 3.71 (k = 4; untrained 1.04)."""
    target = induction_target()
    g = torch.Generator().manual_seed(1)
    prompts = [pattern(g, 32, 40)[:int(torch.randint(5, 10, (1,), generator=g))].tolist() for _ in range(288)]
    samples, plain = _rollout_samples(target, prompts, 32)
    buf = DrafterBuffer(100_000)
    buf.add(samples[:256])
    torch.manual_seed(0)
    drafter = new_drafter(target)
    from reclaim.drafter.loss import make_optimizer
    from reclaim.schedule import lr_scheduler

    opt = make_optimizer(drafter, 3e-3)
    train_drafter(drafter, target, buf, steps=300, optimizer=opt, batch_size=8, unroll_steps=2,
                  scheduler=lr_scheduler(opt, "cosine", warmup_steps=10, total_steps=300))
    before = greedy_acceptance(new_drafter(target), target, samples[256:], 4)["tau"]
    outs, tau = _engine_tau(target, drafter, prompts[256:], 32, tmp_path)
    assert outs == plain[256:]  # lossless
    replay = greedy_acceptance(drafter, target, samples[256:], 4)["tau"]
    print(f"held-out tau: engine {tau:.2f}, replay {replay:.2f}, untrained {before:.2f}")
    assert before < 1.3
    assert tau > 2 and replay > 2


def test_the_default_drafter_is_trained_once_then_found_in_the_cache(tiny_model_dir, tmp_path, monkeypatch,
                                                                     one_thread):
    import reclaim.models.loading as loading
    import reclaim.drafter.bundled as bundled

    monkeypatch.setenv("RECLAIM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "default_model_dir", lambda: tiny_model_dir)
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text("".join(f"{k}: {v}\n" for k, v in {**TINY_RUN, "save_steps": 0}.items()))
    monkeypatch.setattr(bundled, "DEFAULT_DRAFTER_CONFIG", str(tiny))
    said: list[str] = []
    path = bundled.default_drafter_dir(log=said.append, progress=False)
    assert path == tmp_path / "cache" / "drafters" / tiny_model_dir.name
    info = json.loads((path / "train_info.json").read_text())
    assert info["total_s"] > 0 and info["eval"]["tau"] >= 1 and any("trained in" in s for s in said)
    target, _ = _load(tiny_model_dir)
    load_drafter(path, target)
    said.clear()
    assert bundled.default_drafter_dir(log=said.append) == path and said == []  # found, not trained again


def test_rollouts_are_saved_in_parts_and_a_resumed_run_answers_only_the_missing_ones(tiny_model_dir, tmp_path,
                                                                                     one_thread):
    """rollout_chunk prompts a part; rollout_dtype answers the training prompts with the target
    cast to it (the held-out ones with the target itself): each part holds exactly what that
    model's engine answers and records. A part lost in a crash is answered again, alone, the same."""
    import copy

    from reclaim.models.tokenizer import encode_chat
    from reclaim.data.tasks import make_prompts

    out = tmp_path / "run"
    over = {**TINY_RUN, "model": str(tiny_model_dir), "output_dir": str(out), "rollout_chunk": 2,
            "rollout_dtype": "bfloat16", "max_steps": 2, "save_steps": 0}
    lines: list[str] = []
    train(load_config(DrafterTrainConfig, None, over), progress=False, log=lines.append)
    assert sum("target answered" in s for s in lines) == 3 and "target answered 6 of 6" in lines[2]
    parts = out / "rollouts"
    assert sorted(p.name for p in parts.iterdir()) == ["eval.pt", "part-00000.pt", "part-00001.pt", "part-00002.pt"]
    target, tok = _load(tiny_model_dir)
    texts = make_prompts("tasks", 8, 5)
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in texts]
    low = copy.deepcopy(target).to(torch.bfloat16)
    for model, dtype, name, idx in ((low, torch.bfloat16, "part-00000.pt", [0, 1]),
                                    (low, torch.bfloat16, "part-00001.pt", [2, 3]),
                                    (low, torch.bfloat16, "part-00002.pt", [4, 5]),
                                    (target, torch.float32, "eval.pt", [6, 7])):
        saved = torch.load(parts / name)
        samples, answers = _rollout_samples(model, [prompts[i] for i in idx], 8, tok=tok, ignore_eos=False)
        assert len(saved) == len(idx) and any(d is not None for d in saved)
        for d, s, a, i in zip(saved, samples, answers, idx):
            assert (d is None) == (s is None)  # a one-token answer: nothing to learn
            if d is not None:
                assert d["token_ids"].tolist() == prompts[i] + a[:-1] and d["hidden"].dtype == dtype
                torch.testing.assert_close(d["hidden"], s.hidden)
    before = torch.load(parts / "part-00001.pt")
    (parts / "part-00001.pt").unlink()
    lines.clear()
    train(load_config(DrafterTrainConfig, None, {**over, "resume_from_checkpoint": True, "max_steps": 3}),
          progress=False, log=lines.append)
    assert [s for s in lines if "target answered" in s] == [next(s for s in lines if "answered 4 of 6" in s)]
    for a, b in zip(before, torch.load(parts / "part-00001.pt")):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a["token_ids"], b["token_ids"]) and torch.equal(a["hidden"], b["hidden"])


def test_a_resume_with_nothing_saved_and_a_bad_rollout_dtype_are_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="neither a checkpoint-"):
        train(load_config(DrafterTrainConfig, None, {**TINY_RUN, "model": str(tiny_model_dir),
                                                      "output_dir": str(tmp_path / "none"),
                                                      "resume_from_checkpoint": True}), progress=False)
    with pytest.raises(ConfigError, match="'fp8'"):
        load_config(DrafterTrainConfig, None, {"rollout_dtype": "fp8"})


def test_report_to_tensorboard_gets_the_logged_metrics(tiny_model_dir, tmp_path, one_thread):
    from test_trackers import assert_log_in_tensorboard

    over = {**TINY_RUN, "max_steps": 2, "eval_prompts": 0, "model": str(tiny_model_dir), "output_dir": str(tmp_path),
            "report_to": ["tensorboard"]}
    train(load_config(DrafterTrainConfig, None, over), progress=False, log=lambda s: None)
    assert_log_in_tensorboard(tmp_path, ("loss", "reg_loss", "ce_loss", "accuracy", "learning_rate"))
