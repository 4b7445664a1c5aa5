"""A tiny random Llama and a real byte-level BPE tokenizer (ChatML template) for the RL and drafter
tests, and `fixed_depth`: speculation that drafts its full depth at every verify."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from reclaim.models.llama import LlamaConfig, LlamaForCausalLM

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = ["Compute 12 + 7 - 3. Show your steps.", "Explain gravity in simple terms.",
          "How many minutes are there in 5 hours? What is the next number: 2, 4, 6?"]


def make_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


def tiny_target(vocab_size: int, seed: int = 0, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                eos_token_id=2), **kw})
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper logits than the default init, so greedy has clear winners
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model


def fixed_depth(**fields):
    """A SpeculativeConfig that drafts exactly num_speculative_tokens at every verify (what the
    acceptance replay assumes), also where the engine's default adapts the depth per request."""
    import dataclasses

    from reclaim.engine.speculative import SpeculativeConfig

    names = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    return SpeculativeConfig(**fields, **({"dynamic_depth": False} if "dynamic_depth" in names else {}))


def torchrun(script: str, *args: str, timeout: int = 600, nproc: int = 2) -> None:
    """`script` on `nproc` local ranks as torchrun starts them (one thread each, this folder
    importable), forked from a process that imported torch once (tests/ranks.py), with every rank's
    log in the failure (Python and C++ stacks where a rank dies on a signal)."""
    from ranks import ranks

    ranks(script, *args, nproc=nproc, timeout=timeout, path=[str(Path(__file__).parent)],
          env={"PYTHONFAULTHANDLER": "1", "TORCH_SHOW_CPP_STACKTRACES": "1"})


def rank_main(worker: Callable[[Path], None], root: str) -> None:
    """A torchrun rank's entry: `worker(Path(root))`, which has destroyed its process group, then
    exit at once. Interpreter finalization is skipped: there gloo's C++ threads can still hold
    tensors and abort the process ("terminate called without an active exception", pytorch/pytorch
    #190489), the likely cause of a rank's SIGABRT without a Python traceback in one CI run."""
    worker(Path(root))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
