"""What the SSM family tests share: a transformers model and ours with the same random weights,
relative error, and gradients by autograd or by the adjoint."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reclaim.ssm.adjoint import adjoint_loss_backward


def hf_pair(hf_config: type, hf_model: type, config: type, model: type, kw: dict, seed: int = 0,
            dtype: torch.dtype = torch.float64):
    """transformers' model of config `kw` with every parameter perturbed (no value trivially 0 or 1)
    and ours loaded from its state dict."""
    torch.manual_seed(seed)
    hf = hf_model(hf_config(**kw, use_cache=False)).to(dtype).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ours = model(config.from_hf(hf.config.to_dict())).to(dtype)
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def grads(model: torch.nn.Module, ids: torch.Tensor, **adjoint) -> tuple[float, dict[str, torch.Tensor]]:
    """Next-token loss and every parameter's gradient: autograd through the model's forward, or
    `adjoint_loss_backward(model, ids, **adjoint)` when given its arguments."""
    model.zero_grad()
    if adjoint:
        loss = adjoint_loss_backward(model, ids, **adjoint)
    else:
        logits = model(ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        loss = loss.item()
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}
