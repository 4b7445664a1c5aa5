"""The embedded default model, SmolLM2-135M-Instruct: ours against transformers on the same directory."""

import copy

import pytest
import torch

from reclaim.models.cache import DenseCache
from reclaim.models.hf import hf_generate, hf_logits, load_hf_model
from reclaim.models.tokenizer import load_tokenizer
from reclaim.models.loading import (
    default_gguf,
    load_checkpoint,
    load_model,
    resolve_model_dir,
    save_model,
)


@pytest.fixture(scope="module")
def both(default_model_dir):
    model, tokenizer = load_model("default")
    return model, tokenizer, load_hf_model(default_model_dir)


def _prompt(tokenizer, text: str) -> torch.Tensor:
    chat = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


def test_none_and_default_name_the_cached_directory(default_model_dir):
    assert resolve_model_dir(None) == resolve_model_dir("default") == default_model_dir
    assert (default_model_dir / "model.safetensors").is_file()


def test_logits_match_transformers(both):
    model, tokenizer, hf = both
    ids = torch.cat([_prompt(tokenizer, "What is the capital of France?"),
                     torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))],
                    dim=1)
    with torch.no_grad():
        ours = model(ids).logits
    theirs = hf_logits(hf, ids)
    assert (ours - theirs).abs().max() <= 3e-4
    # As close to the float64 logits as transformers' float32 ones are: the same order of rounding
    # error (measured 0.9-2.0x theirs in RMS over seeds and thread counts; the kernels sum apart).
    exact = hf_logits(copy.deepcopy(hf).double(), ids)
    rms = lambda x: (x.double() - exact).pow(2).mean().sqrt()  # noqa: E731
    assert rms(ours) <= 3 * rms(theirs)


def test_greedy_decoding_with_cache_matches_transformers_generate(both):
    model, tokenizer, hf = both
    ids = _prompt(tokenizer, "Name three colours.")
    want = hf_generate(hf, ids, max_new_tokens=12, ignore_eos=True)[0].tolist()
    cache, got, step = DenseCache(), [], ids
    with torch.no_grad():
        for _ in range(12):
            pos = torch.arange(cache.length, cache.length + step.shape[1])[None]
            step = model(step, pos, cache).logits[:, -1:].argmax(-1)
            got.append(step.item())
    assert got == want


def test_tokenizer_files_survive_save_and_load(both, tiny_hf, tmp_path):
    """A model saved with the default tokenizer comes back with the same vocabulary and chat template."""
    _, tokenizer, _ = both
    tiny = tiny_hf("llama-mha-tied")
    tiny.save_pretrained(tmp_path / "hf")
    model, none = load_model(tmp_path / "hf")
    assert none is None  # a directory without tokenizer files
    _, again = load_model(save_model(model, tokenizer, tmp_path / "with_tok"))
    chat = [{"role": "user", "content": "héllo, wörld 🙂"}, {"role": "assistant", "content": "hi"}]
    assert again.apply_chat_template(chat, tokenize=False) == tokenizer.apply_chat_template(chat, tokenize=False)
    text = again.apply_chat_template(chat, tokenize=False)
    assert again(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert again.eos_token_id == tokenizer.eos_token_id
    assert torch.equal(load_checkpoint(tmp_path / "with_tok").lm_head.weight, model.lm_head.weight)


@pytest.mark.slow
def test_cached_tokenizer_equals_the_one_transformers_builds_from_the_gguf(default_model_dir, tmp_path):
    """The conversion names the fast tokenizer class (convert_gguf); AutoTokenizer is the oracle:
    the same files written, the same chat text and ids."""
    from transformers import AutoTokenizer

    gguf = default_gguf()
    ref = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    ref.save_pretrained(tmp_path)
    for name in sorted(p.name for p in tmp_path.iterdir()):
        assert (tmp_path / name).read_bytes() == (default_model_dir / name).read_bytes(), name
    ours = load_tokenizer(default_model_dir)
    chat = [{"role": "user", "content": "Écris un haïku sur les tokens 🙂\n\tcode: x += 1"}]
    assert ours.apply_chat_template(chat, tokenize=False) == ref.apply_chat_template(chat, tokenize=False)
    text = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours(text)["input_ids"] == ref(text)["input_ids"]
