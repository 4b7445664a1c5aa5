"""ssm-train: every gradient mode trains, resume reproduces the uninterrupted run, configs load."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reclaim.config import bundled_configs, load_config
from reclaim.ssm import train as T

TINY = dict(d_model=16, n_layer=2, d_state=4, context_length=48, chunk_size=10, loss_chunk=16,
            learning_rate=1e-2, max_steps=4, logging_steps=1)


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    # Each random token appears twice in a row: something to learn, so the loss can fall.
    return torch.randint(0, 40, (2000,), generator=torch.Generator().manual_seed(0),
                         dtype=torch.int32).repeat_interleave(2)


def load(path_or_name=None, overrides=None) -> T.SSMTrainConfig:
    return load_config(T.SSMTrainConfig, path_or_name, overrides)


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "log.jsonl").read_text().splitlines()]


def test_modes_agree_on_the_first_step_and_loss_falls(tmp_path, tokens) -> None:
    first = {}
    runs = [(mode, "chunk") for mode in T.GRAD_MODES] + [("adjoint", "layer")]
    for mode, recompute in runs:
        name = f"{mode}-{recompute}" if recompute != "chunk" else mode
        cfg = T.SSMTrainConfig(output_dir=str(tmp_path / name), grad_mode=mode,
                               window=10_000 if mode == "truncated" else None,
                               adjoint_recompute=recompute, **{**TINY, "max_steps": 5})
        records = T.train(cfg, tokens=tokens, progress=False)
        assert [r["step"] for r in records] == list(range(1, 6))
        assert records[-1]["loss"] < records[0]["loss"]
        first[name] = [r["loss"] for r in records[:2]]
    # Same init and data, and every mode's gradient is backprop's (truncated with T-bar >= T):
    # so the first two losses agree across modes.
    for mode, losses in first.items():
        assert losses == pytest.approx(first["backprop"], rel=1e-4), mode


def test_resume_gives_the_losses_of_an_uninterrupted_run(tmp_path, tokens) -> None:
    cfg = T.SSMTrainConfig(output_dir=str(tmp_path), grad_mode="adjoint", save_steps=2,
                           gradient_accumulation_steps=2, **TINY)
    T.train(cfg, tokens=tokens, progress=False)
    full = _log(tmp_path)
    assert [p.name for p in T.checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4"]
    ckpt = tmp_path / "checkpoint-4"
    assert {"config.json", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= {
        p.name for p in ckpt.iterdir()}
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == 4
    shutil.rmtree(ckpt)  # as if the run died after step 4's log line, before its checkpoint
    resumed = T.train(load(None, {**dataclasses.asdict(cfg),
                                           "resume_from_checkpoint": True}),
                      tokens=tokens, progress=False)
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[2:]]
    assert [r["loss"] for r in _log(tmp_path)] == [r["loss"] for r in full]  # log trimmed, then appended


def test_resume_with_another_model_shape_is_refused_by_name(tmp_path, tokens) -> None:
    cfg = T.SSMTrainConfig(output_dir=str(tmp_path), **{**TINY, "max_steps": 1})
    T.train(cfg, tokens=tokens, progress=False)
    wider = load(None, {**dataclasses.asdict(cfg), "d_model": 2 * TINY["d_model"], "resume_from_checkpoint": True})
    with pytest.raises(ValueError, match=r"holds 'backbone\.embeddings\.weight' of shape \[\d+, 16\]; this "
                                         r"config's model has \[\d+, 32\]"):
        T.train(wider, tokens=tokens, progress=False)


def test_resume_without_checkpoint_names_the_directory(tmp_path, tokens) -> None:
    cfg = T.SSMTrainConfig(output_dir=str(tmp_path / "empty"), resume_from_checkpoint=True, **TINY)
    with pytest.raises(ValueError, match="empty"):
        T.train(cfg, tokens=tokens, progress=False)


def test_config_files_load_and_overrides_coerce() -> None:
    ssm = [name for name in bundled_configs() if name.startswith("ssm-")]
    assert {"ssm-tiny", "ssm-64k", "ssm-128k-time"} <= set(ssm)
    for name in ssm:
        load(name)
    cfg = load("ssm-tiny", ["--learning-rate", "3e-4", "--window=64", "--grad_mode", "truncated",
                            "--resume_from_checkpoint"])
    assert (cfg.learning_rate, cfg.window, cfg.grad_mode, cfg.resume_from_checkpoint) == (
        3e-4, 64, "truncated", True)
    with pytest.raises(ValueError, match="learning_rte"):
        load(None, {"learning_rte": 1})
    with pytest.raises(ValueError, match="'sgd'"):
        load(None, {"grad_mode": "sgd"})
    with pytest.raises(ValueError, match="window"):
        load(None, {"grad_mode": "truncated"})
    with pytest.raises(ValueError, match="adjoint_recompute 'all' is not one of"):
        load(None, {"adjoint_recompute": "all"})


def _char_corpus(tmp_path: Path, config: str) -> list[str]:
    """A text file, a character-level tokenizer directory and a config file of `config` lines;
    returns the ssm-train arguments that use them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "[UNK]": 1} | {c: i + 2 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="[UNK]").save_pretrained(
        tmp_path / "tok")
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog " * 40)
    (tmp_path / "c.yaml").write_text(config)
    return ["--config", str(tmp_path / "c.yaml"), "--corpus", str(tmp_path / "text.txt"),
            "--tokenizer", str(tmp_path / "tok")]


