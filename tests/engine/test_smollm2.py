"""The engine on the embedded default model: greedy output equals transformers' generate, batched
and with real detokenization (chat prompts, EOS, stop strings)."""

import torch

from reclaim.engine.engine import Engine
from reclaim.engine.request import SamplingParams
from reclaim.models.hf import hf_generate

QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn leaves."]


def _chat(tok, q):
    return tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)


def test_greedy_batch_equals_transformers_generate(smol):
    model, tok, hf = smol
    prompts = [tok.encode(_chat(tok, q)) for q in QUESTIONS]
    outs = Engine(model, tok, max_model_len=512, max_num_seqs=4).generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    for p, o in zip(prompts, outs):
        ref = hf_generate(hf, torch.tensor([p]), max_new_tokens=24)[0].tolist()
        eos = tok.eos_token_id
        if eos in ref:  # transformers pads after EOS; the engine stops at it
            ref = ref[: ref.index(eos) + 1]
        assert o.token_ids == ref
        assert o.finish_reason == ("stop" if ref[-1] == eos else "length")
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)


def test_stop_string_with_real_tokenizer(smol):
    model, tok, _ = smol
    eng = Engine(model, tok, max_model_len=512, max_num_seqs=4)
    prompt = _chat(tok, QUESTIONS[0])
    free = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0].text
    stop = free.split()[2]
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == free[: free.index(stop)]
    assert eng.stats()["kv_blocks_used"] == 0
