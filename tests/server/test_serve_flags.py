"""`reclaim serve` flags reach the engine, the app and uvicorn; the API key can come from the
environment (so it stays out of `ps`)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import reclaim.server.serve as serve_module
from live_server import MODEL_NAME, make_model, make_tokenizer
from reclaim.cli import app
from reclaim.server.connections import ConnectionLimits
from reclaim.engine.config import EngineConfig
from reclaim.server.serve import build_app


@pytest.fixture
def captured(monkeypatch):
    """Run `reclaim serve ...` with the server replaced by a recorder of its arguments."""
    seen = {}

    def fake_serve(model, **kwargs):
        seen.update(kwargs, model=model)
        return 0

    monkeypatch.setattr(serve_module, "serve", fake_serve)
    monkeypatch.delenv("RECLAIM_API_KEY", raising=False)

    def invoke(*args: str, env: dict | None = None) -> dict:
        seen.clear()
        result = CliRunner().invoke(app, ["serve", *args], env=env)
        assert result.exit_code == 0, result.output
        return dict(seen)

    return invoke


def test_defaults_are_safe(captured):
    kw = captured()
    assert kw["api_key"] is None and kw["allowed_origins"] == () and not kw["split_special_tokens"]
    assert kw["access_log"] is True and kw["force_include_usage"] is False
    assert kw["engine_config"].max_num_batched_tokens == 2048
    assert kw["connections"] == ConnectionLimits()
    c = kw["connections"]
    assert c.max_connections == 1024 and c.header_timeout <= 10 and c.body_timeout <= 30


def test_flags_reach_the_server(captured):
    kw = captured("--max-num-batched-tokens", "256", "--limit-concurrency", "8",
                  "--header-timeout", "2.5", "--body-timeout", "4", "--timeout-keep-alive", "1",
                  "--allowed-origins", "http://a.test, http://b.test",
                  "--allowed-origins", "http://c.test", "--split-special-tokens")
    assert kw["engine_config"].max_num_batched_tokens == 256
    assert kw["connections"] == ConnectionLimits(max_connections=8, header_timeout=2.5,
                                                 body_timeout=4, keep_alive=1)
    assert kw["allowed_origins"] == ("http://a.test", "http://b.test", "http://c.test")
    assert kw["split_special_tokens"] is True
    kw = captured("--enable-force-include-usage", "--disable-access-log")
    assert kw["force_include_usage"] is True and kw["access_log"] is False
    assert captured("--no-access-log")["access_log"] is False  # the name for it


def test_api_key_from_environment(captured):
    assert captured(env={"RECLAIM_API_KEY": "sk-env"})["api_key"] == "sk-env"
    assert captured("--api-key", "sk-flag", env={"RECLAIM_API_KEY": "sk-env"})["api_key"] == \
        "sk-flag"


def test_bad_limit_is_refused_by_name():
    result = CliRunner().invoke(app, ["serve", "--header-timeout", "0"])
    assert result.exit_code != 0 and "header_timeout=0.0" in result.output


def test_max_num_batched_tokens_reaches_the_scheduler():
    tokenizer = make_tokenizer()
    _, runner, _ = build_app(make_model(tokenizer), tokenizer, (MODEL_NAME,),
                             EngineConfig(num_blocks=32, max_num_batched_tokens=64))
    assert runner.engine.scheduler.max_num_batched_tokens == 64


def test_speculative_flags_reach_the_engine(captured):
    assert captured()["engine_config"].speculative is None
    spec = captured("--speculative", "ngram", "--num-speculative-tokens", "3", "--spec-max-batch", "2")[
        "engine_config"].speculative
    assert (spec.method, spec.num_speculative_tokens, spec.max_batch) == ("ngram", 3, 2)
    bad = CliRunner().invoke(app, ["serve", "--speculative", "medusa"])
    assert bad.exit_code == 2 and "medusa" in bad.output


def test_every_engine_field_is_a_serve_option_and_reaches_the_engine_config(captured, tmp_path):
    """The engine options are generated from EngineConfig: each field (but `speculative`) has
    its flag; a YAML file of fields loads through --engine-config and the flags override it."""
    import dataclasses

    from reclaim.engine.config import cli_fields

    help_text = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200).output
    names = [f.metadata.get("flag", "--" + f.name.replace("_", "-")) for f in cli_fields()]
    assert {f.name for f in dataclasses.fields(EngineConfig)} - {f.name for f in cli_fields()} == {"speculative"}
    assert all(n in help_text for n in names), [n for n in names if n not in help_text]
    kw = captured("--max-num-seqs", "3", "--seed", "7", "--head", "linear", "--kv-on-weight-update", "keep")
    cfg = kw["engine_config"]
    assert (cfg.max_num_seqs, cfg.seed, cfg.head, cfg.kv_on_weight_update, cfg.device) == (3, 7, "linear", "keep", "cpu")
    (tmp_path / "engine.yaml").write_text("max_num_seqs: 5\nblock_size: 32\n")
    cfg = captured("--engine-config", str(tmp_path / "engine.yaml"), "--max-num-seqs", "2")["engine_config"]
    assert (cfg.max_num_seqs, cfg.block_size) == (2, 32)


@pytest.mark.parametrize("args, named", [
    (["--max-num-seqs", "0"], "max_num_seqs=0"),
    (["--head", "fast"], "head='fast'"),
    (["--kv-on-weight-update", "drop"], "kv_on_weight_update='drop'"),
    (["--dtype", "int8"], "dtype='int8'"),
])
def test_bad_engine_options_are_refused_by_name(args, named):
    result = CliRunner().invoke(app, ["serve", *args])
    assert result.exit_code == 2 and named in result.output, result.output


def test_engine_config_refuses_unknown_fields_and_bad_values():
    with pytest.raises(ValueError, match=r"unknown engine field\(s\) \['max_seqs'\]; allowed: \['max_num_seqs'"):
        EngineConfig().replace(max_seqs=4)
    with pytest.raises(ValueError, match="block_size=0; allowed: an integer >= 1"):
        EngineConfig(block_size=0)
    bad = CliRunner().invoke(app, ["serve", "--engine-config", "/nonexistent/engine.yaml"])
    assert bad.exit_code == 2 and "/nonexistent/engine.yaml" in bad.output


def test_learning_flags(captured, monkeypatch, tmp_path):
    monkeypatch.delenv("RECLAIM_ADMIN_KEY", raising=False)
    kw = captured("--learn", "--rollback-to", "3", "--feedback-rate-limit", "30",
                  env={"RECLAIM_ADMIN_KEY": "sk-admin"})
    assert kw["admin_key"] == "sk-admin" and kw["rollback_to"] == 3 and kw["feedback_rate_limit"] == 30
    assert kw["learn"].output_dir == "runs/online/{model}"  # keyed by the served model's name
    kw = captured("--learn")
    assert kw["admin_key"] is None and kw["rollback_to"] is None and kw["feedback_rate_limit"] == 120
    probe = tmp_path / "probe.jsonl"
    probe.write_text('{"text": "fine"}\n')
    kw = captured("--learn", "--probe-path", str(probe), "--max-probe-regression", "0.1")
    assert kw["learn"].probe_path == str(probe) and kw["learn"].max_probe_regression == 0.1


@pytest.mark.parametrize("args,message", [
    (["--rollback-to", "2"], "--rollback-to only applies with --learn"),
    (["--learn", "--rollback-to", "-1"], "--rollback-to -1: a weights version is >= 0"),
    (["--feedback-rate-limit", "5"], "--feedback-rate-limit only applies with --learn"),
    (["--learn", "--probe-path", "PROBE"], "line 2: not JSON"),
])
def test_learning_flags_refused(monkeypatch, tmp_path, args, message):
    monkeypatch.setattr(serve_module, "serve", lambda model, **kw: 0)
    probe = tmp_path / "probe.jsonl"
    probe.write_text('{"text": "fine"}\n{"text": \n')
    result = CliRunner().invoke(app, ["serve", *[str(probe) if a == "PROBE" else a for a in args]],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def test_a_learner_that_cannot_start_is_refused_in_one_line(tmp_path, caplog):
    """Another model's checkpoint in the run directory, or --rollback-to a version not kept: the
    server does not start, and says why in one line naming the models (or the versions kept)."""
    import torch

    from reclaim.models.loading import save_model
    from reclaim.online.feedback import FeedbackLog
    from reclaim.online.store import RecordStore
    from reclaim.online.trainer import OnlineTrainConfig, OnlineTrainer

    tokenizer = make_tokenizer()
    model_dir = save_model(make_model(tokenizer), tokenizer, tmp_path / "tiny-a")
    cfg = OnlineTrainConfig(output_dir=str(tmp_path / "run"), save_steps=1, cost_model="recompute")
    other = OnlineTrainer(make_model(tokenizer, seed=1), cfg, FeedbackLog(cfg.feedback_path),
                          RecordStore(), model_name="tiny-b")
    with torch.no_grad():
        other.save()
    engine = EngineConfig(max_model_len=256, num_blocks=64, block_size=16)
    assert serve_module.serve(str(model_dir), engine_config=engine, learn=cfg, log_level="warning") == 2
    refused = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(refused) == 1 and "is of model 'tiny-b'" in refused[0] and "served 'tiny-a'" in refused[0]
    assert "\n" not in refused[0]
    caplog.clear()
    keyed = OnlineTrainConfig(output_dir=str(tmp_path / "runs" / "{model}"), cost_model="recompute")
    assert serve_module.serve(str(model_dir), engine_config=engine, learn=keyed, rollback_to=7,
                              log_level="warning") == 2
    refused = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert refused == [f"not serving: --rollback-to 7: no such version kept; at start-up kept: [0] (0: the "
                       f"model as given, the others checkpoints in {str(tmp_path / 'runs' / 'tiny-a')!r})"]