def _cli(tmp_path: Path, launcher: list[str], args: list[str]) -> None:
    proc = subprocess.run([*launcher, "-m", "reclaim.cli", "ssm-train", *args],
                          capture_output=True, text=True,
                          env={**os.environ, "RECLAIM_CACHE": str(tmp_path / "cache"),
                               "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_cli_trains_from_a_config_file(tmp_path) -> None:
    """`reclaim ssm-train` end to end on a small text corpus with a tokenizer directory."""
    args = _char_corpus(tmp_path, "d_model: 16\nn_layer: 2\nd_state: 4\ncontext_length: 64\n"
                                  "chunk_size: 16\nmax_steps: 2\nlearning_rate: 1.0e-2\n")
    out = tmp_path / "run"
    _cli(tmp_path, [sys.executable], [*args, "--grad-mode", "adjoint", "--output_dir", str(out)])
    assert [r["step"] for r in _log(out)] == [1, 2]
    assert (out / "checkpoint-2" / "tokenizer.json").exists()


@pytest.mark.slow
def test_cli_under_torchrun_equals_one_process(tmp_path, monkeypatch, one_thread) -> None:
    """`torchrun --nproc_per_node=2 -m reclaim.cli ssm-train --sharding layer` (truncated, each
    rank one layer) logs the losses of the same config trained in one process."""
    args = _char_corpus(tmp_path, "d_model: 16\nn_layer: 2\nd_state: 4\ncontext_length: 64\n"
                                  "chunk_size: 16\nmax_steps: 3\nlearning_rate: 1.0e-2\n"
                                  "dtype: float64\ngrad_mode: truncated\nwindow: 24\n")
    out = tmp_path / "run"
    _cli(tmp_path, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node=2"], [*args, "--sharding", "layer", "--output_dir", str(out)])
    monkeypatch.setenv("RECLAIM_CACHE", str(tmp_path / "cache"))
    T.train(load(args[1], {"output_dir": str(tmp_path / "one"), "corpus": args[3],
                                    "tokenizer": args[5]}), progress=False)
    got, want = _log(out), _log(tmp_path / "one")
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(got, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-9)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-9)
    assert json.loads((out / "train_config.json").read_text())["sharding"] == "layer"
    assert (out / "checkpoint-3" / "tokenizer.json").exists()


def test_bad_sharding_configs_say_what_is_allowed(tmp_path, tokens, monkeypatch) -> None:
    with pytest.raises(ValueError, match="'pipeline' is not one of"):
        load(None, {"sharding": "pipeline"})
    with pytest.raises(ValueError, match="needs grad_mode in"):
        load(None, {"sharding": "layer", "grad_mode": "backprop"})
    assert load(None, ["--sharding", "none"]).sharding == "none"
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = T.SSMTrainConfig(output_dir=str(tmp_path), sharding="time", **TINY)
    with pytest.raises(ValueError, match="WORLD_SIZE is 1; launch `torchrun"):
        T.train(cfg, tokens=tokens, progress=False)


# The bundled Mamba-2 and hybrid configs (Nemotron-H's and Bamba's layouts), made tiny for a test.
FAMILY_CONFIGS = {
    "ssm-mamba2-small": ("Mamba2ForCausalLM", dict(hidden_size=16, num_heads=4, head_dim=8, state_size=4,
                                                   n_groups=2)),
    "ssm-hybrid-small": ("NemotronHForCausalLM", dict(hidden_size=16, num_attention_heads=4,
                                                      num_key_value_heads=2, head_dim=4, intermediate_size=24,
                                                      mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=4,
                                                      n_groups=2)),
    "ssm-bamba-small": ("BambaForCausalLM", dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                                                 intermediate_size=24, mamba_n_heads=4, mamba_d_state=4,
                                                 mamba_n_groups=2)),
}


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_family_checkpoints_load_in_transformers_with_the_same_logits(name, tmp_path, tokens) -> None:
    import transformers

    from reclaim.models.ssm import load_ssm

    arch, small = FAMILY_CONFIGS[name]
    bundled = load(name)
    assert bundled.architecture == arch
    cfg = load(name, {"output_dir": str(tmp_path), "model_config": {**bundled.model_config, **small},
                      "dtype": "float64", "max_steps": 2, "save_steps": 0, "context_length": 48,
                      "chunk_size": 10, "loss_chunk": 16, "warmup_steps": 0})
    records = T.train(cfg, tokens=tokens, progress=False)
    assert [r["step"] for r in records] == [1, 2]
    ckpt = tmp_path / "checkpoint-2"
    ours = load_ssm(ckpt)
    init = T.build_model(cfg, int(tokens.max()) + 1).double()
    assert any(not torch.equal(a, b) for a, b in zip(ours.state_dict().values(), init.state_dict().values()))
    theirs = getattr(transformers, arch).from_pretrained(ckpt, dtype=torch.float64, local_files_only=True).eval()
    ids = tokens[:40].long()[None]
    with torch.no_grad():
        want, got = ours(ids).logits, theirs(ids).logits.double()
    # transformers runs its norms and scans in float32 even for float64 weights
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-6


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_family_resume_with_another_shape_is_refused_by_name(name, tmp_path, tokens) -> None:
    arch, small = FAMILY_CONFIGS[name]
    small = {**load(name).model_config, **small}
    cfg = load(name, {"output_dir": str(tmp_path), "model_config": small, "max_steps": 1,
                      "context_length": 24, "chunk_size": 10})
    T.train(cfg, tokens=tokens, progress=False)
    same_mixer = {"mamba_expand": 1} if arch == "BambaForCausalLM" else {"expand": 1}  # Mamba-2 width kept
    wider = load(None, {**dataclasses.asdict(cfg), "model_config": {**small, "hidden_size": 32, **same_mixer},
                        "resume_from_checkpoint": True})
    param = {"Mamba2ForCausalLM": "backbone.embeddings", "BambaForCausalLM": "model.embed_tokens"}.get(
        arch, "model.embeddings")
    with pytest.raises(ValueError, match=rf"holds '{param}\.weight' of shape \[40, 16\]; this "
                                         r"config's model has \[40, 32\]"):
        T.train(wider, tokens=tokens, progress=False)


def test_unknown_architecture_and_model_config_fields_are_refused() -> None:
    with pytest.raises(ValueError, match="architecture 'JambaForCausalLM' is not one of"):
        load(None, {"architecture": "JambaForCausalLM"})
    cfg = load(None, {"architecture": "Mamba2ForCausalLM", "model_config": {"hidden_sise": 16}})
    with pytest.raises(ValueError, match=r"Mamba2ForCausalLM has no config field\(s\) \['hidden_sise'\]"):
        T.build_model(cfg, 40)


def test_a_restart_removes_a_killed_save_and_a_failed_start_leaves_no_output_dir(tmp_path, tokens) -> None:
    from test_checkpoints import half_written_save

    out = tmp_path / "run"
    out.mkdir()
    half_written_save(out)
    T.train(T.SSMTrainConfig(output_dir=str(out), **{**TINY, "max_steps": 1}), tokens=tokens, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1", "log.jsonl", "train_config.json"]
    missing = T.SSMTrainConfig(output_dir=str(tmp_path / "runs" / "b"), model=str(tmp_path / "no-model"), **TINY)
    with pytest.raises((FileNotFoundError, ValueError)):
        T.train(missing, tokens=tokens, progress=False)
    assert not (tmp_path / "runs").exists()
