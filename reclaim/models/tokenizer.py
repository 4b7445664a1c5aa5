"""The tokenizer: loading it offline, and the one way messages become prompt token ids.

Every path that turns a conversation into ids (CLI, server, benchmarks, trainers) calls
`encode_chat`, so a prompt is the same tokens whoever builds it. The chat template already writes
the special tokens it wants (a Llama-3 template writes its own BOS), so the rendered text is
encoded without adding any more.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def has_tokenizer(path: os.PathLike | str) -> bool:
    """Whether an HF model directory holds tokenizer files."""
    from pathlib import Path

    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


# tokenizer_config.json's class names of transformers' generic fast tokenizer (a tokenizer.json
# and nothing model-specific): load_tokenizer builds it directly.
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | os.PathLike) -> Any:
    """transformers' AutoTokenizer (with its chat template) from a local directory, offline.

    The directory needs tokenizer files only (a model's, or a tokenizer saved on its own); for the
    bundled default model's pass `reclaim.models.loading.default_model_dir()`. Where
    tokenizer_config.json names the generic fast class (GENERIC_CLASSES, the default model's),
    that class is built directly: AutoTokenizer would first load the model's config class to
    choose one, importing torch.distributed.tensor and more (1.1 s of every start).
    """
    from pathlib import Path

    if path is None or path == "default":
        raise ValueError(f"load_tokenizer takes a directory, not {path!r}; for the default model's tokenizer "
                         "pass reclaim.models.loading.default_model_dir(), or use load_model")
    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {str(path)!r} does not exist or is not a "
                                "directory; pass a local HF model or tokenizer directory")
    if not has_tokenizer(path):
        raise FileNotFoundError(f"model directory {str(path)!r} has no tokenizer files {list(TOKENIZER_FILES)}")
    if (path / "tokenizer.json").is_file() and _config_class(path) in GENERIC_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _config_class(path: Any) -> str | None:
    """The tokenizer class tokenizer_config.json names, if it names one."""
    import json

    try:
        return json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                **template_kwargs: Any) -> str:
    """The conversation as text in the model's chat template (ready for the assistant's turn)."""
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **template_kwargs)


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                split_special_tokens: bool = False, **template_kwargs: Any) -> list[int]:
    """Prompt token ids for `messages` with the chat template.

    split_special_tokens: treat special-token text inside message contents (e.g. a user typing
    '<|im_start|>system') as plain text, not as control tokens. The template's own special
    tokens stay special. Off by default, as in vLLM and transformers.
    """
    if not split_special_tokens:
        text = render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
        return list(tokenizer.encode(text, add_special_tokens=False))
    # Render with a unique marker in place of each content, then encode the template's text with
    # special tokens recognised and each content with them split.
    marks = [f"\x00reclaim{uuid.uuid4().hex}{i}\x00" for i in range(len(messages))]
    masked = [{**m, "content": mark} if isinstance(m.get("content"), str) else m
              for m, mark in zip(messages, marks)]
    text = render_chat(tokenizer, masked, add_generation_prompt=add_generation_prompt, **template_kwargs)
    ids: list[int] = []
    for m, mark in zip(messages, marks):
        if not isinstance(m.get("content"), str) or mark not in text:
            continue
        before, text = text.split(mark, 1)
        ids += tokenizer.encode(before, add_special_tokens=False) if before else []
        ids += tokenizer.encode(m["content"], add_special_tokens=False, split_special_tokens=True) \
            if m["content"] else []
    ids += tokenizer.encode(text, add_special_tokens=False) if text else []
    return ids
