"""A live server on 127.0.0.1 around a tiny random Llama and a real byte-level BPE tokenizer."""

from __future__ import annotations

import time

import httpx
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from reclaim.models.llama import LlamaConfig, LlamaForCausalLM
from reclaim.server.connections import ConnectionLimits
from reclaim.engine.config import EngineConfig
from reclaim.server.serve import BackgroundServer, build_app

MODEL_NAME = "tiny-llama"
# ChatML; with tools, a Hermes/Qwen-style tool list and `<tool_call>` turns (as Qwen2.5's).
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools>\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Serving language models means batching requests and streaming tokens back.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Symbols: {}[]()<>=+-*/",
    "Unicode: café, naïve, 東京, ☃, 🙂.",
]


def make_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on a few sentences: encodes any text, with a ChatML template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   bos_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def make_model(tokenizer, max_position_embeddings: int = 256, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_position_embeddings,
                      eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper logits than the default init, so greedy has clear winners
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model


@torch.no_grad()
def plain_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """The oracle: greedy decoding by full forwards, no cache, EOS ignored (as the tests ask).

    Returns the tokens and each step's log-probabilities over the vocabulary.
    """
    ids, tokens, rows = list(prompt), [], []
    for _ in range(max_tokens):
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
        tokens.append(int(logp.argmax()))
        rows.append(logp)
        ids.append(tokens[-1])
    return tokens, rows


class LiveServer(BackgroundServer):
    """A background server plus the engine, model and tokenizer behind it."""

    model: LlamaForCausalLM
    tokenizer: PreTrainedTokenizerFast

    def __init__(self, app, runner, state, connections: ConnectionLimits | None = None) -> None:
        super().__init__(app, connections=connections, metrics=runner.metrics)
        self.runner, self.state = runner, state

    def stats(self) -> dict:
        return self.runner.engine.stats()

    def wait_idle(self, timeout: float = 20.0) -> dict:
        """Engine stats once nothing runs or waits and no request is in flight."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if (not s["running"] and not s["waiting"] and not self.runner.num_in_flight
                    and not self.runner.engine.has_unfinished()):
                return s
            if time.monotonic() > deadline:
                return s
            time.sleep(0.02)

    def healthy(self) -> bool:
        with httpx.Client(timeout=10) as client:
            return client.get(self.url + "/health").status_code == 200


def start_server(api_key: str | None = None, max_num_seqs: int = 16, num_blocks: int = 256,
                 max_model_len: int = 256, max_body_bytes: int = 64 << 10,
                 connections: ConnectionLimits | None = None, speculative=None, dtype: str = "float32",
                 **app_options) -> LiveServer:
    """A live server; `app_options` go to build_app (split_special_tokens, allowed_origins)."""
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, max_position_embeddings=max_model_len)
    args = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                      num_blocks=num_blocks, block_size=16, speculative=speculative)
    app, runner, state = build_app(model, tokenizer, (MODEL_NAME,), args, api_key=api_key,
                                   max_n=4, max_body_bytes=max_body_bytes, **app_options)
    live = LiveServer(app, runner, state, connections)
    live.model, live.tokenizer = model, tokenizer
    return live
