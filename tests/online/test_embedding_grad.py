"""The embedding's gradient added as rows into .grad equals autograd's dense one: tied and untied
heads, repeated tokens, gradients accumulated over several backwards, through a recorded prompt."""

from __future__ import annotations

import pytest
import torch
from online_helpers import grads, rel_err, tiny_model, token_lists

from reclaim.online.embedding_grad import RowGradEmbedding
from reclaim.online.recorder import record_prompt, recompute_loss, reuse_loss


@pytest.mark.parametrize("tied", [True, False])
def test_row_gradients_equal_autograds_dense_ones(tied):
    model = tiny_model(tie_word_embeddings=tied)
    prompts, responses = token_lists([9, 5], seed=2), [[3, 3, 7], [3, 9, 9, 4]]  # repeated tokens

    def accumulated() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        for p, r in zip(prompts, responses):  # two backwards into the same .grad
            loss, n = recompute_loss(model, [p], [r])
            loss.backward()
        rec = record_prompt(model, prompts[0], response_id="a", version=0)
        loss, n = reuse_loss(model, [rec], [responses[0]])  # and one through a recorded graph
        loss.backward()
        return grads(model).clone()

    want = accumulated()
    ids = torch.tensor([prompts[0]])
    with torch.inference_mode():
        served = model(ids).logits
    hooks = RowGradEmbedding(model)
    assert len(hooks.handles) == 1 and RowGradEmbedding(model).handles == []  # once per module
    got = accumulated()
    assert rel_err(got, want) <= 1e-6
    with torch.inference_mode():  # serving's forwards are untouched
        assert torch.equal(model(ids).logits, served)
    hooks.remove()
    assert not model.model.embed_tokens._forward_hooks


def test_a_frozen_embedding_is_not_hooked():
    model = tiny_model()
    model.model.embed_tokens.weight.requires_grad_(False)
    assert RowGradEmbedding(model).handles == []
