"""EAGLE-1/2 drafter: one decoder layer of the target's architecture that predicts the target's
next final hidden state from the current one and the next token.

    g_i = layer(fc(cat(embed(x_{i+1}), f_i)))      f_i: the target's final hidden state at i
    logits_{i+2} = target.lm_head(g_i)             g_i stands in for f_{i+1}

The embeddings and the LM head are the target's (shared, frozen, not stored). As in EAGLE and
vLLM's loader, the layer has no input norm (fc's output goes straight into attention) and there
is no final norm. On disk it is the EAGLE layout vLLM and SGLang load: config.json (the target's
config with one hidden layer) and model.safetensors with `fc.weight` and `layers.0.*`.

A reduced draft vocabulary (`draft_ids`, EAGLE-3's idea): the drafter scores only the N most
frequent tokens with those rows of the target's head. On a CPU the full head is most of a draft
token's cost (SmolLM2: a 49K x 576 matrix), so an 8K vocabulary makes drafting several times
cheaper; drafts stay lossless (tokens outside it are simply never proposed). Stored as EAGLE-3's
`d2t` (draft index -> target id offset) and `t2d` (target ids in the draft vocabulary).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from reclaim.models.cache import AttentionCache
from reclaim.models.kernels.linear import Linear
from reclaim.models.llama import DecoderLayer, rope_inv_freq
from reclaim.models.llama_config import LlamaConfig

WEIGHTS_NAME = "model.safetensors"
# EAGLE-3's architectures names (vLLM's EAGLEConfig and registry take both; models/eagle3.py).
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


class EagleDrafter(nn.Module):
    """The drafter's own weights: fc and one decoder layer (embeddings and head are the target's)."""

    def __init__(self, cfg: LlamaConfig, draft_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = dataclasses.replace(cfg, num_hidden_layers=1)
        h = cfg.hidden_size
        self.fc = Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(self.config, 0)])
        self.layers[0].input_layernorm = nn.Identity()
        self.register_buffer("inv_freq", rope_inv_freq(self.config), persistent=False)
        # Target ids of the draft vocabulary, ascending (None: the whole vocabulary).
        self.register_buffer("draft_ids", None if draft_ids is None else check_draft_ids(draft_ids, cfg.vocab_size),
                             persistent=False)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: AttentionCache | None = None) -> torch.Tensor:
        """Predicted next hidden states [B, T, H] from token embeddings and the target's hidden
        states [B, T, H] at `positions` [B, T] (the positions of `hidden`)."""
        x = self.fc(torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1))
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        return self.layers[0](x, cos, sin, cache)


def check_draft_ids(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Distinct ascending target ids in range, as a long tensor."""
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    if ids.numel() == 0 or (ids[1:] <= ids[:-1]).any() or ids[0] < 0 or ids[-1] >= vocab_size:
        raise ValueError(f"draft vocabulary of {ids.numel()} ids must be distinct, ascending ids in 0.."
                         f"{vocab_size - 1}")
    return ids


