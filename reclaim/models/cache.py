"""The attention-cache interface models call, and a contiguous cache for single runs.

A model never owns inference state: whoever runs it passes an object with `update()`, which stores
the new keys and values of one layer and hands back what the new queries may attend to. The
engine's paged cache (reclaim/engine/kv_cache.py) and `DenseCache` below both implement it.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionCache(Protocol):
    """What a decoder needs from a KV cache during one forward."""

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store `k`, `v` ([B, Hkv, T, D]) for this forward's T new tokens of `layer`.

        Returns keys and values over everything the new tokens may see ([B, Hkv, S, D]) and a
        boolean mask [B, 1, T, S] (True = attend), or None when plain causal attention over S = T
        is right.
        """
        ...


def causal_mask(t: int, past: int, device: torch.device) -> torch.Tensor:
    """[1, 1, t, past + t] mask letting query i see keys 0..past + i."""
    q = torch.arange(t, device=device)[:, None] + past
    k = torch.arange(past + t, device=device)[None, :]
    return (k <= q)[None, None]


class DenseCache:
    """A contiguous per-layer cache for one batch whose rows all have the same length.

    Enough for tests, single-prompt decoding and training code; the engine uses paged blocks.
    """

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    @property
    def length(self) -> int:
        return 0 if not self.keys else self.keys[0].shape[2]

    def update(self, layer, k, v):
        past = self.keys[layer].shape[2] if layer in self.keys else 0
        if past:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        t = k.shape[2] - past
        if past == 0:
            return k, v, None
        return k, v, causal_mask(t, past, k.device)
