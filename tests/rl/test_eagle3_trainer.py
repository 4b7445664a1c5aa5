"""EAGLE-3 training: the training-time test sees what drafting sees, the token loss goes down with
the target frozen, `reclaim drafter train` runs it from the target's answers and from prefill over
existing text (checkpoints, log, resume, the EAGLE-3 layout), bad configs are named, and (slow)
a trained EAGLE-3 drafter's held-out tau against an EAGLE-2 drafter trained on the same data."""

from __future__ import annotations

import json

import pytest
import torch
from rl_helpers import tiny_target
from test_drafter_trainer import induction_target, pattern, rollouts
from typer.testing import CliRunner

from reclaim.config import ConfigError, load_config
from reclaim.models.cache import DenseCache
from reclaim.models.drafter import new_drafter
from reclaim.models.eagle3 import load_eagle3, new_eagle3
from reclaim.drafter.acceptance import greedy_acceptance
from reclaim.drafter.data import DrafterBuffer, collect
from reclaim.drafter.eagle3 import (
    Eagle3TrainConfig, eagle3_acceptance, eagle3_loss, train_command, ttt_states, with_aux,
)
from reclaim.drafter.loss import make_optimizer, train_drafter
from reclaim.schedule import lr_scheduler

AUX = (0, 1, 2)


@pytest.fixture
def target():
    return tiny_target(64, num_hidden_layers=3)


def samples_of(model, n: int, seed: int = 1, response_len: int = 16):
    return with_aux(model, collect(model, *rollouts(model, n, seed=seed, response_len=response_len)), AUX)


def test_training_time_test_sees_what_drafting_sees(target, one_thread):
    """Step k's state at row i equals a chain drafted after x_{i+1} over the true prefix, fed the
    sequence's own next tokens and the drafter's own states (what the engine's proposer does)."""
    torch.manual_seed(3)
    drafter = new_eagle3(target, AUX).eval()
    s = samples_of(target, 1)[0]
    emb = target.model.embed_tokens
    with torch.no_grad():
        steps = list(ttt_states(drafter, emb(s.token_ids[None, 1:]), s.aux[None, :-1], 4))
        for i in (0, 3, 9):
            cache = DenseCache()
            g = drafter(emb(s.token_ids[None, 1:i + 2]), s.aux[None, :i + 1], torch.arange(i + 1)[None], cache)[:, -1:]
            for k in range(4):
                torch.testing.assert_close(steps[k][0, i], g[0, 0], atol=1e-5, rtol=1e-5, msg=f"row {i} step {k}")
                g = drafter(emb(s.token_ids[None, i + 2 + k:i + 3 + k]), g, torch.tensor([[i + 1 + k]]), cache)


