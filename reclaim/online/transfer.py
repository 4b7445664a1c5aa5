"""Copies of a prompt record between the device and host memory, off the compute stream.

Offloading must not hold serving up, and bringing a record back must not stall the backward that
needs it. On CUDA both copies run on a side stream: to host into pinned memory (the device block
is released to the caching allocator only once the copy is done, `record_stream`), and back one
layer ahead of the backward (`ReloadLog.reached` prefetches the next layer in backward order when
a layer's first saved tensor is used), so each copy overlaps the backward of the layer before it.
The compute stream waits for a copy's event only where it uses the tensor.

On a CPU there is no stream: each copy happens when it is asked for, in the same order, so the
logic (what is prefetched when, what is freed) runs and is tested there.

    copier = copier_for(tensor.device)
    host, event = copier.to_host(tensor)        # returns at once on CUDA
    dev, event = copier.to_device(host, tensor.device)
    dev = copier.ready(dev, event)              # before the compute stream reads it
"""

from __future__ import annotations

import weakref
from functools import lru_cache
from typing import Any

import torch


class Copier:
    """Device <-> host copies for one device: a side stream on CUDA, plain copies elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def to_host(self, t: torch.Tensor, host: torch.device = torch.device("cpu")
                ) -> tuple[torch.Tensor, Any]:
        """A host copy of `t` and the event that marks it done (None: done already)."""
        t = t.detach()
        if self.stream is None:
            # copy=True: on a CPU-only machine "host" is a copy too, so the path is exercised
            return t.to(host, copy=True), None
        out = torch.empty_like(t, device=host, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # t is written
        with torch.cuda.stream(self.stream):
            out.copy_(t, non_blocking=True)
        t.record_stream(self.stream)  # its block is not handed out again before the copy ends
        return out, self._event()

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        """A device copy of `host` and the event that marks it done (None: done already)."""
        if self.stream is None:
            return host.to(device, copy=True), None
        with torch.cuda.stream(self.stream):  # after this stream's offload of the same tensor
            out = host.to(device, non_blocking=True)
        return out, self._event()

    def ready(self, t: torch.Tensor, event: Any) -> torch.Tensor:
        """`t`, once the compute stream has waited for its copy."""
        if event is not None:
            current = torch.cuda.current_stream(t.device)
            current.wait_event(event)
            t.record_stream(current)  # allocated on the side stream, used and freed on this one
        return t

    def _event(self) -> Any:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


@lru_cache(maxsize=None)
def copier_for(device: torch.device) -> Copier:
    """The one copier (and side stream) of a device."""
    return Copier(device)


class ReloadLog:
    """A record's offloaded tensors by layer, and the order they came back in.

    `used` lists the layers as the backward first needs them; `events` interleaves ("prefetch",
    layer) and ("use", layer). The tensors are held weakly (the graph owns them: a strong link
    back would keep a dropped record alive)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self._by_layer: dict[int, list[weakref.ref]] = {}
        self._reached: set[int] = set()

    @property
    def used(self) -> list[int]:
        return [layer for kind, layer in self.events if kind == "use"]

    def add(self, saved: Any) -> None:
        """An offloaded tensor of one layer (`saved.layer`), with a `prefetch()`."""
        self._by_layer.setdefault(saved.layer, []).append(weakref.ref(saved))

    def reached(self, layer: int) -> None:
        """A tensor of `layer` is brought back for the backward: log it; the first time, start
        bringing back the layer the backward reaches next (the one below)."""
        self.events.append(("use", layer))
        if layer in self._reached:
            return
        self._reached.add(layer)
        below = [k for k in self._by_layer if k < layer]
        if below:
            nxt = max(below)
            self.events.append(("prefetch", nxt))
            for ref in self._by_layer.pop(nxt):
                s = ref()
                if s is not None:
                    s.prefetch()
        self._by_layer.pop(layer, None)
