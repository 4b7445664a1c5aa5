"""What a grammar (structured output, tool calls) offers the engine: the tokens allowed next.

The engine applies a request's mask inside its sampler, batched with unconstrained requests,
calls `accept` for every token it commits and stops the request when the grammar is `finished`.
A constraint that also has `rollback(num_tokens)` (undo the last accepted tokens) is speculated:
the engine advances it over a draft to mask each draft position, then rolls it back.
A constraint that raises fails its own request only. One object per request: it holds the
grammar's state. The server builds them (reclaim/server/structured.py); the engine needs only
this protocol.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Constraint(Protocol):
    def allowed(self, vocab_size: int) -> torch.Tensor | None:
        """Bool mask [vocab_size] of the tokens allowed next; None allows all."""
        ...

    def accept(self, token_id: int) -> None:
        """Advance past a committed token."""
        ...

    def finished(self) -> bool:
        """The grammar is complete: the request stops with finish_reason 'stop'."""
        ...
