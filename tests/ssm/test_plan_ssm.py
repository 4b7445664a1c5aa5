"""`reclaim plan` for ssm-train: Nemotron-H 8B at 128K on 8 x 80 GB, from its config.json alone."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from reclaim.cli import app
from reclaim.config import load_config
from reclaim.plan import MODELS_DIR
from reclaim.ssm.plan import plan_ssm
from reclaim.ssm.train import SSMTrainConfig

NEMOTRON_8B = MODELS_DIR / "nemotron-h-8b.json"


def cfg(**kw) -> SSMTrainConfig:
    return load_config(SSMTrainConfig, "ssm-nemotron-h-8b-128k", kw)


def test_nemotron_h_8b_shape_and_the_plans_that_fit_80_gb() -> None:
    fsdp = plan_ssm(cfg(), NEMOTRON_8B, 8)
    assert fsdp.num_parameters == 8_100_852_736  # the published Nemotron-H-8B parameter count
    assert fsdp.rows["parameters"] == pytest.approx(8_100_852_736 * 4 / 8, rel=1e-3)  # float32, 1/8
    # 4 attention layers keep K and V (8 heads x 128) of all 128K tokens, as much for dK/dV.
    kv = 4 * 131072 * 2 * 8 * 128 * 4
    assert fsdp.rows["attention_kv"] == fsdp.rows["attention_dkv"] == kv
    # 24 Mamba layers' states (128 heads x 64 x 128, conv tail) at each of the 64 chunk starts.
    assert fsdp.rows["boundary_states"] == 64 * 24 * (8192 * 128 * 4 + (8192 + 2 * 8 * 128) * 3 * 4)
    assert fsdp.rows["segment_inputs"] == 0 and fsdp.fits(80 * 10**9)
    time32 = plan_ssm(cfg(sharding="time"), NEMOTRON_8B, 8)
    assert time32.rows["parameters"] == 8 * fsdp.rows["parameters"] and not time32.fits(80 * 10**9)
    time16 = plan_ssm(cfg(sharding="time", dtype="bfloat16", loss_chunk=512), NEMOTRON_8B, 8)
    assert time16.rows["segment_inputs"] == 52 * 16384 * 4096 * 2 and time16.fits(80 * 10**9)
    assert math.isclose(time16.total, sum(time16.rows.values()))


def test_plan_command_reads_an_ssm_config() -> None:
    out = CliRunner().invoke(app, ["plan", "--config", "ssm-nemotron-h-8b-128k", "--model-config", "nemotron-h-8b",
                                   "--world-size", "8", "--device-memory", "80GB"])
    assert out.exit_code == 0, out.output
    assert "fsdp at world size 8: 8.10B parameters" in out.output and "fits in 80 GB" in out.output
    bad = CliRunner().invoke(app, ["plan", "--config", "ssm-nemotron-h-8b-128k", "--model-config",
                                   "nemotron-h-8b", "--sharding", "layer"])
    assert bad.exit_code != 0 and "the plan covers ['none', 'fsdp', 'time']" in bad.output
    assert Path(NEMOTRON_8B).is_file()


def test_a_bamba_plan_prices_the_mlp_inside_each_layer(tmp_path) -> None:
    """Bamba's layers each end in a SwiGLU MLP: the chunk's graph grows with its width (gate and
    up outputs, silu, their product: 4 x intermediate per token), its parameters are counted."""
    import json

    from reclaim.models.bamba import BambaConfig

    bamba = load_config(SSMTrainConfig, "ssm-bamba-small", {"adjoint_recompute": "layer"})
    paths = {}
    for width in (384, 768):
        shape = {**bamba.model_config, "vocab_size": 256, "intermediate_size": width}
        paths[width] = tmp_path / f"{width}.json"
        paths[width].write_text(json.dumps(BambaConfig.from_hf(shape).to_hf()))
    narrow, wide = (plan_ssm(bamba, paths[w], 1) for w in (384, 768))
    q, b = bamba.chunk_size, 4
    assert wide.rows["chunk_graph"] - narrow.rows["chunk_graph"] == q * 4 * 384 * b
    assert wide.num_parameters - narrow.num_parameters == 6 * 3 * 128 * 384  # 6 layers' gate, up, down
    assert narrow.rows["attention_kv"] == 2048 * 2 * 2 * 32 * b  # one attention layer: 2 K/V heads of 32
