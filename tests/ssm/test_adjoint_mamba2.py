"""Mamba-2 under the adjoint: the exact adjoint equals autograd for every parameter, the truncated
one equals backprop through the last W transitions, bad input is refused by name."""

import pytest
import torch
import torch.nn.functional as F

from reclaim.models import ssd
from reclaim.models.mamba2 import Mamba2Config, Mamba2ForCausalLM
from reclaim.models.ssd import ssd_scan, ssd_scan_ref
from reclaim.ssm.adjoint import adjoint_loss_backward
from reclaim.ssm.window import Window, scan_for

pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(layers=2, dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    shape = dict(vocab_size=41, hidden_size=12, state_size=4, num_heads=6, head_dim=4, n_groups=3,
                 conv_kernel=4, time_step_min=0.05, time_step_max=0.5)
    model = Mamba2ForCausalLM(Mamba2Config(num_hidden_layers=layers, **{**shape, **kw})).to(dtype)
    with torch.no_grad():  # perturb everything so no gradient is trivially zero or symmetric
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def autograd_grads(model, ids):
    model.zero_grad()
    logits = model(ids).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def adjoint_grads(model, ids, **kw):
    model.zero_grad()
    loss = adjoint_loss_backward(model, ids, **kw)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def rel_err(a, b):
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max()).item() for n in b)


@pytest.mark.parametrize("recompute", ["chunk", "layer"])
def test_exact_adjoint_equals_autograd_for_every_parameter(recompute, monkeypatch):
    monkeypatch.setattr(ssd, "CPU_MAX_BLOCK", 4)  # several SSD blocks inside each chunk, one short
    model = make_model(3, use_bias=True, time_step_limit=(0.02, 0.4))
    ids = torch.randint(0, 41, (2, 23))
    ref_loss, ref = autograd_grads(model, ids)
    assert all(g.abs().max() > 0 for g in ref.values())
    for chunk in (7, 10):  # divides neither 23 nor the SSD block
        loss, got = adjoint_grads(model, ids, chunk=chunk, loss_chunk=5, recompute=recompute)
        assert abs(loss - ref_loss) <= 1e-12 * ref_loss
        assert rel_err(got, ref) <= 1e-9, (chunk, rel_err(got, ref))


def test_exact_adjoint_with_one_group_and_a_tied_head():
    model = make_model(2, n_groups=1, tie_word_embeddings=True, conv_kernel=2)
    ids = torch.randint(0, 41, (1, 19))
    _, ref = autograd_grads(model, ids)
    _, got = adjoint_grads(model, ids, chunk=6)
    assert rel_err(got, ref) <= 1e-9


def test_truncated_with_window_covering_the_sequence_is_exact():
    model = make_model(2)
    ids = torch.randint(0, 41, (2, 18))
    _, ref = autograd_grads(model, ids)
    for w in (18, 100):
        _, got = adjoint_grads(model, ids, chunk=5, window=w)
        assert rel_err(got, ref) <= 1e-9


def test_truncated_window_changes_gradients_and_is_chunk_invariant(monkeypatch):
    monkeypatch.setattr(ssd, "CPU_MAX_BLOCK", 4)
    monkeypatch.setattr(ssd, "MIN_BACKWARD_BLOCK", 4)
    model = make_model(2)
    ids = torch.randint(0, 41, (2, 21))
    _, ref = autograd_grads(model, ids)
    _, a = adjoint_grads(model, ids, chunk=5, window=6)
    _, b = adjoint_grads(model, ids, chunk=6, window=6)
    _, c = adjoint_grads(model, ids, chunk=1, window=6)
    _, d = adjoint_grads(model, ids, chunk=5, window=6, recompute="layer")
    assert rel_err(a, ref) > 1e-6  # it does truncate
    assert rel_err(a, b) <= 1e-9 and rel_err(c, b) <= 1e-9 and rel_err(d, b) <= 1e-9


def scan_inputs(t, seed=0):
    torch.manual_seed(seed)
    b, heads, p, g, n = 2, 4, 3, 2, 5
    ins = [torch.randn(b, t, heads, p), torch.rand(b, t, heads) * 0.5 + 0.05, -torch.rand(heads) - 0.2,
           torch.randn(b, t, g, n), torch.randn(b, t, g, n), torch.randn(b, heads, p, n)]
    return [v.double().requires_grad_() for v in ins]


