"""GRPO's rollout engine is built from an EngineConfig: the config's `engine` fields, with
max_num_seqs and seed from GRPO's own fields; a bad or GRPO-owned engine field is refused by name."""

from __future__ import annotations

import pytest

from reclaim.config import load_config
from reclaim.rl.grpo_config import GRPOConfig


def test_engine_fields_reach_the_rollout_engine_config():
    cfg = load_config(GRPOConfig, "grpo-tiny", {"engine": {"block_size": 32, "head": "linear"}, "max_num_seqs": 5})
    ec = cfg.engine_config(300)
    assert (ec.block_size, ec.head, ec.max_num_seqs, ec.seed, ec.max_model_len) == (32, "linear", 5, cfg.seed, 300)


@pytest.mark.parametrize("engine, named", [
    ({"blocksize": 32}, "unknown engine field(s) ['blocksize']"),
    ({"block_size": 0}, "block_size=0"),
    ({"max_num_seqs": 8}, "engine: ['max_num_seqs'] are set by GRPO"),
    ({"tensor_parallel_size": 2}, "engine: ['tensor_parallel_size'] are set by GRPO"),
])
def test_bad_engine_fields_are_refused_by_name(engine, named):
    with pytest.raises(ValueError) as e:
        load_config(GRPOConfig, "grpo-tiny", {"engine": engine})
    assert named in str(e.value)
