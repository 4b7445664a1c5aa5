"""The EAGLE-3 drafter inside the engine: EagleProposer's cache keeping, chains and trees, fed
the target's aux states instead of its final ones and scored by the drafter's own head.

`aux_layers` tells the engine what to hand `observe`: for each position the target computed and
kept, the states entering those layers, concatenated ([T, 3H]), which the model runner returns
from the same forward (`ModelRunner.run_features(rows, aux_layers)`); an engine that hands the
final states instead is refused. `observe` fuses them with the drafter's fc at once, so what
EagleProposer keeps and feeds is H wide, as the drafter's own states fed after the first draft
token are.
"""

from __future__ import annotations

import os

import torch

from reclaim.engine.eagle import EagleProposer
from reclaim.models.eagle3 import Eagle3Drafter, load_eagle3


class Eagle3Proposer(EagleProposer):
    """Chain or tree drafts from an EAGLE-3 drafter (see EagleProposer for topk, depth, total)."""

    def __init__(self, drafter: Eagle3Drafter, target: torch.nn.Module, **tree: int) -> None:
        super().__init__(drafter, target, **tree)
        self.aux_layers = drafter.aux_layers  # what the engine hands observe: these layers' input states

    @torch.inference_mode()
    def observe(self, seq_id: str, start: int, token_ids: list[int], hidden: torch.Tensor) -> None:
        """Take the aux states [len(token_ids), 3H] of positions start, start + 1, ...; final
        hidden states ([.., H]: an engine that does not ask the runner for aux_layers) are refused."""
        fc = self.drafter.fc
        if hidden.shape[-1] != fc.in_features:
            raise ValueError(f"Eagle3Proposer.observe got states of width {hidden.shape[-1]}; it takes the "
                             f"target's states entering layers {list(self.aux_layers)}, concatenated (width "
                             f"{fc.in_features}): ModelRunner.run_features(rows, aux_layers)")
        super().observe(seq_id, start, token_ids, fc(hidden.to(fc.weight.dtype)))

    def _logits(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.drafter.head(g)

    @classmethod
    def load(cls, path: str | os.PathLike, target: torch.nn.Module, **tree: int) -> "Eagle3Proposer":
        return cls(load_eagle3(path, target), target, **tree)
