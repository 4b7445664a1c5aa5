"""Every command README.md and docs/ show, taken from the markdown, so a doc change is tested:

- `reclaim plan ...` and every `... --help` in a code block run (exit 0);
- every other `reclaim` command, in a block or a code span, names a command that exists and only
  options it takes (or, for the commands that take `--field value`, fields of its config); it does
  not run here, for the reason LONG_RUNNING gives its command;
- every other line of a bash block is in NOT_RECLAIM with the reason it does not run here;
- every Python block runs (slow: a minute on a tiny random model) in a fresh directory, with
  `MODEL = ...` set to a tiny random Llama and `CORPUS = ...` to a small text file.

A block after `<!-- doc-test: skip: REASON -->` is left out, for that reason."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from reclaim.cli import app

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:^<!-- doc-test: skip: (?P<skip>.*?) -->\n)?^```(?P<lang>\w*)\n(?P<body>.*?)^```",
                   re.S | re.M)
SPAN = re.compile(r"`(reclaim [^`\n]+)`")
ENV = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+")

# Commands that are not run here, and why; their options are still checked against the command.
LONG_RUNNING = {
    "generate": "loads the 135M-parameter default model and decodes up to 256 tokens: tens of seconds",
    "chat": "reads messages from stdin until it closes",
    "serve": "a server runs until it is stopped (tests/server/ start it)",
    "demo": "minutes on a 2-core CPU (make demo runs it)",
    "grpo": "minutes a step on the default model (tests/rl/ run it on tiny models)",
    "drafter train": "minutes: the target answers prompts, then hundreds of steps",
    "ssm-train": "seconds to hours a step with the bundled configs (tests/ssm/ run tiny ones)",
    "bench": "benchmarks run minutes each and write benchmarks/",
}
# Lines of bash blocks that are not reclaim commands, by their start, and why they do not run here.
NOT_RECLAIM = {
    "make ": "sets up a virtualenv and runs the demo or the whole suite: minutes (CI runs them)",
    "python -m venv": "installs packages from the network",
    "pip install": "installs packages from the network",
    ".venv/bin/pip": "installs packages from the network",
    "lm_eval ": "needs lm-eval and a running server (the slow test tests/server/test_lm_eval.py)",
    "guidellm ": "needs guidellm in its own venv and a running server",
}
# The config class behind the commands that take any config field as `--field value`.
CONFIGS = {"grpo": "reclaim.rl.grpo_config:GRPOConfig", "plan": "reclaim.rl.grpo_config:GRPOConfig",
           "ssm-train": "reclaim.ssm.train:SSMTrainConfig",
           "drafter train": "reclaim.drafter.train:DrafterTrainConfig reclaim.drafter.eagle3:Eagle3TrainConfig"}


@dataclass
class Shown:
    page: str
    line: int
    text: str  # the command as shown, continuation lines joined, the comment dropped
    in_block: bool

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def _bash_lines(body: str, first_line: int) -> list[tuple[int, str]]:
    out, pending, start = [], "", first_line
    for i, raw in enumerate(body.splitlines()):
        line = raw.strip()
        if not pending:
            start = first_line + i
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = re.sub(r"\s+#.*$", "", pending + line).strip()
        pending = ""
        if line and not line.startswith("#"):
            out.append((start, line))
    return out


def _blocks(page: Path):
    text = page.read_text()
    for m in BLOCK.finditer(text):
        yield m.group("skip"), m.group("lang"), m.group("body"), text.count("\n", 0, m.start("body")) + 1


def shown_commands() -> tuple[list[Shown], list[Shown], list[tuple[str, str]]]:
    """(reclaim commands, other bash lines, python blocks as (id, code)) of every page."""
    reclaim, other, python = [], [], []
    for page in PAGES:
        rel = page.relative_to(ROOT).as_posix()
        prose = page.read_text()
        for skip, lang, body, line in _blocks(page):
            prose = prose.replace(body, "")
            if skip:
                continue
            if lang == "bash":
                for n, cmd in _bash_lines(body, line):
                    cmd = ENV.sub("", cmd)  # `KEY=value reclaim ...`: the command is what follows
                    cmd = re.sub(r"^.*?(?:-m reclaim\.cli|--no-python reclaim) ", "reclaim ", cmd) if cmd.startswith("torchrun") else cmd
                    (reclaim if cmd.startswith("reclaim ") else other).append(Shown(rel, n, cmd, True))
            elif lang == "python":
                python.append((f"{rel}:{line}", body))
        reclaim += [Shown(rel, 0, s, False) for s in SPAN.findall(prose)]
    return reclaim, other, python


RECLAIM, OTHER, PYTHON = shown_commands()


def _parse(cmd: str) -> tuple[list[str], Any, list[str]]:
    """(the subcommand path, its click command, the words after it) of `reclaim ...`."""
    words = shlex.split(cmd)[1:]
    while words and words[0] == "--debug":
        words = words[1:]
    command = typer.main.get_command(app)
    path: list[str] = []
    while hasattr(command, "commands") and words and words[0] in command.commands:
        path.append(words[0])
        command = command.commands[words.pop(0)]
    return path, command, words


def _config_fields(path: list[str]) -> set[str]:
    import importlib

    names: set[str] = set()
    for spec in CONFIGS.get(" ".join(path), "").split():
        module, _, cls = spec.partition(":")
        names |= {f.name for f in fields(getattr(importlib.import_module(module), cls))}
    return names


def test_the_docs_show_commands():
    assert len(RECLAIM) > 40 and len(PYTHON) >= 5, (len(RECLAIM), len(PYTHON))
    assert any("reclaim plan" in s.text for s in RECLAIM if s.in_block)


@pytest.mark.parametrize("shown", RECLAIM, ids=str)
def test_a_shown_reclaim_command_exists_with_its_options(shown: Shown):
    path, command, words = _parse(shown.text)
    assert path or set(words) <= {"--help", "COMMAND", "..."}, f"{shown}: no such reclaim command"
    if "--help" in words or not path:
        return  # run below, or `reclaim --debug COMMAND ...`: a form, not a command
    opts = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    fields_ = _config_fields(path)
    for word in words:
        flag = word.split("=", 1)[0]
        if not flag.startswith("--") or flag in opts:
            continue
        name = flag[2:].removeprefix("no_")
        assert name in fields_, (f"{shown}: `reclaim {' '.join(path)}` has no option {flag}"
                                 + (f" and {CONFIGS[' '.join(path)]} no field {name!r}" if fields_ else ""))
    if shown.in_block and path != ["plan"]:
        assert any(" ".join(path).startswith(k) for k in LONG_RUNNING), (
            f"{shown}: neither run by this test nor in LONG_RUNNING with the reason it cannot run here")


@pytest.mark.parametrize("shown", [s for s in RECLAIM if s.in_block and (_parse(s.text)[0] == ["plan"]
                                                                         or "--help" in s.text)], ids=str)
def test_a_shown_plan_or_help_runs(shown: Shown):
    res = CliRunner().invoke(app, shlex.split(shown.text)[1:])
    assert res.exit_code == 0, f"{shown}\n{res.output}"
    assert res.output.strip()


@pytest.mark.parametrize("shown", OTHER, ids=str)
def test_a_shown_line_that_does_not_run_says_why(shown: Shown):
    reasons = [r for start, r in NOT_RECLAIM.items() if shown.text.startswith(start)]
    assert reasons, f"{shown}: run it here or add its start to NOT_RECLAIM with the reason it cannot run"


# ---- the Python blocks ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_model_dir) -> str:
    """A tiny random Llama with the default model's tokenizer (and its chat template)."""
    import torch

    from reclaim.models.llama import LlamaConfig, LlamaForCausalLM
    from reclaim.models.loading import save_model
    from reclaim.models.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    return str(save_model(LlamaForCausalLM(cfg), tok, tmp_path_factory.mktemp("docs") / "tiny"))


@pytest.mark.slow
@pytest.mark.parametrize("name, code", PYTHON, ids=[n for n, _ in PYTHON])
def test_a_shown_python_block_runs(name, code, tiny_model, tmp_path):
    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 300)
    code = re.sub(r"^MODEL = .*$", f"MODEL = {tiny_model!r}", code, flags=re.M)
    code = re.sub(r"^CORPUS = .*$", "CORPUS = 'corpus.txt'", code, flags=re.M)
    code = code.replace("load_model(None)", f"load_model({tiny_model!r})")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, f"{name}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    assert res.stdout.strip(), f"{name} printed nothing"
