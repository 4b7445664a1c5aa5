"""EAGLE-1/2 drafter: one decoder layer of the target's architecture that predicts the target's
next final hidden state from the current one and the next token.

    g_i = layer(fc(cat(embed(x_{i+1}), f_i)))      f_i: the target's final hidden state at i
    logits_{i+2} = target.lm_head(g_i)             g_i stands in for f_{i+1}

The embeddings and the LM head are the target's (shared, frozen, not stored). As in EAGLE and
vLLM's loader, the layer has no input norm (fc's output goes straight into attention) and there
is no final norm. On disk it is the EAGLE layout vLLM and SGLang load: config.json (the target's
config with one hidden layer) and model.safetensors with `fc.weight` and `layers.0.*`.
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
from reclaim.models.llama import DecoderLayer, LlamaConfig, rope_inv_freq

WEIGHTS_NAME = "model.safetensors"


class EagleDrafter(nn.Module):
    """The drafter's own weights: fc and one decoder layer (embeddings and head are the target's)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = dataclasses.replace(cfg, num_hidden_layers=1)
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(self.config, 0)])
        self.layers[0].input_layernorm = nn.Identity()
        self.register_buffer("inv_freq", rope_inv_freq(self.config), persistent=False)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: AttentionCache | None = None) -> torch.Tensor:
        """Predicted next hidden states [B, T, H] from token embeddings and the target's hidden
        states [B, T, H] at `positions` [B, T] (the positions of `hidden`)."""
        x = self.fc(torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1))
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        return self.layers[0](x, cos, sin, cache)


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
    from reclaim.models.loading import atomic_dir

    def write(out: Path) -> None:
        cfg = drafter.config.to_hf()
        cfg["torch_dtype"] = str(next(drafter.parameters()).dtype).removeprefix("torch.")
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        tensors = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
        save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})

    return atomic_dir(Path(path), write)


def load_drafter(path: str | os.PathLike, target: nn.Module) -> EagleDrafter:
    """An EAGLE-layout drafter for `target` from `path`, in the target's dtype and device."""
    path = Path(path).expanduser()
    if not (path / "config.json").is_file() or not (path / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"drafter directory {str(path)!r} needs config.json and {WEIGHTS_NAME} "
                                "(the EAGLE layout); train one with `reclaim drafter train`")
    cfg = LlamaConfig.from_hf(json.loads((path / "config.json").read_text()))
    check_fits(cfg, target.config, f"drafter {str(path)!r}")
    drafter = EagleDrafter(dataclasses.replace(target.config, num_hidden_layers=1))
    tensors = load_file(str(path / WEIGHTS_NAME))
    tensors = {k: v for k, v in tensors.items() if not k.startswith(("embed_tokens.", "lm_head."))}
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"drafter {str(path)!r}: missing keys {missing[:5]}, unexpected keys "
                         f"{unexpected[:5]}; expected fc.weight and layers.0.*")
    p = next(target.parameters())
    return drafter.to(device=p.device, dtype=p.dtype).eval()