def truncated_oracle(ins, gy, w):
    """Autograd of the recurrence where each output y_t reaches back through only its last w
    transitions: the state before them is detached."""
    x, dt, A, B, C, h0 = ins
    with torch.no_grad():
        hs = [h0] + [ssd_scan_ref(x[:, :s], dt[:, :s], A, B[:, :s], C[:, :s], h0)[1]
                     for s in range(1, x.shape[1])]  # hs[s]: the state after the first s tokens
    total = 0
    for t in range(x.shape[1]):
        s = max(0, t + 1 - w)
        start = h0 if s == 0 else hs[s].detach()
        y, _ = ssd_scan_ref(x[:, s:t + 1], dt[:, s:t + 1], A, B[:, s:t + 1], C[:, s:t + 1], start)
        total = total + (y[:, -1] * gy[:, t]).sum()
    return torch.autograd.grad([total], ins[:5])


@pytest.mark.parametrize("w", [1, 3, 7])
def test_truncated_ssd_equals_windowed_backprop(w, monkeypatch):
    monkeypatch.setattr(ssd, "MIN_BACKWARD_BLOCK", 4)
    monkeypatch.setattr(ssd, "BLOCK_ELEMENTS", 2 * 4 * 3 * 5 * 4)  # 4-token backward blocks
    ins = scan_inputs(19)
    y, _ = scan_for(Window(w), ssd_scan)(*ins)
    gy = torch.randn_like(y)
    got = torch.autograd.grad([y], ins[:5], [gy])
    for g, r in zip(got, truncated_oracle(ins, gy, w)):
        assert (g - r).abs().max() <= 1e-11 * r.abs().max()


def test_hand_written_backward_under_a_covering_window_is_autograd(monkeypatch):
    monkeypatch.setattr(ssd, "MIN_BACKWARD_BLOCK", 4)
    monkeypatch.setattr(ssd, "BLOCK_ELEMENTS", 2 * 4 * 3 * 5 * 4)
    ins = scan_inputs(15)
    y, h = scan_for(Window(15), ssd_scan)(*ins)
    yr, hr = ssd_scan_ref(*ins)
    gy, gh = torch.randn_like(y), torch.randn_like(h)
    got = torch.autograd.grad([y, h], ins, [gy, gh])
    ref = torch.autograd.grad([yr, hr], ins, [gy, gh])
    for g, r in zip(got, ref):
        assert (g - r).abs().max() <= 1e-12 * r.abs().max()


def test_rejects_bad_input_by_name():
    model = make_model(1)
    ids = torch.randint(0, 41, (1, 9))
    with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
        adjoint_loss_backward(model, ids, chunk=0)
    with pytest.raises(ValueError, match="chunk must be >= 1, got -3"):
        adjoint_loss_backward(model, ids, chunk=-3)
    with pytest.raises(ValueError, match=r"window \(3\) must be >= chunk \(4\) for Mamba-2"):
        adjoint_loss_backward(model, ids, chunk=4, window=3)
    with pytest.raises(ValueError, match="window must be >= 1"):
        adjoint_loss_backward(model, ids, chunk=2, window=0)
    with pytest.raises(ValueError, match=r"num_heads \(6\) must be a positive multiple of n_groups \(4\)"):
        make_model(1, n_groups=4)
    x, dt, A, B, C, h0 = scan_inputs(5)
    with pytest.raises(ValueError, match=r"head count \(4\) must be divisible by the group count \(3\)"):
        ssd_scan(x, dt, A, B.repeat(1, 1, 2, 1)[:, :, :3], C.repeat(1, 1, 2, 1)[:, :, :3], h0)
    model.backbone.layers.append(torch.nn.Linear(2, 2))
    supported = r"\['MambaMixer', 'Mamba2Mixer', 'Attention', 'RotaryAttention', 'MLP'\]"
    with pytest.raises(ValueError, match="no adjoint for layer type Linear; supported: " + supported):
        adjoint_loss_backward(model, ids, chunk=2)
