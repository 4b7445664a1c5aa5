"""The embedding's gradient added in place, row by row, not as a dense [vocab, hidden] tensor.

Autograd's embedding backward makes a zero gradient of the whole table, adds the rows of the
tokens used, and hands it to the weight's accumulator, which adds it to `.grad` (summed first with
the head's gradient when the two are tied): for SmolLM2 (49,152 x 576) several passes over 113 MB
for every backward, 0.1-0.4 s on one CPU thread for a sample of a few hundred tokens, and one unit
that a training step run in slices cannot stop inside. `RowGradEmbedding(model)` gives the
embedding's output, in grad mode, a backward that adds the gradient's rows into `weight.grad` at
the tokens' rows (`index_add_`) and hands the accumulator nothing; the sum is the same.

Single-process only (the online trainer): data-parallel reducers read a weight's gradient when its
accumulator runs, which this bypasses.

    hook = RowGradEmbedding(model)   # every embedding of the model
    hook.remove()
"""

from __future__ import annotations

from typing import Any

import torch


class _RowGrad(torch.autograd.Function):
    """Forward: the embedding's (detached) output as is. Backward: rows into weight.grad."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        (ids,) = ctx.saved_tensors
        w = ctx.weight
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        w.grad.index_add_(0, ids.flatten(), grad.reshape(-1, grad.shape[-1]).to(w.grad.dtype))
        return None, None, None


class RowGradEmbedding:
    """Forward hooks on every nn.Embedding of `model` whose weight is trained (once per module:
    a second RowGradEmbedding of the same model hooks nothing)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.handles = []
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and m.weight.requires_grad and not getattr(m, "_row_grad", False):
                m._row_grad = True
                self.handles.append((m, m.register_forward_hook(self._hook)))

    @staticmethod
    def _hook(module: torch.nn.Embedding, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if not (torch.is_grad_enabled() and output.requires_grad) or module.sparse:
            return None
        return _RowGrad.apply(output.detach(), args[0], module.weight)

    def remove(self) -> None:
        for m, h in self.handles:
            h.remove()
            m._row_grad = False
        self.handles.clear()
