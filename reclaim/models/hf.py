"""The one adapter over transformers' model, cache and generation API: the baseline and test oracle.

transformers renames arguments between versions (`past_key_values` became `cache`); everything
that calls its forward or `generate` goes through here so only this file follows those changes.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch

from reclaim.models.loading import as_dtype, resolve_model_dir


def load_hf_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
) -> Any:
    """transformers' AutoModelForCausalLM from a local directory (None/'default': the default model)."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_dir(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=as_dtype(dtype), local_files_only=True)
    return model.to(device).eval()


def _cache_name(hf_model: Any) -> str:
    params = inspect.signature(hf_model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.inference_mode()
def hf_forward(
    hf_model: Any,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
) -> tuple[torch.Tensor, Any]:
    """Logits [B, T, V] (float32) for `input_ids` after what `cache` holds, and the updated cache.

    Pass cache=None to start; hand the returned cache back with the next tokens.
    """
    name = _cache_name(hf_model)
    out = hf_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **{name: cache})
    return out.logits.float(), getattr(out, name)


@torch.inference_mode()
def hf_logits(hf_model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B, T, V] (float32) of one full forward, no cache kept."""
    return hf_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()


@torch.inference_mode()
def hf_generate(
    hf_model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    greedy: bool = True,
    ignore_eos: bool = False,
    **sampling: Any,
) -> torch.Tensor:
    """New tokens [B, N <= max_new_tokens] from transformers' `generate` (prompts left-padded).

    Rows that stop early are padded with the pad token. `sampling` (temperature, top_k, top_p,
    min_p) applies when greedy is False. ignore_eos: always produce max_new_tokens tokens.
    """
    from transformers import GenerationConfig

    own = hf_model.generation_config
    # An empty list, not None: generate() fills a None eos from the model's own config.
    eos = [] if ignore_eos else own.eos_token_id
    pad = own.pad_token_id if own.pad_token_id is not None else hf_model.config.pad_token_id
    if pad is None:
        ids = own.eos_token_id if isinstance(own.eos_token_id, list) else [own.eos_token_id or 0]
        pad = ids[0]
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=own.bos_token_id,
        **({} if greedy else {"top_k": None, **sampling}),
    )
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    out = hf_model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    return out[:, input_ids.shape[1]:]
