"""Weights versions kept in host memory, so a rollback (or the regression gate) restores a version
bit for bit without reading a checkpoint.

A snapshot is a copy of every trainable parameter and of the optimizer's state as they were when
the version was made; the newest `keep` are kept (the current version among them), older ones
are evicted. Restoring copies them back in place (the served module is the trained one).

    kept = VersionSnapshots(keep=2)
    kept.take(0, model, optimizer)              # at start-up and after every optimizer step
    kept.restore(0, model, optimizer)           # bit-identical weights and optimizer state
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Snapshot:
    """One version's trainable parameters (by name) and optimizer state, on the host."""

    params: dict[str, torch.Tensor]
    optimizer: dict[str, Any]

    @property
    def nbytes(self) -> int:
        def size(x: Any) -> int:
            if isinstance(x, torch.Tensor):
                return x.nbytes
            if isinstance(x, dict):
                return sum(size(v) for v in x.values())
            if isinstance(x, (list, tuple)):
                return sum(size(v) for v in x)
            return 0

        return size(self.params) + size(self.optimizer)


def _to_host(x: Any, into: Any = None) -> Any:
    """A host copy of `x` (tensors in dicts and lists), written into `into`'s tensors where they
    fit: an evicted snapshot's memory is reused, not freed and faulted in again every step."""
    if isinstance(x, torch.Tensor):
        if (isinstance(into, torch.Tensor) and into.shape == x.shape and into.dtype == x.dtype
                and into.device.type == "cpu"):
            return into.copy_(x.detach())
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        into = into if isinstance(into, dict) else {}
        return {k: _to_host(v, into.get(k)) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        into = into if isinstance(into, (list, tuple)) and len(into) == len(x) else [None] * len(x)
        return type(x)(_to_host(v, w) for v, w in zip(x, into))
    return copy.deepcopy(x)


class VersionSnapshots:
    """The newest `keep` versions' snapshots, oldest first."""

    def __init__(self, keep: int) -> None:
        if keep < 0:
            raise ValueError(f"keep_versions={keep}: must be >= 0")
        self.keep = keep
        self.snapshots: OrderedDict[int, Snapshot] = OrderedDict()

    def versions(self) -> list[int]:
        return list(self.snapshots)

    def take(self, version: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Keep `version` as the model and optimizer are now; evict beyond `keep`."""
        if not self.keep:
            return
        old = self.snapshots.pop(version, None)
        if old is None and len(self.snapshots) >= self.keep:
            old = self.snapshots.popitem(last=False)[1]  # evicted now: its memory is reused
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.snapshots[version] = Snapshot(_to_host(params, old and old.params),
                                           _to_host(optimizer.state_dict(), old and old.optimizer))
        while len(self.snapshots) > self.keep:
            self.snapshots.popitem(last=False)

    def restore(self, version: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Copy `version` back into the model and optimizer (KeyError if it is not kept)."""
        snap = self.snapshots[version]
        named = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in snap.params.items():
                named[name].copy_(value)
        # load_state_dict keeps tensors already of the parameter's dtype and device (no copy) and
        # the optimizer updates its state in place: hand it a copy, so the snapshot stays intact
        optimizer.load_state_dict(_to_host(snap.optimizer))

    def drop(self, versions: list[int] | set[int]) -> None:
        for v in versions:
            self.snapshots.pop(v, None)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.snapshots.values())
