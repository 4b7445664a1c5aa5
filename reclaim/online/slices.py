"""Training in slices between serving steps, so a request never waits for a whole training step.

A training step (forward, backward, optimizer step) runs on a thread of its own, but only while
the serving thread grants it time: `grant(seconds)` lets it run and returns once it is parked
again. The step is cut into units at boundaries: before every attention, MLP (the sub-modules
that hold a fifth of a block's weights or more), block and the output head in the forward, after
each of their backwards and the embedding's (hooks on their outputs), and where the step marks
one itself (`boundary(name)`: before clipping, before the optimizer step). At each boundary the
step starts the next unit only if that unit, as long as the last one that followed a boundary of
the same kind, ends within the slice; the first unit of a slice always runs. So serving waits
past a slice only by how much a unit outlasts its predecessor, and `next_unit_s` tells the
serving thread how long a grant must be for the step to move at all. The two threads strictly
alternate: the model, the record store and the weights are never used by both at once, and the
optimizer step (no boundary inside) changes the weights between two serving steps.

    slices = TrainingSlices(model, learner.train_step)
    entry = slices.grant(0.02)     # None until a step finishes; then its log entry
    slices.next_unit_s             # the unit the step would run next, as long as its last one
    slices.close()                 # a step in progress is abandoned (its feedback stays pending)
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable

import torch


class Abandoned(Exception):
    """Raised inside a parked training step when the slices are closed."""


def _size(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def boundaries(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose forward and backward are the units a slice ends on: in every block of
    the model's layer list its large parts (children holding 1/5 to 9/10 of its weights: attention
    and MLP, not a Mamba block's mixer, which is nearly all of it) and the block itself; the output
    head; the embedding (its output's gradient marks the end of the first block's backward)."""
    blocks: list[torch.nn.Module] = []
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) and not blocks:
            blocks.extend(m)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no layer list to slice training at")
    units: list[torch.nn.Module] = []
    for block in blocks:
        n = _size(block)
        units.extend(c for c in block.children() if n and 0.2 * n <= _size(c) <= 0.9 * n)
        units.append(block)
    head = getattr(model, "lm_head", None)
    if isinstance(head, torch.nn.Module):
        units.append(head)
    units.extend(m for m in model.modules() if isinstance(m, torch.nn.Embedding))
    return units


class TrainingSlices:
    """Runs `step()` (one training step; returns its log entry or None) in granted slices."""

    def __init__(self, model: torch.nn.Module, step: Callable[[], Any],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._step = step
        self._clock = clock
        self._cv = threading.Condition()
        self._turn = "serve"  # "serve" | "train": who may run
        self._deadline = 0.0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._result: tuple[bool, Any] | None = None  # (ok, entry or exception) of the last step
        self.slices = 0  # grants that ran training
        self.overshoot_s = 0.0  # time past the granted seconds, summed over grants
        self.max_overshoot_s = 0.0  # the longest wait past a grant
        self.unit_s: dict[str, float] = {}  # kind of boundary -> the last unit that followed one
        self._kind = "start"  # the kind of boundary the running (or parked) unit began at
        self._unit_start = 0.0
        # what the outputs of recorded prefills hold: a weak link, since the records are held by
        # the store, the store by the learner, the learner by `step`: a strong one would make a
        # cycle through C++ that the garbage collector cannot see (nothing of it freed)
        me = weakref.ref(self)

        def gradient_hook(grad: torch.Tensor) -> None:
            slices = me()
            if slices is not None:
                slices._backward_boundary(grad)

        self._gradient_hook = gradient_hook
        self._hooks = []
        for unit in boundaries(model):
            self._hooks.append(unit.register_forward_pre_hook(self._forward_boundary))
            self._hooks.append(unit.register_forward_hook(self._watch_backward))

    @property
    def in_step(self) -> bool:
        """A step has started and not finished."""
        return self._thread is not None

    @property
    def next_unit_s(self) -> float:
        """How long the unit the step would run next took last time (the first unit of a step
        when none is in progress; 0 before any was measured)."""
        return self.unit_s.get(self._kind if self._thread is not None else "start", 0.0)

    def grant(self, seconds: float) -> Any:
        """Let training run for about `seconds` (to its next boundary after them), starting a
        step if none is in progress. Returns the step's log entry when it finished in this
        slice, else None; re-raises what the step raised."""
        with self._cv:
            if self._closed:
                raise RuntimeError("the training slices were closed")
            if self._thread is None:
                self._result = None
                self._thread = threading.Thread(target=self._run, name="reclaim-train", daemon=True)
                self._thread.start()
            start = self._clock()
            self._deadline = start + seconds
            self._turn = "train"
            self.slices += 1
            self._cv.notify_all()
            while self._turn == "train":
                self._cv.wait()
            if seconds != float("inf"):
                over = max(0.0, self._clock() - start - seconds)
                self.overshoot_s += over
                self.max_overshoot_s = max(self.max_overshoot_s, over)
            if self._result is None:
                return None
            self._thread.join()
            self._thread = None
            ok, value = self._result
            self._result = None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """Abandon a parked step (it unwinds with Abandoned) and remove the hooks."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        self._thread, self._result = None, None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ---- the training thread -----------------------------------------------------------------

    def _run(self) -> None:
        with self._cv:
            while self._turn != "train" and not self._closed:
                self._cv.wait()
        try:
            if self._closed:
                raise Abandoned
            self._kind, self._unit_start = "start", self._clock()
            result: tuple[bool, Any] = (True, self._step())
            self.unit_s[self._kind] = self._clock() - self._unit_start
        except BaseException as exc:  # noqa: BLE001 - handed to the serving thread
            result = (False, exc)
        with self._cv:
            self._result = result
            self._turn = "serve"
            self._cv.notify_all()

    def _park(self, kind: str) -> None:
        """At a boundary of `kind`: time the unit that ended here; start the next one if, as long
        as the last unit after a `kind` boundary, it ends within the slice; else hand the turn
        back and wait for the next slice."""
        now = self._clock()
        self.unit_s[self._kind] = now - self._unit_start
        self._kind, self._unit_start = kind, now
        if now + self.unit_s.get(kind, 0.0) <= self._deadline and not self._closed:
            return
        with self._cv:
            self._turn = "serve"
            self._cv.notify_all()
            while self._turn != "train" and not self._closed:
                self._cv.wait()
            if self._closed:
                raise Abandoned
        self._unit_start = self._clock()  # the wait is serving's, not the unit's

    def boundary(self, name: str = "step") -> None:
        """A boundary the step marks itself (e.g. "optimizer" before its optimizer step): parks
        there if called from the training thread and the next unit does not fit the slice."""
        if threading.current_thread() is self._thread:
            self._park(name)

    def _forward_boundary(self, module: torch.nn.Module, args: Any) -> None:
        if threading.current_thread() is self._thread:  # serving's forwards never park
            self._park("forward")

    def _watch_backward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        out = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            # only training runs backward; the hook fires in whichever thread runs it
            out.register_hook(self._gradient_hook)

    def _backward_boundary(self, grad: torch.Tensor) -> None:
        if self._thread is not None:
            self._park("backward")
