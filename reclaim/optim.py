"""The optimizer the trainers share: AdamW, fused, with its state made up front."""

from __future__ import annotations

import torch


def adamw(params: list[torch.nn.Parameter], **kwargs: float | tuple[float, float]) -> torch.optim.AdamW:
    """AdamW, fused where the parameters allow: one pass over the weights (7x faster than the
    default on a CPU for SmolLM2: 0.08 s against 0.57 s a step), so the step that changes the
    served weights is short. Every trainer of a whole model builds its optimizer here."""
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    # Weights read from a memory-mapped checkpoint stay the file's pages until first written: the
    # first step would fault them all in (0.69 s against 0.18 s for SmolLM2 on a CPU) between two
    # serving steps. They get pages of their own now.
    with torch.no_grad():
        for p in params:
            p.data = p.data.clone()
    opt = torch.optim.AdamW(params, fused=fused or None, **kwargs)
    # Its state made now (what the first step would make: step 0, zero moments), so the first
    # step between two serving steps does not stall on allocating twice the weights' bytes.
    opt.load_state_dict({"param_groups": opt.state_dict()["param_groups"], "state": {
        i: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        for i, p in enumerate(params)}})
    return opt
