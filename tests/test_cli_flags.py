"""`generate`, `chat` and `serve` take the model the same way (-m/--model; serve also positionally,
as vLLM), and their --dtype and --kv-cache-memory reach the engine; a KV budget too small or a
model too big for the device stops with the reason before any weight is loaded."""

import pytest
import torch
from typer.testing import CliRunner

import reclaim.engine.engine as engine_module
import reclaim.models.loading as loading
import reclaim.server.serve as serve_module
from reclaim.cli import app
from reclaim.engine import memory
from reclaim.engine.kv_cache import GIB
from reclaim.models.llama import LlamaConfig, LlamaForCausalLM
from reclaim.models.loading import load_model, save_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, default_model_dir):
    """A tiny random Llama with the default model's tokenizer (and chat template)."""
    from reclaim.models.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    return str(save_model(LlamaForCausalLM(cfg), tok, tmp_path_factory.mktemp("cli") / "tiny"))


@pytest.fixture
def engines(monkeypatch):
    """The engines the CLI builds: (model dtype, kv_cache_bytes, max_model_len) of each."""
    made = []

    class Spy(engine_module.Engine):
        def __init__(self, model, tokenizer=None, **kw):
            made.append((next(model.parameters()).dtype, kw.get("kv_cache_bytes"), kw.get("max_model_len")))
            super().__init__(model, tokenizer, **kw)

    monkeypatch.setattr(engine_module, "Engine", Spy)
    return made


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(loading, "load_model", refuse)


@pytest.mark.parametrize("command", [["generate", "Hi"], ["chat"]])
def test_dtype_and_kv_memory_reach_the_engine(tiny_dir, engines, command):
    res = CliRunner().invoke(app, [*command, "-m", tiny_dir, "--dtype", "bfloat16",
                                   "--kv-cache-memory", "0.01", "--max-tokens", "2"], input="Hi\n")
    assert res.exit_code == 0, res.output
    assert engines == [(torch.bfloat16, int(0.01 * GIB), 512)]


def test_bfloat16_model_loads_in_bfloat16(tiny_dir):
    model, _ = load_model(tiny_dir, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.fixture
def served(monkeypatch):
    """What `reclaim serve` hands the server: (model, EngineConfig) of each call."""
    calls = []

    def fake_serve(model, *, engine_config, **kw):
        calls.append((model, engine_config))
        return 0

    monkeypatch.setattr(serve_module, "serve", fake_serve)
    return calls


@pytest.mark.parametrize("how", [["{m}"], ["-m", "{m}"], ["--model", "{m}"], ["{m}", "--model", "{m}"]])
def test_serve_takes_the_model_positionally_or_as_an_option(tiny_dir, served, how):
    args = [a.format(m=tiny_dir) for a in how]
    res = CliRunner().invoke(app, ["serve", *args, "--dtype", "float16", "--kv-cache-memory", "0.5"])
    assert res.exit_code == 0, res.output
    (model, engine_config), = served
    assert model == tiny_dir and engine_config.dtype == "float16"
    assert engine_config.kv_cache_bytes == GIB // 2


def test_serve_refuses_two_different_models(tiny_dir, served, tmp_path):
    res = CliRunner().invoke(app, ["serve", tiny_dir, "--model", str(tmp_path)])
    assert res.exit_code == 2 and "given twice" in res.output and not served


def test_unknown_dtype_is_refused(tiny_dir, no_loading):
    res = CliRunner().invoke(app, ["generate", "Hi", "-m", tiny_dir, "--dtype", "int8"])
    assert res.exit_code == 2 and "allowed: auto, float32, bfloat16, float16" in res.output


@pytest.mark.parametrize("command", [["generate", "Hi"], ["chat"], ["serve"]])
def test_kv_budget_too_small_stops_before_loading(tiny_dir, no_loading, served, command):
    res = CliRunner().invoke(app, [*command, "-m", tiny_dir, "--kv-cache-memory", "1e-6"])
    assert res.exit_code == 1 and not served
    assert "KV cache budget of 1073 bytes" in res.output and "bytes per token" in res.output
    assert "needs" in res.output


@pytest.mark.parametrize("command", [["generate", "Hi"], ["chat"], ["serve"]])
def test_model_too_big_for_the_device_stops_before_loading(tiny_dir, no_loading, served, monkeypatch, command):
    monkeypatch.setattr(memory, "free_memory", lambda device: 4096)
    res = CliRunner().invoke(app, [*command, "-m", tiny_dir])
    assert res.exit_code == 1 and not served
    assert "does not fit on cpu" in res.output and "only 3.81e-06 GiB is free" in res.output


@pytest.mark.parametrize("device,says", [("cuda", "CUDA is not available"), ("cuda:3", "CUDA is not available"),
                                         ("tpu", "not a device"), ("meta", "runs on cpu or cuda")])
@pytest.mark.parametrize("command", [["generate", "Hi"], ["chat"], ["serve"], ["demo"]])
def test_a_device_this_machine_lacks_is_one_line_naming_what_is_here(tiny_dir, no_loading, served, device, says,
                                                                      command):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    args = [*command] + ([] if command == ["demo"] else ["-m", tiny_dir])
    res = CliRunner().invoke(app, [*args, "--device", device])
    assert res.exit_code == 2 and not served
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and device in lines[0] and says in lines[0] and "available here: cpu" in lines[0], res.output


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2"])
def test_gpu_memory_utilization_outside_0_1_is_refused_by_name(tiny_dir, no_loading, served, value):
    res = CliRunner().invoke(app, ["serve", "-m", tiny_dir, "--gpu-memory-utilization", value])
    assert res.exit_code == 2 and "gpu_memory_utilization" in res.output and "(0, 1]" in res.output and not served


def test_gpu_memory_utilization_on_a_cpu_points_to_the_kv_cache_memory(tiny_dir, no_loading):
    res = CliRunner().invoke(app, ["generate", "Hi", "-m", tiny_dir, "--device", "cpu",
                                   "--gpu-memory-utilization", "0.5"])
    assert res.exit_code == 2 and "--kv-cache-memory" in res.output


def test_device_and_max_model_len_reach_the_engine(tiny_dir, engines):
    res = CliRunner().invoke(app, ["generate", "Hi", "-m", tiny_dir, "--device", "cpu", "--max-model-len", "64",
                                   "--max-tokens", "2"])
    assert res.exit_code == 0, res.output
    assert engines == [(torch.float32, GIB, 64)]


def test_auto_dtype_is_float32_on_a_cpu_and_the_checkpoints_half_precision_on_cuda():
    from reclaim.devices import resolve_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu, "bfloat16") == "float32"
    assert resolve_dtype("auto", cuda, "float16") == "float16"
    assert resolve_dtype("auto", cuda, "float32") == "bfloat16" == resolve_dtype(None, cuda, None)
    assert resolve_dtype("float32", cuda, "bfloat16") == "float32"
