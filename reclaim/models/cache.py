"""The attention-cache interface models call, a contiguous cache for single runs, and a masked
one for rows of different lengths.

A model never owns inference state: whoever runs it passes an object with `update()`, which stores
the new keys and values of one layer and hands back what the new queries may attend to. The
engine's paged cache (reclaim/engine/kv_cache.py) and `DenseCache` below both implement it.

A cache also owns the attention window: built with the model's `sliding_window`, its masks let a
query at position p see keys at positions p - window < k <= p (transformers' Mistral convention:
`window` keys, the query's own included). The model refuses a cache built for another window.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionCache(Protocol):
    """What a decoder needs from a KV cache during one forward."""

    sliding_window: int | None  # the window its masks apply; must equal the model config's

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store `k`, `v` ([B, Hkv, T, D]) for this forward's T new tokens of `layer`.

        Returns keys and values over everything the new tokens may see ([B, Hkv, S, D]) and a
        boolean mask [B, 1, T, S] (True = attend), or None when plain causal attention over S = T
        is right.
        """
        ...


def attention_mask(q_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[B, 1, T, S]: the query at position q_pos[b, t] sees the key at key_pos[s] when
    q - window < k <= q (no lower bound without a window)."""
    q, k = q_pos[:, :, None], key_pos[None, None, :]
    ok = k <= q
    if window is not None:
        ok &= k > q - window
    return ok[:, None]


def causal_mask(t: int, past: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """[1, 1, t, past + t] mask letting query i see keys 0..past + i (the last `window` of them)."""
    return attention_mask(torch.arange(past, past + t, device=device)[None],
                          torch.arange(past + t, device=device), window)


def needs_mask(t: int, past: int, window: int | None) -> bool:
    """Whether t new tokens after `past` cached ones need an explicit mask (else plain causal)."""
    return past > 0 or (window is not None and t > window)


class DenseCache:
    """A contiguous per-layer cache for one batch whose rows all have the same length.

    Enough for tests, single-prompt decoding and training code; the engine uses paged blocks.
    `sliding_window` must be the model config's (it keeps every key and masks the old ones).
    """

    def __init__(self, sliding_window: int | None = None) -> None:
        self.sliding_window = sliding_window
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
        if not needs_mask(t, past, self.sliding_window):
            return k, v, None
        return k, v, causal_mask(t, past, k.device, self.sliding_window)


class GivenMask:
    """A cache that stores nothing: one forward whose tokens attend under a mask fixed up front
    ([B, 1, T, T], True = attend), as when several sequences are packed into one row. The mask
    must already apply `sliding_window` (the model config's)."""

    def __init__(self, mask: torch.Tensor, sliding_window: int | None = None) -> None:
        self.mask = mask
        self.sliding_window = sliding_window

    def update(self, layer, k, v):
        return k, v, self.mask


class MaskedCache:
    """A preallocated cache for rows that hold different keys (padding, tree branches): the
    caller sets `mask` [b, 1, T, S + T] before each forward, and a forward of b rows uses the
    first b (rows that left the batch are the last). Any window is the caller's masks' job."""

    sliding_window = None

    def __init__(self, keys: dict[int, torch.Tensor], values: dict[int, torch.Tensor], length: int) -> None:
        self.keys, self.values = keys, values  # [B, Hkv, capacity, D]; keys before `length` are set
        self.lengths = dict.fromkeys(keys, length)
        self.mask: torch.Tensor | None = None

    def update(self, layer, k, v):
        b, s, t = k.shape[0], self.lengths[layer], k.shape[2]
        self.keys[layer][:b, :, s:s + t] = k
        self.values[layer][:b, :, s:s + t] = v
        self.lengths[layer] = s + t
        return self.keys[layer][:b, :, :s + t], self.values[layer][:b, :, :s + t], self.mask
