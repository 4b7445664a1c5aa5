"""A hybrid (Mamba-2, attention, MLP layers) under the adjoint: attention's keys and values of
earlier chunks are kept, their gradients fed back into the chunks that made them, and every
parameter's gradient equals autograd's."""

import pytest
import torch
import torch.nn.functional as F

from reclaim.models import ssd
from reclaim.models.nemotron_h import KVState, NemotronHConfig, NemotronHForCausalLM
from reclaim.ssm.adjoint import adjoint_loss_backward, chunk_bounds, forward_states

pytestmark = pytest.mark.usefixtures("one_thread")

M, A, P = "linear_attention", "full_attention", "mlp"


def make_model(layers=(M, A, P, M, A), dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    shape = dict(vocab_size=41, hidden_size=12, num_attention_heads=4, num_key_value_heads=2, head_dim=3,
                 intermediate_size=20, ssm_state_size=4, mamba_num_heads=6, mamba_head_dim=3, n_groups=3,
                 time_step_min=0.05, time_step_max=0.5)
    model = NemotronHForCausalLM(NemotronHConfig(layers_block_type=list(layers), **{**shape, **kw})).to(dtype)
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
    monkeypatch.setattr(ssd, "CPU_MAX_BLOCK", 4)  # several SSD blocks inside each chunk
    model = make_model(use_bias=True, mlp_bias=True)
    ids = torch.randint(0, 41, (2, 23))
    ref_loss, ref = autograd_grads(model, ids)
    assert all(g.abs().max() > 0 for g in ref.values())
    for chunk in (1, 7, 10):  # 7 and 10 divide neither 23 nor the SSD block
        loss, got = adjoint_grads(model, ids, chunk=chunk, loss_chunk=5, recompute=recompute)
        assert abs(loss - ref_loss) <= 1e-12 * ref_loss
        assert rel_err(got, ref) <= 1e-9, (chunk, rel_err(got, ref))


def test_exact_adjoint_attention_first_and_full_heads():
    model = make_model((A, P, M, A), num_key_value_heads=4, n_groups=1)
    ids = torch.randint(0, 41, (1, 17))
    _, ref = autograd_grads(model, ids)
    _, got = adjoint_grads(model, ids, chunk=6)
    assert rel_err(got, ref) <= 1e-9


def test_truncated_window_covers_the_sequence_is_exact_and_else_chunk_invariant():
    model = make_model()
    ids = torch.randint(0, 41, (2, 20))
    _, ref = autograd_grads(model, ids)
    _, got = adjoint_grads(model, ids, chunk=6, window=20)
    assert rel_err(got, ref) <= 1e-9
    _, a = adjoint_grads(model, ids, chunk=5, window=7)
    _, b = adjoint_grads(model, ids, chunk=7, window=7)
    assert rel_err(a, ref) > 1e-6  # the Mamba-2 layers' adjoint is truncated ...
    attention = [n for n in ref if ".layers.1." in n]
    assert rel_err({n: a[n] for n in attention}, {n: ref[n] for n in attention}) > 1e-6  # ... which reaches below
    assert rel_err(a, b) <= 1e-9


def test_attention_keys_at_chunk_starts_are_views_of_one_buffer():
    """O(T) bytes for attention, not a copy of the keys so far at every chunk start."""
    model = make_model()
    ids = torch.randint(0, 41, (2, 20))
    bounds = chunk_bounds(20, 6)
    saved = forward_states(model, ids, bounds)
    last = saved[-1][1]
    assert isinstance(last, KVState)
    for (s, _), row in zip(bounds, saved):
        k, v = row[1]
        assert k.shape == (2, 2, s, 3) and v.shape == (2, 2, s, 3)
        assert k.untyped_storage().data_ptr() == last.k.untyped_storage().data_ptr()


def test_rejects_a_window_shorter_than_a_chunk():
    with pytest.raises(ValueError, match=r"window \(4\) must be >= chunk \(5\) for Mamba-2"):
        adjoint_loss_backward(make_model(), torch.randint(0, 41, (1, 9)), chunk=5, window=4)
