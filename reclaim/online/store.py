"""Prompt records by response id, under a device byte budget and a host (offload) byte budget.

A record that does not fit on the device pushes the oldest device records to host memory (the
offload moves them layer by layer in forward order; the backward brings them back in backward
order); when the host is full too, the oldest records are evicted. Every outcome is counted. A
record made on the host device itself (serving on a CPU) is already in host memory: offloading it
moves it to the host budget's account and copies nothing.

    store = RecordStore(record_budget="1GB", record_host_budget="4GB")
    store.put(record)
    rec, status = store.take("r1", version=3, max_staleness=0)   # status: hit | missing | ...
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from reclaim.online.recorder import PromptRecord
from reclaim.storage import parse_size

GONE_MEMORY = 100_000  # how many dropped ids are remembered, to tell evicted / stale from missing


@dataclass(frozen=True)
class RecordInfo:
    """What the planner needs to know about a stored record, without taking it."""

    status: str  # "present" | "missing" | "evicted" | "stale"
    version: int | None = None
    where: str | None = None  # "device" | "host"
    nbytes: int = 0
    prompt_tokens: int = 0


class RecordStore:
    """Records keyed by response id, oldest first, with budgets in bytes (int or '500MB')."""

    def __init__(self, record_budget: int | str = "1GB", record_host_budget: int | str = 0,
                 host: str | torch.device = "cpu") -> None:
        self.budget = parse_size(record_budget)
        self.host_budget = parse_size(record_host_budget)
        if self.budget < 0 or self.host_budget < 0:
            raise ValueError(f"record_budget={record_budget!r}, record_host_budget="
                             f"{record_host_budget!r}: budgets must be >= 0")
        self.host = torch.device(host)
        self.records: OrderedDict[str, PromptRecord] = OrderedDict()
        self.gone: OrderedDict[str, str] = OrderedDict()  # id -> "evicted" | "stale"
        self.device_bytes = self.host_bytes = 0
        self.counts = dict(puts=0, hits=0, misses=0, evictions=0, stale=0, offloads=0, rejected=0)
        self.lock = threading.Lock()

    # ---- bookkeeping -------------------------------------------------------------------------

    def _account(self, rec: PromptRecord, sign: int) -> None:
        if rec.where == "host":
            self.host_bytes += sign * rec.nbytes
        else:
            self.device_bytes += sign * rec.nbytes

    def _forget(self, response_id: str, why: str) -> None:
        self.gone[response_id] = why
        while len(self.gone) > GONE_MEMORY:
            self.gone.popitem(last=False)

    def _drop(self, response_id: str, why: str | None = None) -> PromptRecord:
        """Remove a record; why: "evicted" or "stale" (counted, remembered), None when taken."""
        rec = self.records.pop(response_id)
        self._account(rec, -1)
        if why is not None:
            self.counts["evictions" if why == "evicted" else "stale"] += 1
            self._forget(response_id, why)
        return rec

    def _to_host(self, rec: PromptRecord) -> bool:
        """Offload `rec`, evicting the oldest host records for room; False if it cannot fit."""
        if rec.nbytes > self.host_budget or rec.selective:  # selective records stay on device
            return False
        for rid in [r for r, x in self.records.items() if x.where == "host"]:
            if self.host_bytes + rec.nbytes <= self.host_budget:
                break
            self._drop(rid, "evicted")
        if rec.response_id in self.records:
            self._account(rec, -1)
        if rec.device == self.host:
            rec.where = "host"  # the same memory: a copy would cost time and free nothing
        else:
            rec.offload(self.host)
        self._account(rec, +1)
        self.counts["offloads"] += 1
        return True

    # ---- public ------------------------------------------------------------------------------

    def put(self, rec: PromptRecord) -> bool:
        """Keep `rec` (replacing one with the same response id); False if it fits nowhere."""
        with self.lock:
            if rec.response_id in self.records:
                self._drop(rec.response_id)
            self.gone.pop(rec.response_id, None)
            self.counts["puts"] += 1
            # make room on the device: oldest device records go to host, or are evicted
            for rid in [r for r, x in self.records.items() if x.where == "device"]:
                if self.device_bytes + rec.nbytes <= self.budget:
                    break
                if not self._to_host(self.records[rid]):
                    self._drop(rid, "evicted")
            if self.device_bytes + rec.nbytes <= self.budget:
                self.records[rec.response_id] = rec
                self._account(rec, +1)
                return True
            if self._to_host(rec):
                self.records[rec.response_id] = rec
                return True
            self.counts["rejected"] += 1
            self._forget(rec.response_id, "evicted")
            return False

    def info(self, response_id: str) -> RecordInfo:
        """The record's state, for planning (it stays in the store)."""
        with self.lock:
            rec = self.records.get(response_id)
            if rec is None:
                return RecordInfo(self.gone.get(response_id, "missing"))
            return RecordInfo("present", rec.version, rec.where, rec.nbytes, rec.length)

    def take(self, response_id: str, version: int, max_staleness: int = 0
             ) -> tuple[PromptRecord | None, str]:
        """Remove and return the record if usable at weights `version`, with the status:
        hit (same version), hit_stale (older, within max_staleness), missing, evicted, stale
        (too old: dropped and counted). A record's graph serves one backward, so it is taken."""
        with self.lock:
            rec = self.records.get(response_id)
            if rec is None:
                self.counts["misses"] += 1
                return None, self.gone.get(response_id, "missing")
            age = version - rec.version
            if age < 0 or age > max_staleness:
                self._drop(response_id, "stale")
                return None, "stale"
            self._drop(response_id)
            self.counts["hits"] += 1
            return rec, "hit" if age == 0 else "hit_stale"

    def discard(self, response_id: str) -> None:
        """Drop a record the planner chose not to use (no count: the decision is counted)."""
        with self.lock:
            if response_id in self.records:
                self._drop(response_id)

    def drop_older_than(self, version: int) -> int:
        """Drop records made before `version` (after a weights update with max_staleness=0)."""
        return self._drop_versions(lambda v: v < version)

    def drop_newer_than(self, version: int) -> int:
        """Drop records made after `version` (by weights a rollback to `version` undid)."""
        return self._drop_versions(lambda v: v > version)

    def _drop_versions(self, which: Callable[[int], bool]) -> int:
        with self.lock:
            old = [r for r, x in self.records.items() if which(x.version)]
            for rid in old:
                self._drop(rid, "stale")
            return len(old)

    def metrics(self) -> dict[str, int]:
        """records, bytes (device + host), device_bytes, host_bytes, hits, misses, evictions,
        stale, offloads, rejected, puts."""
        with self.lock:
            return dict(records=len(self.records), bytes=self.device_bytes + self.host_bytes,
                        device_bytes=self.device_bytes, host_bytes=self.host_bytes, **self.counts)
