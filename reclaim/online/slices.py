"""Training in slices between serving steps, so a request never waits for a whole training step.

A training step (forward, backward, optimizer step) runs on a thread of its own, but only while
the serving thread grants it time: `grant(seconds)` lets it run and returns once it is parked
again. It parks at the first layer boundary after its slice is spent, in the forward (a pre-hook
on every layer and on the head) or in the backward (a hook on every layer's output), so serving
waits at most one layer's forward or backward beyond the slice, not the step. The two threads
strictly alternate: the model, the record store and the weights are never used by both at once,
and the optimizer step (no boundary inside) changes the weights between two serving steps.

    slices = TrainingSlices(model, learner.train_step)
    entry = slices.grant(0.02)     # None until a step finishes; then its log entry
    slices.close()                 # a step in progress is abandoned (its feedback stays pending)
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch


class Abandoned(Exception):
    """Raised inside a parked training step when the slices are closed."""


def boundaries(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose forward and backward are the units a slice ends on: every block of the
    model's layer list, and the output head."""
    units: list[torch.nn.Module] = []
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) and not units:
            units.extend(m)
    head = getattr(model, "lm_head", None)
    if isinstance(head, torch.nn.Module):
        units.append(head)
    if not units:
        raise ValueError(f"{type(model).__name__} has no layer list to slice training at")
    return units


class TrainingSlices:
    """Runs `step()` (one training step; returns its log entry or None) in granted slices."""

    def __init__(self, model: torch.nn.Module, step: Callable[[], Any]) -> None:
        self._step = step
        self._cv = threading.Condition()
        self._turn = "serve"  # "serve" | "train": who may run
        self._deadline = 0.0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._result: tuple[bool, Any] | None = None  # (ok, entry or exception) of the last step
        self.slices = 0  # grants that ran training
        self.overshoot_s = 0.0  # time past the granted seconds, summed over grants
        self.max_overshoot_s = 0.0  # the longest wait past a grant: the largest unit run
        self._hooks = []
        for unit in boundaries(model):
            self._hooks.append(unit.register_forward_pre_hook(self._forward_boundary))
            self._hooks.append(unit.register_forward_hook(self._watch_backward))

    @property
    def in_step(self) -> bool:
        """A step has started and not finished."""
        return self._thread is not None

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
            start = time.perf_counter()
            self._deadline = start + seconds
            self._turn = "train"
            self.slices += 1
            self._cv.notify_all()
            while self._turn == "train":
                self._cv.wait()
            if seconds != float("inf"):
                over = max(0.0, time.perf_counter() - start - seconds)
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
            result: tuple[bool, Any] = (True, self._step())
        except BaseException as exc:  # noqa: BLE001 - handed to the serving thread
            result = (False, exc)
        with self._cv:
            self._result = result
            self._turn = "serve"
            self._cv.notify_all()

    def _park(self) -> None:
        """At a boundary: if the slice is spent, hand the turn back and wait for the next."""
        if time.perf_counter() < self._deadline and not self._closed:
            return
        with self._cv:
            self._turn = "serve"
            self._cv.notify_all()
            while self._turn != "train" and not self._closed:
                self._cv.wait()
            if self._closed:
                raise Abandoned

    def boundary(self) -> None:
        """A boundary the step marks itself (e.g. before its optimizer step): parks there if
        called from the training thread with the slice spent."""
        if threading.current_thread() is self._thread:
            self._park()

    def _forward_boundary(self, module: torch.nn.Module, args: Any) -> None:
        if threading.current_thread() is self._thread:  # serving's forwards never park
            self._park()

    def _watch_backward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        out = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            # only training runs backward; the hook fires in whichever thread runs it
            out.register_hook(self._backward_boundary)

    def _backward_boundary(self, grad: torch.Tensor) -> None:
        if self._thread is not None:
            self._park()
