"""The rollout engine's drafter trained between rollouts (TLT's adaptive drafter trainer).

`OnlineDrafterTrainer`'s drafter is the rollout engine's, recorded through a `RecordingProposer`
(which also sees the accepted draft tokens' states), trained in place between rollouts on a bounded
buffer and synchronised across torchrun ranks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from reclaim.drafter.acceptance import greedy_acceptance
from reclaim.drafter.data import DrafterBuffer, DrafterSample, HiddenRecorder
from reclaim.drafter.loss import make_optimizer, train_drafter
from reclaim.engine.eagle import EagleProposer
from reclaim.models.drafter import EagleDrafter, load_drafter, save_drafter

class RecordingProposer(EagleProposer):
    """The engine's EAGLE proposer that also hands every hidden state the target computes to a
    HiddenRecorder: prefill, decode and the accepted draft positions, which a verify forward
    computes and `on_forward` (chunk tokens only) does not see."""

    def __init__(self, drafter: EagleDrafter, target: torch.nn.Module, recorder: HiddenRecorder,
                 **tree: int) -> None:
        super().__init__(drafter, target, **tree)
        self.recorder = recorder

    def observe(self, seq_id: str, start: int, token_ids: list[int], hidden: torch.Tensor) -> None:
        self.recorder.observe(seq_id, start, token_ids, hidden)
        super().observe(seq_id, start, token_ids, hidden)


class OnlineDrafterTrainer:
    """TLT's adaptive drafter trainer: the rollout engine's EAGLE drafter (trained in place, so
    the engine's proposer drafts with the new weights at once) learns from the hidden states of
    recent rollouts in a bounded buffer; a frozen copy of the starting drafter is kept to compare
    acceptance against. Under torchrun (`sync`) every rank adds the others' samples and takes the
    weights and optimizer state of the rank that trained most, so all draft alike next rollout."""

    def __init__(self, drafter: EagleDrafter, *, buffer_tokens: int, lr: float, max_steps: int,
                 seed: int = 0, eval_samples: int = 4, eval_depth: int = 4) -> None:
        if max_steps < 1 or eval_samples < 0 or eval_depth < 1:
            raise ValueError(f"need max_steps >= 1, eval_samples >= 0, eval_depth >= 1; got {max_steps}, "
                             f"{eval_samples}, {eval_depth}")
        self.drafter = drafter
        self.frozen = copy.deepcopy(drafter).eval().requires_grad_(False)
        self.recorder = HiddenRecorder()
        self.buffer = DrafterBuffer(buffer_tokens)
        self.optimizer = make_optimizer(drafter, lr)
        self.max_steps, self.seed, self.eval_samples, self.eval_depth = max_steps, seed, eval_samples, eval_depth
        self.steps = 0  # optimizer steps of the drafter in use, over the whole run
        self._rolled: EagleDrafter | None = None  # the drafter the current rollout drafts with

    def proposer(self, target: torch.nn.Module) -> RecordingProposer:
        """The engine's proposer (Engine(proposer=...)): proposes with self.drafter, records states."""
        return RecordingProposer(self.drafter, target, self.recorder)

    def begin_rollout(self) -> None:
        """Keep a copy of the drafter this rollout drafts with (for `evaluate`, after it trained)."""
        if self.eval_samples:
            self._rolled = copy.deepcopy(self.drafter).eval()

    @property
    def rolled(self) -> EagleDrafter | None:
        """The drafter as it was when the current rollout began (None before one, or without eval)."""
        return self._rolled

    def collect(self, outputs: Sequence[Any]) -> list[DrafterSample]:
        """Samples of the rollout's finished requests (RequestOutputs); their states are dropped.
        A one-token completion leaves no response position to learn from and is skipped."""
        keep = [(o.request_id, o.prompt_token_ids, o.token_ids) for o in outputs if len(o.token_ids) >= 2]
        samples = self.recorder.samples(keep) if keep else []
        for o in outputs:
            self.recorder.drop(o.request_id)
        return samples

    def train(self, samples: Sequence[DrafterSample], target: torch.nn.Module,
              stop: Callable[[], bool] | None = None) -> list[dict[str, Any]]:
        """Add samples to the buffer, then train up to max_steps steps, checking `stop` (the
        slowest worker is done) before each; returns the steps' records."""
        self.buffer.add(samples)
        records: list[dict[str, Any]] = []
        if not len(self.buffer):
            return records
        vocab = self.buffer.vocab()
        while len(records) < self.max_steps and not (stop is not None and stop()):
            records += train_drafter(self.drafter, target, self.buffer, steps=1, optimizer=self.optimizer,
                                     seed=self.seed, start_step=self.steps + len(records), ce_vocab=vocab)
        self.steps += len(records)
        self.drafter.eval()
        return records

    def sync(self, world: Any, rank_samples: Sequence[Sequence[DrafterSample]], rank_steps: Sequence[int]) -> int:
        """After every rank's `train`: add the other ranks' samples (rank_samples[r], rank order)
        and give every rank the drafter of the one that trained most (its weights and optimizer
        state); returns that rank."""
        trains = getattr(world, "is_rollout_leader", True)  # a TP follower never trains: keeps no buffer
        for r, samples in enumerate(rank_samples):
            if r != world.rank and trains:
                self.buffer.add(samples)
        src = max(range(len(rank_steps)), key=rank_steps.__getitem__)
        if world.size > 1 and rank_steps[src]:
            world.broadcast_tensors(self.drafter.parameters(), src)
            self.optimizer.load_state_dict(world.broadcast(
                self.optimizer.state_dict() if world.rank == src else None, src))
        self.steps += rank_steps[src] - rank_steps[world.rank]  # all ranks started the rollout level
        return src

    def evaluate(self, samples: Sequence[DrafterSample], target: torch.nn.Module) -> dict[str, float]:
        """Greedy chain replay (`greedy_acceptance`, eval_depth tokens) on the first eval_samples
        samples of the rollout: tau of the drafter that drafted it (before training on it) and of
        the frozen starting drafter."""
        picked = list(samples[:self.eval_samples])
        if not picked or self._rolled is None:
            return {}
        online = greedy_acceptance(self.rolled, target, picked, self.eval_depth)
        frozen = greedy_acceptance(self.frozen, target, picked, self.eval_depth)
        return {"drafter/tau_online": online["tau"], "drafter/tau_frozen": frozen["tau"]}

    def save(self, directory: Path) -> None:
        """directory/drafter (the EAGLE layout) and directory/drafter_state.pt (optimizer, steps)."""
        save_drafter(self.drafter, directory / "drafter")
        torch.save({"optimizer": self.optimizer.state_dict(), "steps": self.steps}, directory / "drafter_state.pt")

    def load(self, directory: Path, target: torch.nn.Module) -> None:
        """The drafter and its optimizer as `save` wrote them (the frozen copy stays the start)."""
        with torch.no_grad():
            self.drafter.load_state_dict(load_drafter(directory / "drafter", target).state_dict())
        state = torch.load(directory / "drafter_state.pt")
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = state["steps"]


def __getattr__(name: str) -> Any:
    """`OnlineDrafter`, the trainer's old name, kept for one release with a DeprecationWarning."""
    if name == "OnlineDrafter":
        import warnings

        warnings.warn("reclaim.drafter.online.OnlineDrafter is deprecated; use OnlineDrafterTrainer",
                      DeprecationWarning, stacklevel=2)
        return OnlineDrafterTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