def test_loss_decreases_and_the_target_gets_no_gradient(target, one_thread):
    before = {k: v.clone() for k, v in target.state_dict().items()}
    buf = DrafterBuffer(100_000)
    buf.add(samples_of(target, 16))
    torch.manual_seed(0)
    drafter = new_eagle3(target, AUX, draft_ids=torch.arange(3, 64))
    recs = train_drafter(drafter, target, buf, steps=40, lr=3e-3, batch_size=4,
                         loss_fn=lambda b: eagle3_loss(drafter, target, b, ttt_steps=3))
    first, last = sum(r["loss"] for r in recs[:5]) / 5, sum(r["loss"] for r in recs[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert {"ce_0", "ce_2", "acc_0", "acc_2", "tokens"} <= set(recs[-1])
    assert all(p.grad is None for p in target.parameters())
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), k


TINY = dict(drafter_type="eagle3", prompts="tasks", num_prompts=6, eval_prompts=2, max_new_tokens=8,
            generation_batch_size=8, max_steps=4, per_device_train_batch_size=2, learning_rate=3e-3,
            warmup_steps=1, logging_steps=1, save_steps=2, seed=5, ttt_steps=3, aux_layers="[0, 1, 1]")


def test_cli_trains_eagle3_from_answers_then_resumes(tiny_model_dir, tmp_path, one_thread):
    from reclaim.cli import app
    from reclaim.models.loading import load_model

    cfg_file, out = tmp_path / "e3.yaml", tmp_path / "run"
    cfg_file.write_text("".join(f"{k}: {v}\n" for k, v in {**TINY, "baseline_eagle2": "true"}.items()))
    base = ["drafter", "train", "--config", str(cfg_file), "--model", str(tiny_model_dir), "--output_dir", str(out)]
    r = CliRunner().invoke(app, base)
    assert r.exit_code == 0, r.output
    assert "held-out greedy tau" in r.output and "answers data" in r.output
    assert {"config.json", "model.safetensors", "log.jsonl", "eval.json", "checkpoint-2", "checkpoint-4",
            "eagle2"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    ev = json.loads((out / "eval.json").read_text())
    assert ev["aux_layers"] == [0, 1, 1] and ev["data"]["source"] == "answers"
    assert ev["data"]["decode_ms_per_token"] > 0 and ev["data"]["forward_ms_per_token"] > 0
    assert "tau" in ev["eval"] and "tau" in ev["eagle2"]["eval"]
    rec = json.loads((out / "log.jsonl").read_text().splitlines()[-1])
    assert {"loss", "ce_loss", "accuracy", "learning_rate", "tokens"} <= set(rec)
    r = CliRunner().invoke(app, base + ["--resume", "--max_steps", "6", "--baseline_eagle2", "false"])
    assert r.exit_code == 0, r.output
    assert "target answered" not in r.output  # the answers are read back
    assert [json.loads(ln)["step"] for ln in (out / "log.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    target, _ = load_model(tiny_model_dir)
    assert load_eagle3(out / "checkpoint-6", target).aux_layers == (0, 1, 1)


def test_prefill_over_existing_text(tiny_model_dir, tmp_path, monkeypatch, one_thread):
    from reclaim.drafter.eagle3 import train_eagle3

    monkeypatch.setenv("RECLAIM_CACHE", str(tmp_path / "cache"))  # the corpus's token cache
    text = tmp_path / "text.txt"
    text.write_text("Compute 12 + 7 - 3. Show your steps. Explain gravity in simple terms.\n" * 40)
    cfg = load_config(Eagle3TrainConfig, None, {**{k: v for k, v in TINY.items() if k != "aux_layers"},
                                                "aux_layers": [0, 1, 1], "model": str(tiny_model_dir),
                                                "output_dir": str(tmp_path / "run"), "data": "prefill",
                                                "prefill_corpus": str(text), "prefill_sequences": 6,
                                                "prefill_seq_len": 32})
    summary = train_eagle3(cfg, progress=False, log=lambda s: None)
    assert summary["data"]["source"] == f"prefill:{text}"
    assert summary["train_sequences"] == 6 and summary["data"]["tokens"] == summary["data"]["loss_tokens"] == 6 * 32
    assert summary["eval"]["verifies"] > 0  # the held-out prompts are still the target's answers


def test_bad_configs_are_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("drafter_type: eagle4\n")
    with pytest.raises(ConfigError, match=r"drafter_type 'eagle4' is not one of \['eagle', 'eagle3'\]"):
        train_command(str(bad), [])
    assert train_command(str(bad), ["--drafter_type", "eagle3"])[0] is Eagle3TrainConfig
    assert train_command(None, [])[0].__name__ == "DrafterTrainConfig"
    with pytest.raises(ConfigError, match=r"data 'decode' is not one of \['answers', 'prefill'\]"):
        load_config(Eagle3TrainConfig, None, {"data": "decode"})
    with pytest.raises(ConfigError, match="ttt_steps must be >= 1"):
        load_config(Eagle3TrainConfig, None, {"ttt_steps": 0})
    with pytest.raises(ConfigError, match="unknown DrafterTrainConfig field.*ttt_steps"):
        load_config(train_command(None, [])[0], None, {"ttt_steps": 3})
    cls, _ = train_command("drafter-smollm2-eagle3", [])  # the bundled config loads as EAGLE-3's
    assert cls is Eagle3TrainConfig and load_config(cls, "drafter-smollm2-eagle3").aux_layers == [2, 15, 27]


@pytest.mark.slow
def test_eagle3_tau_against_eagle2_on_the_same_data(tmp_path, one_thread):
    """Held-out greedy tau (k = 4) of EAGLE-3 (5 training-time-test steps) and EAGLE-2 (2 unrolled
    passes), both 300 steps on the same samples of a 4-layer induction target, the states entering
    layers 0, 2 and 3 (the embeddings, the middle, the last layer's input). Measured: EAGLE-3 3.84,
    EAGLE-2 3.04 (on the 2-layer target, whose last layer's output no aux layer holds: 3.06 and 3.71)."""
    target = induction_target(layers=4)
    g = torch.Generator().manual_seed(1)
    prompts = [pattern(g, 32, 40)[:int(torch.randint(5, 10, (1,), generator=g))].tolist() for _ in range(288)]
    from test_drafter_trainer import _rollout_samples

    got, _ = _rollout_samples(target, prompts, 32)
    samples = with_aux(target, got, (0, 2, 3))
    buf = DrafterBuffer(100_000)
    buf.add(samples[:256])

    def fit(drafter, **loss):
        opt = make_optimizer(drafter, 3e-3)
        train_drafter(drafter, target, buf, steps=300, optimizer=opt, batch_size=8,
                      scheduler=lr_scheduler(opt, "cosine", warmup_steps=10, total_steps=300), **loss)
        return drafter

    torch.manual_seed(0)
    e2 = fit(new_drafter(target), unroll_steps=2)
    torch.manual_seed(0)
    e3 = new_eagle3(target, (0, 2, 3))
    fit(e3, loss_fn=lambda b: eagle3_loss(e3, target, b, ttt_steps=5))
    tau2 = greedy_acceptance(e2, target, samples[256:], 4)["tau"]
    tau3 = eagle3_acceptance(e3, target, samples[256:], 4)["tau"]
    print(f"held-out tau: EAGLE-3 {tau3:.2f}, EAGLE-2 {tau2:.2f}")
    assert tau3 > 2 and tau3 > tau2
