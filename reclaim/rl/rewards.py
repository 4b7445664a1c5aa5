"""Reward functions for GRPO, with TRL's signature, and the one place they are called.

A reward function is `fn(prompts, completions, completion_ids, **kwargs) -> list[float | None]`,
one value per completion, None where it does not apply (as in TRL). Prompts and completions come
as TRL passes them for a conversational dataset: each prompt a list of messages, each completion
`[{"role": "assistant", "content": text}]`; `completion_ids` are the generated token ids. kwargs
hold the dataset's other columns, one value per completion (`answer`, `task`, `question` for the
procedural tasks; reasoning-gym tasks add `entry` and `task_config`, which its scorer needs), and `trainer_state` (`global_step`, `max_steps`).

`reward_funcs` in a config names each function: a built-in (`accuracy`, `format`), a dotted path
(`mypkg.rewards.length_penalty`) or a file and a name (`rewards.py:length_penalty`).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from reclaim.data.tasks import RG_PREFIX, rg_score

RewardFunc = Callable[..., list]
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class RewardError(ValueError):
    """A reward function that could not be loaded, raised, or returned something unusable."""


def completion_text(completion: Any) -> str:
    """The text of a completion as TRL passes it: a string, or a list of messages (the last one's content)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"a completion is a string or a list of messages, got {type(completion).__name__}")


def extract_answer(text: str) -> str | None:
    """The final answer in a completion: inside the last <answer>...</answer>, else its last number."""
    tagged = ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1].strip()
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normalize(answer: str) -> str:
    """Case, spaces, and thousands separators or trailing '.0' do not make an answer wrong."""
    s = re.sub(r"\s+", " ", answer.strip().lower().rstrip("."))
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)
    return re.sub(r"(?<=\d)\.0+\b", "", s)


def accuracy_reward(prompts: list, completions: list, completion_ids: list, *, answer: Sequence[str],
                    task: Sequence[str | None] | None = None, entry: Sequence[dict | None] | None = None,
                    task_config: Sequence[dict | None] | None = None, **kwargs: Any) -> list[float]:
    """1.0 where the completion's final answer (see `extract_answer`) equals the task's, else 0.0;
    for a reasoning-gym task (`task` rg:<dataset>, with its `entry`) that dataset's own score (0..1)."""
    n = len(completions)
    task, entry, task_config = task or [None] * n, entry or [None] * n, task_config or [None] * n
    out = []
    for c, want, family, e, options in zip(completions, answer, task, entry, task_config, strict=True):
        got = extract_answer(completion_text(c))
        if isinstance(family, str) and family.startswith(RG_PREFIX):
            if not isinstance(e, dict):
                raise ValueError(f"task {family!r} is scored by reasoning-gym, which needs the row's 'entry' "
                                 f"(reasoning-gym's dict with question, answer, metadata), got {type(e).__name__}")
            out.append(rg_score(family, got, e, options))
        else:
            out.append(float(got is not None and _normalize(got) == _normalize(str(want))))
    return out


def format_reward(prompts: list, completions: list, completion_ids: list, **kwargs: Any) -> list[float]:
    """1.0 where the completion gives exactly one non-empty <answer>...</answer> and ends with it."""
    out = []
    for c in completions:
        text = completion_text(c).strip()
        tagged = ANSWER_TAG.findall(text)
        out.append(float(len(tagged) == 1 and bool(tagged[0].strip()) and text.endswith("</answer>")))
    return out


BUILTIN_REWARDS: dict[str, RewardFunc] = {"accuracy": accuracy_reward, "format": format_reward}


# ---- loading by name ---------------------------------------------------------------------------

def load_reward(spec: str) -> RewardFunc:
    """A reward function from a built-in name, `package.module.name` or `path/to/file.py:name`."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" in spec:
        file, _, name = spec.rpartition(":")
        path = Path(file).expanduser()
        if not path.is_file():
            raise RewardError(f"reward function {spec!r}: file {file!r} does not exist")
        mod_name = f"reclaim_reward_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise RewardError(f"reward function {spec!r}: importing {file!r} failed: {e!r}") from e
    elif "." in spec:
        mod_path, _, name = spec.rpartition(".")
        try:
            module = importlib.import_module(mod_path)
        except ImportError as e:
            raise RewardError(f"reward function {spec!r}: cannot import module {mod_path!r} ({e})") from e
    else:
        raise RewardError(f"reward function {spec!r} is unknown; give a built-in {sorted(BUILTIN_REWARDS)}, "
                          "a dotted path (package.module.function) or file.py:function")
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"reward function {spec!r}: {name!r} is not a function in {module.__name__!r}")
    return fn


# ---- calling them ------------------------------------------------------------------------------

def _sample(i: int, prompts: list, completions: list, columns: dict[str, list]) -> str:
    prompt = prompts[i][-1]["content"] if isinstance(prompts[i], list) else prompts[i]
    extra = {k: v[i] for k, v in columns.items() if k != "question"}
    return f"sample {i} (prompt {str(prompt)[:80]!r}, completion {completion_text(completions[i])[:80]!r}, {extra})"


def _culprit(fn: RewardFunc, prompts: list, completions: list, completion_ids: list,
             columns: dict[str, list], common: dict[str, Any]) -> int | None:
    """The first sample that makes `fn` raise when called on it alone (None: none does)."""
    for i in range(len(prompts)):
        try:
            fn(prompts=prompts[i:i + 1], completions=completions[i:i + 1], completion_ids=completion_ids[i:i + 1],
               **{k: v[i:i + 1] for k, v in columns.items()}, **common)
        except Exception:
            return i
    return None


def score(funcs: Sequence[RewardFunc], names: Sequence[str], prompts: list, completions: list,
          completion_ids: list, columns: dict[str, list], **common: Any) -> torch.Tensor:
    """Rewards [N, len(funcs)] (NaN where a function returned None), calling each function once
    on the whole batch. A function that raises is named with the first sample it fails on; one
    that returns the wrong number of values or a non-number is named with what it returned."""
    n = len(prompts)
    out = torch.zeros(n, len(funcs))
    for j, (fn, name) in enumerate(zip(funcs, names, strict=True)):
        try:
            values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids,
                        **columns, **common)
        except Exception as e:
            i = _culprit(fn, prompts, completions, completion_ids, columns, common)
            where = _sample(i, prompts, completions, columns) if i is not None else f"a batch of {n} samples"
            raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e} on {where}") from e
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else repr(type(values).__name__)
            raise RewardError(f"reward function {name!r} returned {got} for {n} completions; it must return "
                              "a list with one float (or None) per completion")
        for i, v in enumerate(values):
            if v is None:
                out[i, j] = math.nan
            elif isinstance(v, numbers.Real) and math.isfinite(v):
                out[i, j] = float(v)
            else:
                where = _sample(i, prompts, completions, columns)
                raise RewardError(f"reward function {name!r} returned {v!r} for {where}; "
                                  "rewards are finite floats or None")
    return out
