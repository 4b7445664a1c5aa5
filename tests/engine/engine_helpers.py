"""Tiny random Llama-family models with transformers twins (the oracle), and a toy tokenizer."""

from __future__ import annotations

import torch
import transformers

from reclaim.models.llama import LlamaConfig, LlamaForCausalLM

TINY = dict(
    model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=1,
)


class ToyTokenizer:
    """Ids 0-1 are special (<pad>, <eos>); others map to 1- or 2-letter pieces, so text and ids differ."""

    eos_token_id = 1

    def __init__(self, vocab_size: int) -> None:
        letters = "abcdefghijklmnopqrstuvwxyz"
        self.pieces = ["<pad>", "<eos>"] + [
            letters[i % 26] if i < 28 else letters[i % 26] + letters[(i * 7) % 26]
            for i in range(2, vocab_size)
        ]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.pieces[i] for i in ids if not (skip_special_tokens and i < 2))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out, i = [], 0  # no special tokens are ever added
        while i < len(text):
            for n in (2, 1):
                if text[i:i + n] in self.pieces[2:]:
                    out.append(self.pieces.index(text[i:i + n], 2))
                    i += n
                    break
            else:
                raise ValueError(f"cannot encode {text[i]!r}")
        return out


def make_pair(seed: int = 0, **overrides) -> tuple[LlamaForCausalLM, transformers.PreTrainedModel]:
    """A reclaim model and transformers' model of the same family with the same random weights."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY, **overrides})
    ours = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper logits than nn.Linear's default init, so greedy has clear winners
        for p in ours.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    hf_cfg = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.to_hf().items() if k != "architectures"})
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return ours, hf
