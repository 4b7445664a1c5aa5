"""ShareGPT-shaped workloads: the reader takes the first human/gpt pair of each conversation, the
synthetic lengths are seeded and follow the documented log-normal fit, prompts have the length asked."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from reclaim.data.sharegpt import (OUTPUT_MEDIAN, PROMPT_MEDIAN, chat_prompt, load_sharegpt,
                                   sharegpt_lengths, synthetic_lengths, synthetic_requests)
from reclaim.models.tokenizer import encode_chat


def test_reader_takes_first_human_gpt_pair_and_skips_the_rest(tmp_path, tiny_tokenizer):
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "Hello, world! How are you today?"},
                                      {"from": "gpt", "value": "I am fine, thank you. " * 3},
                                      {"from": "human", "value": "later turns are ignored"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "starts with the model"},
                                      {"from": "human", "value": "skipped"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "no reply"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hi"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    convs = load_sharegpt(path)
    assert [c.prompt for c in convs] == ["Hello, world! How are you today?", "Hi"]
    assert convs[0].completion.startswith("I am fine")
    # vLLM's filter drops pairs with a side under 4 tokens ("Hi" / "Hi").
    lengths = sharegpt_lengths(convs, tiny_tokenizer)
    assert len(lengths) == 1 and lengths[0].prompt_tokens >= 4 and lengths[0].output_tokens >= 4


def test_reader_rejects_a_file_that_is_not_a_list(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError, match="JSON list"):
        load_sharegpt(path)


def test_synthetic_lengths_are_seeded_and_shaped_as_documented():
    a = synthetic_lengths(2000, seed=3)
    assert a == synthetic_lengths(2000, seed=3)
    assert a != synthetic_lengths(2000, seed=4)
    prompts = [x.prompt_tokens for x in a]
    outputs = [x.output_tokens for x in a]
    # Medians near the documented ones, means above them (right-skewed), a long tail, clipping.
    assert 0.85 * PROMPT_MEDIAN < statistics.median(prompts) < 1.15 * PROMPT_MEDIAN
    assert 0.85 * OUTPUT_MEDIAN < statistics.median(outputs) < 1.15 * OUTPUT_MEDIAN
    assert 180 < statistics.mean(prompts) < 250 and 170 < statistics.mean(outputs) < 240
    assert max(outputs) > 4 * OUTPUT_MEDIAN
    assert min(prompts) >= 4 and max(prompts) <= 1024
    assert all(x.prompt_tokens + x.output_tokens <= 2048 for x in a)
    # scale shrinks the medians and keeps the shape.
    small = synthetic_lengths(2000, seed=3, scale=0.25)
    assert 0.2 < statistics.median(x.output_tokens for x in small) / statistics.median(outputs) < 0.3


def test_synthetic_requests_are_chat_prompts_of_the_sampled_length(tiny_tokenizer):
    reqs = synthetic_requests(tiny_tokenizer, 6, seed=1, scale=0.2, max_total=256)
    lengths = synthetic_lengths(6, seed=1, scale=0.2, max_total=256)
    template = len(encode_chat(tiny_tokenizer, [{"role": "user", "content": ""}]))
    for (ids, out), want in zip(reqs, lengths):
        assert abs(len(ids) - template - want.prompt_tokens) <= 2
        assert 1 <= out <= want.output_tokens and len(ids) + out <= 256
    one = chat_prompt(tiny_tokenizer, 20, random.Random(0))
    assert one == chat_prompt(tiny_tokenizer, 20, random.Random(0))
