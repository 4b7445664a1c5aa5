"""The benches build their engines from an EngineConfig: `--engine-config FILE` (serve's YAML of
EngineConfig fields) lays its fields over a bench's own engine defaults, and the fields the bench
varies per point stay its own. A bad file is refused by name before anything runs."""

import json

import pytest
from typer.testing import CliRunner

import reclaim.engine.engine as engine_module
from reclaim.cli import app
from reclaim.engine.config import EngineConfig


@pytest.fixture
def built(monkeypatch):
    """Every EngineConfig an Engine is built with during the test."""
    configs = []
    init = engine_module.Engine.__init__

    def spy(self, model, tokenizer=None, config=None, **kw):
        init(self, model, tokenizer, config, **kw)
        configs.append(self.config)

    monkeypatch.setattr(engine_module.Engine, "__init__", spy)
    return configs


def test_bench_spec_engines_take_the_file_fields_under_the_bench_own(tiny_model_dir, tmp_path, built):
    (tmp_path / "engine.yaml").write_text("block_size: 8\nmax_model_len: 512\nmax_num_seqs: 99\n")
    res = CliRunner().invoke(app, [
        "bench", "spec", str(tiny_model_dir), "--methods", "suffix", "--batch-sizes", "1,2", "--temperatures",
        "0", "--num-prompts", "4", "--max-tokens", "4", "--repeats", "1", "--engine-config",
        str(tmp_path / "engine.yaml"), "--out-dir", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert built and all(c.block_size == 8 and c.max_model_len == 512 and c.seed == 0 for c in built)
    assert {c.max_num_seqs for c in built} == {1, 2}  # the batch size is the bench's, not the file's 99
    assert {c.speculative is None for c in built} == {True, False}  # plain and suffix, per method
    result = json.loads((tmp_path / "out" / "spec.json").read_text())
    assert result["spec"]["engine"] == {"block_size": 8, "max_model_len": 512, "max_num_seqs": 99}  # as given
    assert result["drafter"] is None  # no EAGLE method asked: the default model's drafter is not trained


@pytest.mark.parametrize("text, message", [
    ("max_num_seqz: 4\n", "max_num_seqz"),
    ("block_size: 0\n", "block_size=0"),
    ("speculative: {method: ngram}\n", "speculative is not set in"),
])
def test_a_bad_engine_config_file_is_refused_by_name(tmp_path, text, message):
    (tmp_path / "engine.yaml").write_text(text)
    for bench in ("spec", "engine", "serve", "online"):
        res = CliRunner().invoke(app, ["bench", bench, "--engine-config", str(tmp_path / "engine.yaml"),
                                       "--out-dir", str(tmp_path / "out")])
        assert res.exit_code == 2 and message in res.output, (bench, res.output)
    assert not (tmp_path / "out").exists()


def test_bench_serve_config_has_the_file_fields_the_device_and_its_max_num_seqs():
    from reclaim.bench.serve import engine_config
    from reclaim.bench.serve_load import ServeBenchSpec

    cfg = engine_config(ServeBenchSpec(max_num_seqs=12, engine={"block_size": 32, "max_num_seqs": 3}))
    assert cfg == EngineConfig(block_size=32, max_num_seqs=12, device="cpu")
