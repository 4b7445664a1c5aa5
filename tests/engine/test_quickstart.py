"""`reclaim generate` and `reclaim chat` on the default model: what they print is what the engine
generates for the chat-templated conversation, and chat keeps the history."""

import io

import pytest
from typer.testing import CliRunner

from reclaim.cli import app
from reclaim.engine.engine import Engine
from reclaim.engine.quickstart import chat_loop
from reclaim.models.tokenizer import encode_chat
from reclaim.engine.request import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def test_chat_keeps_history_and_streams_replies(smol):
    model, tok, _ = smol
    out = io.StringIO()
    history = chat_loop(Engine(model, tok, max_model_len=512, max_num_seqs=4), GREEDY, ["My name is Ada.", "", "Who am I?"], out)
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    ref = Engine(model, tok, max_model_len=512, max_num_seqs=4)
    first = ref.generate([encode_chat(tok, history[:1])], GREEDY)[0].text
    second = ref.generate([encode_chat(tok, history[:3])], GREEDY)[0].text
    assert history[1]["content"] == first and history[3]["content"] == second
    assert out.getvalue() == f"{first}\n{second}\n"


def test_generate_command_prints_the_engine_output(smol, default_model_dir):
    model, tok, _ = smol
    res = CliRunner().invoke(app, ["generate", "What is 2+2?", "--model", str(default_model_dir),
                                   "--max-tokens", "8"])
    assert res.exit_code == 0, res.output
    want = Engine(model, tok, max_model_len=512, max_num_seqs=4).generate(
        [encode_chat(tok, [{"role": "user", "content": "What is 2+2?"}])], GREEDY)[0].text
    assert want and res.stdout.endswith(want + "\n")


@pytest.mark.launches
def test_speculative_demo_prints_the_plain_text_and_its_speed(smol):
    from reclaim.engine.quickstart import speculative_demo
    from reclaim.engine.speculative import SpeculativeConfig

    model, tok, _ = smol
    out = io.StringIO()
    # The draft costs are the config's, not measured: measured seconds follow the machine's load
    # (three test workers on two cores), and with them whether a draft pays; the demo command's
    # test below runs the measured default.
    spec = SpeculativeConfig(method="suffix", measured_costs=False)
    got = speculative_demo(model, tok, spec, max_tokens=32, out=out)
    assert got["identical"] == 1.0 and "same text as plain: True" in out.getvalue()
    assert "tokens per target forward" in out.getvalue() and got["tau"] > 1.5  # turn 2 restates turn 1


@pytest.mark.launches
def test_demo_command_runs_with_no_drafter_cached(smol, tmp_path, monkeypatch):
    """`reclaim demo` (what `make demo` runs): with nothing trained or cached it speculates with the
    history drafter."""
    import reclaim.drafter.bundled as bundled

    monkeypatch.setattr(bundled, "default_drafter_path", lambda: tmp_path / "no-drafter")
    res = CliRunner().invoke(app, ["demo", "--max-tokens", "6", "--ssm-steps", "0", "--online-rounds", "0",
                                   "--grpo-steps", "0", "--speculative-tokens", "32"])
    assert res.exit_code == 0, res.output
    assert "speculative (suffix" in res.output and "same text as plain: True" in res.output
