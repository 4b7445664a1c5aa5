"""What a new user gets wrong about paths ends in one line that names the path, not a traceback:
a missing model directory (generate, chat, serve, grpo, ssm-train, drafter train), a missing
corpus; a state-space checkpoint given to the inference engine says what SSM checkpoints can do.
`reclaim --debug ...` shows the traceback."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from reclaim.cli import app

MISSING_MODEL = {
    "generate": ["generate", "Hi", "-m", "{p}"],
    "chat": ["chat", "-m", "{p}"],
    "serve": ["serve", "{p}"],
    "serve --learn": ["serve", "--learn", "--model", "{p}"],
    "grpo": ["grpo", "--config", "grpo-tiny", "--model", "{p}", "--output_dir", "{out}"],
    "ssm-train": ["ssm-train", "--config", "ssm-tiny", "--model", "{p}", "--output_dir", "{out}"],
    "drafter train": ["drafter", "train", "--config", "drafter-smollm2", "--model", "{p}", "--output_dir", "{out}"],
}


def _run(args: list[str], **fmt: str):
    return CliRunner().invoke(app, [a.format(**fmt) for a in args], input="Hi\n")


def _one_line_error(res) -> str:
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
    return lines[0]


@pytest.mark.parametrize("command", MISSING_MODEL, ids=str)
def test_a_missing_model_directory_is_one_line_naming_it(command, tmp_path):
    missing = tmp_path / "no-such-model"
    line = _one_line_error(_run(MISSING_MODEL[command], p=str(missing), out=str(tmp_path / "out")))
    assert f"'{missing}' does not exist" in line


def test_a_model_directory_without_config_json_is_named(tmp_path):
    line = _one_line_error(_run(["ssm-train", "--config", "ssm-tiny", "--model", str(tmp_path),
                                 "--output_dir", str(tmp_path / "out")]))
    assert f"'{tmp_path}' has no config.json" in line


def test_a_missing_corpus_is_one_line(tmp_path):
    line = _one_line_error(_run(["ssm-train", "--config", "ssm-tiny", "--corpus", str(tmp_path / "nope.txt"),
                                 "--output_dir", str(tmp_path / "out")]))
    assert f"'{tmp_path / 'nope.txt'}'" in line


def test_ssm_train_on_a_decoder_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    line = _one_line_error(_run(["ssm-train", "--config", "ssm-tiny", "--model", str(tmp_path),
                                 "--output_dir", str(tmp_path / "out")]))
    assert "unsupported SSM architecture ['LlamaForCausalLM'] (model_type 'llama')" in line


def test_debug_shows_the_traceback(tmp_path):
    missing = tmp_path / "no-such-model"
    res = _run(["--debug", "generate", "Hi", "-m", str(missing)])
    assert isinstance(res.exception, FileNotFoundError) and str(missing) in str(res.exception)


@pytest.fixture(scope="module")
def ssm_checkpoint(tmp_path_factory) -> str:
    """A checkpoint written by `reclaim ssm-train` (one step of a tiny Mamba on a small text file)."""
    root = tmp_path_factory.mktemp("ssm")
    (root / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    res = CliRunner().invoke(app, [
        "ssm-train", "--config", "ssm-tiny", "--corpus", str(root / "corpus.txt"), "--output_dir",
        str(root / "out"), "--max_steps", "1", "--save_steps", "1", "--context_length", "64",
        "--chunk_size", "32", "--loss_chunk", "64", "--d_model", "16", "--n_layer", "1"])
    assert res.exit_code == 0, res.output
    return str(root / "out" / "checkpoint-1")


@pytest.mark.parametrize("command", [["generate", "Hi", "-m"], ["chat", "-m"], ["serve"], ["serve", "--learn", "-m"]],
                         ids=" ".join)
def test_an_ssm_train_checkpoint_is_refused_with_what_it_can_do(command, ssm_checkpoint):
    line = _one_line_error(_run([*command, ssm_checkpoint]))
    assert f"{ssm_checkpoint} is a state-space model (MambaForCausalLM)" in line
    assert "reclaim ssm-train" in line and "transformers loads it" in line


@pytest.mark.parametrize("config", [
    {"architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2"},
    {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h"},
    {"d_model": 64, "n_layer": 2, "vocab_size": 100},  # a mamba_ssm directory
], ids=["mamba2", "nemotron_h", "mamba_ssm"])
def test_every_ssm_family_is_refused_by_name(config, tmp_path):
    from reclaim.models.ssm import ssm_family

    (tmp_path / "config.json").write_text(json.dumps(config))
    line = _one_line_error(_run(["generate", "Hi", "-m", str(tmp_path)]))
    assert f"state-space model ({ssm_family(config)})" in line


def test_another_architecture_is_one_line_naming_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    line = _one_line_error(_run(["generate", "Hi", "-m", str(tmp_path)]))
    assert "model_type='gpt2'" in line and "'llama'" in line


@pytest.mark.parametrize("command, prefix", [("grpo", "grpo-"), ("ssm-train", "ssm-"), (["drafter", "train"], "drafter-")])
def test_config_help_lists_the_bundled_configs(command, prefix):
    from reclaim.config import bundled_configs

    res = CliRunner().invoke(app, [*([command] if isinstance(command, str) else command), "--help"],
                             env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    names = [n for n in bundled_configs() if n.startswith(prefix)]
    assert len(names) >= 3, names
    assert ", ".join(names) in " ".join(res.output.split())


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_speculative_help_names_every_method(command):
    from reclaim.engine.speculative import SPECULATIVE_METHODS

    res = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "400"})
    text = " ".join(res.output.split())
    assert all(m in text for m in SPECULATIVE_METHODS) and "eagle3:PATH" in text, text
