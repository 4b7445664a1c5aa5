"""The EAGLE-3 drafter and its checkpoint: the target's aux states are transformers' hidden states,
the layout round-trips and holds exactly the keys and config fields vLLM's and SGLang's EAGLE-3
loaders read, and a checkpoint for another target or in the EAGLE-1 layout is refused by name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from engine_helpers import make_pair  # noqa: E402

from reclaim.models.drafter import load_drafter, new_drafter, save_drafter  # noqa: E402
from reclaim.models.eagle3 import default_aux_layers, drafter_layout, load_eagle3, new_eagle3, save_eagle3  # noqa: E402

# What vLLM (vllm/model_executor/models/llama_eagle3.py: Eagle3LlamaForCausalLM.load_weights maps
# midlayer. -> layers.0., d2t -> draft_id_to_target_id, skips t2d; LlamaModel has fc, layers.0
# with hidden_norm and a 2H-wide qkv, norm; lm_head over draft_vocab_size) and SGLang
# (python/sglang/srt/models/llama_eagle3.py: LlamaForCausalLMEagle3, model.midlayer, model.fc,
# model.norm, lm_head; d2t read as hot-token offsets, t2d skipped; names it lacks are dropped
# silently, so `layers.0.*` would be lost there) load from model.safetensors.
LAYOUT_KEYS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
}


@pytest.fixture(scope="module")
def pair():
    return make_pair(seed=1, num_hidden_layers=8)


def test_aux_states_are_transformers_hidden_states(pair):
    """State i entering layer i is transformers' output_hidden_states[i] (vLLM's numbering); the
    default forward is unchanged."""
    ours, hf = pair
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        got = ours(ids, return_hidden=True, aux_layers=(6, 0, 4))
        want = hf(ids, output_hidden_states=True).hidden_states
        plain = ours(ids, return_hidden=True)
    h = ours.config.hidden_size
    for j, i in enumerate((6, 0, 4)):
        torch.testing.assert_close(got.aux[..., j * h:(j + 1) * h], want[i], atol=1e-4, rtol=1e-4)
    assert plain.aux is None and torch.equal(plain.logits, got.logits) and torch.equal(plain.hidden, got.hidden)
    with pytest.raises(ValueError, match=r"aux_layers=\[2, 8\]: each must be a layer id in 0..7"):
        ours(ids, aux_layers=(2, 8))


def test_default_aux_layers_are_vllms():
    assert default_aux_layers(30) == (2, 15, 27)  # SmolLM2-135M: vLLM's (2, L // 2, L - 3)
    assert default_aux_layers(32) == (2, 16, 29)
    assert default_aux_layers(2) == (0, 1, 1)  # too shallow for distinct ones


@pytest.mark.parametrize("draft_vocab", [None, 30])
def test_round_trip_in_the_eagle3_layout(tmp_path, pair, draft_vocab):
    target, _ = pair
    ids = None if draft_vocab is None else torch.arange(5, 5 + 3 * draft_vocab, 3)  # 5, 8, .., 92
    torch.manual_seed(4)
    drafter = new_eagle3(target, (1, 4, 6), ids)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # not just the initial values
    path = save_eagle3(drafter, tmp_path / "d")
    back = load_eagle3(path, target)
    assert back.aux_layers == (1, 4, 6) and drafter_layout(path) == "eagle3"
    assert (back.draft_ids is None) == (ids is None) and (ids is None or torch.equal(back.draft_ids, ids))
    for (k, v), w in zip(drafter.state_dict().items(), back.state_dict().values()):
        assert torch.equal(v, w), k
    x = target.model.embed_tokens(torch.tensor([[3, 9, 4]]))
    aux = torch.randn(1, 3, 3 * target.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(back.head(back(x, aux, torch.arange(3)[None]))[0],
                                   drafter.head(drafter(x, aux, torch.arange(3)[None]))[0])


def test_the_layout_is_what_vllm_and_sglang_load(tmp_path, pair):
    target, _ = pair
    cfg = target.config
    drafter = new_eagle3(target, (2, 4, 5), torch.arange(10, 50))
    path = save_eagle3(drafter, tmp_path / "d")
    tensors = load_file(str(path / "model.safetensors"))
    assert set(tensors) == LAYOUT_KEYS
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    assert tensors["fc.weight"].shape == (h, 3 * h)  # fc over 3 * target_hidden_size, no bias
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (q, 2 * h)  # cat(embeds, hidden)
    assert tensors["midlayer.self_attn.k_proj.weight"].shape == (kv, 2 * h)
    assert tensors["lm_head.weight"].shape == (40, h)
    assert tensors["d2t"].dtype == torch.int64 and torch.equal(tensors["d2t"] + torch.arange(40), torch.arange(10, 50))
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].nonzero().flatten().tolist() == list(range(10, 50))
    raw = json.loads((path / "config.json").read_text())
    # vLLM: EAGLEConfig keeps an architecture ending in Eagle3, its registry maps LlamaForCausalLMEagle3 to
    # llama_eagle3; draft_vocab_size and target_hidden_size size lm_head and fc; the aux layers are
    # read from eagle_aux_hidden_state_layer_ids (eagle3_utils.get_eagle3_aux_layers_from_config),
    # use_aux_hidden_state from eagle_config. SGLang: ModelRunner reads
    # eagle_config["eagle_aux_hidden_state_layer_ids"] and captures the output of each (+1), ties
    # lm_head to the embeddings if tie_word_embeddings, and fc has a bias if `bias` is set.
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["model_type"] == "llama"
    assert raw["num_hidden_layers"] == 1 and raw["tie_word_embeddings"] is False and "bias" not in raw
    assert raw["draft_vocab_size"] == 40 and raw["target_hidden_size"] == h == raw["hidden_size"]
    assert raw["vocab_size"] == cfg.vocab_size and raw["attention_bias"] is False
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert raw["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    hf = transformers.AutoConfig.from_pretrained(path)  # what both loaders parse it with
    assert hf.draft_vocab_size == 40 and hf.num_hidden_layers == 1


def test_a_checkpoint_in_vllms_spelling_loads(tmp_path, pair):
    """vLLM's own export spells the layer layers.0.* (and may carry the embeddings): both load."""
    target, _ = pair
    drafter = new_eagle3(target, (2, 4, 5))
    path = save_eagle3(drafter, tmp_path / "d")
    tensors = load_file(str(path / "model.safetensors"))
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    tensors["embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()
    save_file(tensors, str(path / "model.safetensors"))
    back = load_eagle3(path, target)
    assert torch.equal(back.midlayer.hidden_norm.weight, drafter.midlayer.hidden_norm.weight)


def test_a_checkpoint_for_another_target_is_refused(tmp_path, pair):
    target, _ = pair
    path = save_eagle3(new_eagle3(target, (2, 4, 7)), tmp_path / "d")
    wider, _ = make_pair(seed=1, num_hidden_layers=8, hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ValueError, match="has hidden_size=64 but the target has hidden_size=96; allowed: 96"):
        load_eagle3(path, wider)
    other_vocab, _ = make_pair(seed=1, num_hidden_layers=8, vocab_size=128)
    with pytest.raises(ValueError, match="has vocab_size=96 but the target has vocab_size=128; allowed: 128"):
        load_eagle3(path, other_vocab)
    shallow, _ = make_pair(seed=1, num_hidden_layers=4)
    with pytest.raises(ValueError, match=r"made for a deeper target: aux_layers=\[2, 4, 7\]: each must be a "
                                         r"layer id in 0..3"):
        load_eagle3(path, shallow)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "target_hidden_size": 32}))
    with pytest.raises(ValueError, match="has target_hidden_size=32 but the target has hidden_size=64"):
        load_eagle3(path, target)


def test_an_eagle1_directory_as_eagle3_and_the_reverse_are_refused(tmp_path, pair):
    target, _ = pair
    e1 = save_drafter(new_drafter(target), tmp_path / "e1")
    assert drafter_layout(e1) == "eagle"
    with pytest.raises(ValueError, match=r"is an EAGLE-1/2 drafter.*LlamaForCausalLMEagle3.*use eagle:PATH"):
        load_eagle3(e1, target)
    e3 = save_eagle3(new_eagle3(target), tmp_path / "e3")
    with pytest.raises(ValueError, match="is an EAGLE-3 drafter.*use eagle3:PATH"):
        load_drafter(e3, target)
    with pytest.raises(FileNotFoundError, match="needs config.json and model.safetensors"):
        load_eagle3(tmp_path / "nowhere", target)
