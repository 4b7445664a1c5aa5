"""`reclaim serve` flags reach the engine, the app and uvicorn; the API key can come from the
environment (so it stays out of `ps`)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import reclaim.server.serve as serve_module
from live_server import MODEL_NAME, make_model, make_tokenizer
from reclaim.cli import app
from reclaim.server.connections import ConnectionLimits
from reclaim.server.serve import EngineArgs, build_app


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
    assert kw["engine_args"].max_num_batched_tokens == 2048
    assert kw["connections"] == ConnectionLimits()
    c = kw["connections"]
    assert c.max_connections == 1024 and c.header_timeout <= 10 and c.body_timeout <= 30


def test_flags_reach_the_server(captured):
    kw = captured("--max-num-batched-tokens", "256", "--limit-concurrency", "8",
                  "--header-timeout", "2.5", "--body-timeout", "4", "--timeout-keep-alive", "1",
                  "--allowed-origins", "http://a.test, http://b.test",
                  "--allowed-origins", "http://c.test", "--split-special-tokens")
    assert kw["engine_args"].max_num_batched_tokens == 256
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
                             EngineArgs(num_blocks=32, max_num_batched_tokens=64))
    assert runner.engine.scheduler.max_num_batched_tokens == 64


def test_speculative_flags_reach_the_engine(captured):
    assert captured()["engine_args"].speculative is None
    spec = captured("--speculative", "ngram", "--num-speculative-tokens", "3", "--spec-max-batch", "2")[
        "engine_args"].speculative
    assert (spec.method, spec.num_speculative_tokens, spec.max_batch) == ("ngram", 3, 2)
    bad = CliRunner().invoke(app, ["serve", "--speculative", "medusa"])
    assert bad.exit_code == 2 and "medusa" in bad.output
