"""The rollout engine's copy of the policy in the rollout dtype (reclaim/rl/rollout_weights.py);
under FSDP its refresh from the shards is checked in test_grpo_fsdp.py."""

from __future__ import annotations

import pytest
import torch
from rl_helpers import tiny_target

from reclaim.fsdp import FullWeights, local_bytes
from reclaim.rl.grpo_config import GRPOConfig
from reclaim.rl.rollout_weights import host_copy, rollout_copy, rollout_dtype


def test_the_copy_is_each_tensor_cast_and_frozen_with_tied_weights_tied():
    model = tiny_target(50, tie_word_embeddings=True)
    served = rollout_copy(model, torch.bfloat16)
    assert served.lm_head.weight is served.model.embed_tokens.weight
    assert local_bytes(served.parameters()) == local_bytes(model.parameters()) // 2
    for (name, p), q in zip(model.named_parameters(), served.parameters()):
        assert q.dtype == torch.bfloat16 and not q.requires_grad and q.data_ptr() != p.data_ptr(), name
        assert torch.equal(q, p.detach().to(torch.bfloat16)), name
    torch.testing.assert_close(served.inv_freq, model.inv_freq)  # buffers as they are (RoPE in float32)
    same = rollout_copy(model, torch.float32)  # auto: a copy, not the training weights themselves
    assert all(q.data_ptr() != p.data_ptr() for p, q in zip(model.parameters(), same.parameters()))


def test_a_refresh_writes_the_new_weights_cast():
    model = tiny_target(50)
    served = rollout_copy(model, torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    served.load_state_dict(FullWeights(model, dtype=torch.bfloat16))
    for p, q in zip(model.parameters(), served.parameters()):
        assert torch.equal(q, p.detach().to(torch.bfloat16))
    back = host_copy(served, model, torch.float32, keep=True)
    assert all(torch.equal(p, q) and q.dtype == torch.float32 for p, q in zip(model.parameters(), back.parameters()))
    assert host_copy(served, model, torch.float32, keep=False) is None


def test_rollout_dtype_auto_is_the_policys_and_others_are_refused_by_name():
    model = tiny_target(50).double()
    assert rollout_dtype("auto", model) == torch.float64 and rollout_dtype("bfloat16", model) == torch.bfloat16
    with pytest.raises(ValueError, match=r"rollout_dtype='int8' is not one of \['bfloat16', 'float16', 'float32', 'auto"):
        GRPOConfig(rollout_dtype="int8")