def most_frequent(token_ids: list[list[int]], n: int, vocab_size: int) -> torch.Tensor:
    """The n most frequent ids in `token_ids` (ties by id), ascending: a draft vocabulary."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in token_ids:
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    top = counts.argsort(descending=True, stable=True)[: min(n, vocab_size)]
    return top.sort().values


def check_fits(cfg: LlamaConfig, target_cfg: LlamaConfig, where: str = "the drafter") -> None:
    """Refuse a drafter whose shape does not fit the target, naming the mismatch."""
    for name in ("hidden_size", "vocab_size"):
        mine, theirs = getattr(cfg, name), getattr(target_cfg, name)
        if mine != theirs:
            raise ValueError(f"{where} has {name}={mine} but the target has {name}={theirs}; "
                             "a drafter must be trained for this target")


def new_drafter(target: nn.Module) -> EagleDrafter:
    """A freshly initialised drafter for `target`, in its dtype and on its device."""
    p = next(target.parameters())
    return EagleDrafter(target.config).to(device=p.device, dtype=p.dtype)


def save_drafter(drafter: EagleDrafter, path: str | os.PathLike) -> Path:
    """Write the EAGLE layout (config.json + model.safetensors) atomically; returns the path."""
    from reclaim.storage import atomic_dir

    def write(out: Path) -> None:
        cfg = drafter.config.to_hf()
        cfg["torch_dtype"] = str(next(drafter.parameters()).dtype).removeprefix("torch.")
        tensors = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
        if drafter.draft_ids is not None:  # EAGLE-3's draft vocabulary maps
            ids = drafter.draft_ids.cpu()
            cfg["draft_vocab_size"] = ids.numel()
            tensors["d2t"] = ids - torch.arange(ids.numel())
            t2d = torch.zeros(drafter.config.vocab_size, dtype=torch.bool)
            t2d[ids] = True
            tensors["t2d"] = t2d
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})

    return atomic_dir(Path(path), write)


def drafter_layout(path: str | os.PathLike) -> str:
    """"eagle3" for a directory in the EAGLE-3 layout (its architectures, or midlayer.* weights),
    else "eagle" (EAGLE-1/2: fc over 2H and layers.0.*)."""
    path = Path(path).expanduser()
    if not (path / "config.json").is_file() or not (path / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"drafter directory {str(path)!r} needs config.json and {WEIGHTS_NAME}; "
                                "train one with `reclaim drafter train`")
    arch = json.loads((path / "config.json").read_text()).get("architectures") or []
    if any(a in EAGLE3_ARCHITECTURES for a in arch):
        return "eagle3"
    from safetensors import safe_open

    with safe_open(str(path / WEIGHTS_NAME), "pt") as f:
        return "eagle3" if any(k.startswith("midlayer.") for k in f.keys()) else "eagle"


def load_drafter(path: str | os.PathLike, target: nn.Module) -> EagleDrafter:
    """An EAGLE-layout drafter for `target` from `path`, in the target's dtype and device."""
    path = Path(path).expanduser()
    if not (path / "config.json").is_file() or not (path / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"drafter directory {str(path)!r} needs config.json and {WEIGHTS_NAME} "
                                "(the EAGLE layout); train one with `reclaim drafter train`")
    if drafter_layout(path) == "eagle3":
        raise ValueError(f"drafter {str(path)!r} is an EAGLE-3 drafter ({EAGLE3_ARCHITECTURES[0]}, midlayer.*); "
                         "use eagle3:PATH (or hybrid:PATH) for it, eagle:PATH takes the EAGLE-1/2 layout")
    raw = json.loads((path / "config.json").read_text())
    raw.pop("draft_vocab_size", None)
    cfg = LlamaConfig.from_hf(raw)
    check_fits(cfg, target.config, f"drafter {str(path)!r}")
    tensors = load_file(str(path / WEIGHTS_NAME))
    d2t, _ = tensors.pop("d2t", None), tensors.pop("t2d", None)
    draft_ids = None if d2t is None else torch.arange(d2t.numel()) + d2t
    drafter = EagleDrafter(dataclasses.replace(target.config, num_hidden_layers=1), draft_ids)
    tensors = {k: v for k, v in tensors.items() if not k.startswith(("embed_tokens.", "lm_head."))}
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"drafter {str(path)!r}: missing keys {missing[:5]}, unexpected keys "
                         f"{unexpected[:5]}; expected fc.weight and layers.0.*")
    p = next(target.parameters())
    return drafter.to(device=p.device, dtype=p.dtype).eval()


def draft_head(drafter: EagleDrafter, target: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head rows the drafter scores ([N or V, H]) and their target ids (None: all)."""
    w = target.lm_head.weight
    if drafter.draft_ids is None:
        return w, None
    ids = drafter.draft_ids.to(w.device)
    return w.index_select(0, ids), ids
