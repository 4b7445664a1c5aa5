"""Completion log-probs with each prompt run once for all its completions (reclaim/rl/logps.py),
against the plain oracle: a separate full forward of each prompt + completion, its log-probs and
autograd's gradients."""

from __future__ import annotations

import pytest
import torch
from rl_helpers import tiny_target

from reclaim.rl.logps import completion_logps, pack

# Interleaved groups as a shuffled GRPO micro-batch has them: prompt A three times, B twice, C once.
A, B, C = [3, 4, 5, 6], [7, 8], [9]
PROMPTS = [A, B, A, C, A, B]
COMPLETIONS = [[10, 11, 12], [13], [14, 15, 16, 17, 18], [19, 20], [21], [22, 23, 24, 25]]


def _separate(model, prompts, comps, temperature):
    """Each prompt + completion on its own row: the log-probs of its tokens and their entropies."""
    out = []
    for p, c in zip(prompts, comps):
        logp = torch.log_softmax(model(torch.tensor([p + c])).logits[0] / temperature, -1)
        at = logp[len(p) - 1:len(p) + len(c) - 1]
        out.append((at.gather(-1, torch.tensor(c)[:, None]).squeeze(-1), -(at.exp() * at).sum(-1)))
    return out


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("budget", [None, 6])
def test_log_probs_and_entropies_equal_separate_rows(window, budget, monkeypatch):
    """Also when a prompt's completions do not fit one row (budget 6: A's three take three rows)."""
    if budget is not None:
        monkeypatch.setattr("reclaim.rl.logps.row_budget", lambda config: budget)
    model = tiny_target(50, sliding_window=window)
    logps, ent = completion_logps(model, PROMPTS, COMPLETIONS, temperature=0.7, entropy=True)
    assert logps.shape == ent.shape == (6, 5)
    for i, (lp, e) in enumerate(_separate(model, PROMPTS, COMPLETIONS, 0.7)):
        n = len(COMPLETIONS[i])
        torch.testing.assert_close(logps[i, :n], lp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent[i, :n], e, atol=1e-5, rtol=1e-5)
        assert bool((logps[i, n:] == 0).all()) and bool((ent[i, n:] == 0).all())


@pytest.mark.parametrize("budget", [None, 6])
def test_gradients_equal_separate_rows(budget, monkeypatch):
    """The shared prompt's gradient sums over its completions, as separate rows give."""
    if budget is not None:
        monkeypatch.setattr("reclaim.rl.logps.row_budget", lambda config: budget)
    model = tiny_target(50)
    weights = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    logps, _ = completion_logps(model, PROMPTS, COMPLETIONS, temperature=0.9)
    (logps * weights).sum().backward()
    ours = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    sum((lp * weights[i, :len(lp)]).sum() for i, (lp, _) in enumerate(_separate(model, PROMPTS, COMPLETIONS, 0.9))
        ).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, atol=1e-4, rtol=1e-4, msg=name)  # |grad| up to ~20


def test_each_prompt_is_one_row():
    packed = pack(PROMPTS, COMPLETIONS)
    assert packed.ids.shape == (3, len(A) + 3 + 5 + 1)  # A and its three completions is the longest row
    real = int((packed.segment >= 0).sum())
    assert real == len(A) + len(B) + len(C) + sum(map(len, COMPLETIONS))  # no prompt twice, no padding
    assert int(packed.slot_valid.sum()) == sum(map(len, COMPLETIONS))


def test_a_row_holds_completions_up_to_its_budget():
    """Rows of at most 8 tokens unless one completion needs more: A + [10, 11, 12] (7), A + the
    5-token completion (9, alone), A + [21] (5); B + [13] + [22..25] (7); C + [19, 20] (3)."""
    packed = pack(PROMPTS, COMPLETIONS, budget=8)
    rows = [[int(t) for t, s in zip(ids, seg) if s >= 0] for ids, seg in zip(packed.ids, packed.segment)]
    assert rows == [A + [10, 11, 12], A + [14, 15, 16, 17, 18], A + [21], B + [13, 22, 23, 24, 25], C + [19, 20]]


def test_an_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        pack([[1], []], [[2], [3]])


def test_an_empty_completion_gives_an_empty_row():
    model = tiny_target(50)
    logps, _ = completion_logps(model, [A, A], [[], [10, 11]])
    assert logps.shape == (2, 2) and bool((logps[0] == 0).all())
    torch.testing.assert_close(logps[1], _separate(model, [A], [[10, 11]], 1.0)[0][0], atol=1e-5, rtol=1e-5)


# ---- the LM head in chunks of positions ----

def _separate_fp64(model, prompts, comps, temperature):
    """The float64 oracle: each prompt + completion on its own row, the head applied in float64
    (the model's own logits are float32)."""
    out = []
    for p, c in zip(prompts, comps):
        h = model(torch.tensor([p + c]), return_hidden=True, compute_logits=False).hidden[0]
        logp = torch.log_softmax(h @ model.lm_head.weight.T / temperature, -1)[len(p) - 1:len(p) + len(c) - 1]
        out.append((logp.gather(-1, torch.tensor(c)[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)))
    return out


@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])
def test_chunked_log_probs_and_gradients_equal_unchunked_in_float64(chunk, monkeypatch):
    """Relative error <= 1e-6 in float64 against the separate-row oracle, log-probs, entropies and
    every parameter's gradient; a chunk that does not divide the 16 positions, one of one, one of all.
    Rows of budget 6 also split a prompt's completions over rows."""
    monkeypatch.setattr("reclaim.rl.logps.row_budget", lambda config: 6)
    model = tiny_target(50).double()
    weights = torch.randn(6, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    logps, ent = completion_logps(model, PROMPTS, COMPLETIONS, temperature=0.7, entropy=True, chunk_size=chunk)
    assert logps.dtype == ent.dtype == torch.float64
    (logps * weights).sum().backward()
    ours = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    oracle = _separate_fp64(model, PROMPTS, COMPLETIONS, 0.7)
    sum((lp * weights[i, :len(lp)]).sum() for i, (lp, _) in enumerate(oracle)).backward()
    for i, (lp, e) in enumerate(oracle):
        n = len(COMPLETIONS[i])
        torch.testing.assert_close(logps[i, :n], lp, rtol=1e-6, atol=0)
        torch.testing.assert_close(ent[i, :n], e, rtol=1e-6, atol=0)
        assert bool((logps[i, n:] == 0).all()) and bool((ent[i, n:] == 0).all())
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-6, atol=1e-12, msg=name)


def test_chunked_equals_unchunked_in_float32_and_bf16_autocast():
    model = tiny_target(50)
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            whole, e_whole = completion_logps(model, PROMPTS, COMPLETIONS, 0.9, entropy=True)
            chunked, e_chunked = completion_logps(model, PROMPTS, COMPLETIONS, 0.9, entropy=True, chunk_size=3)
        assert chunked.dtype == whole.dtype == torch.float32
        tol = 2e-2 if autocast else 1e-5
        torch.testing.assert_close(chunked, whole, atol=tol, rtol=tol)
        torch.testing.assert_close(e_chunked, e_whole, atol=tol, rtol=tol)


class _VocabSized(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest number of positions of any tensor an op makes with a vocabulary-sized
    last dimension (the head's weight, [V, H] or [H, V], excepted)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab, self.hidden, self.most = vocab, hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() and self.vocab in t.shape \
                    and sorted(t.shape) != sorted((self.vocab, self.hidden)):
                self.most = max(self.most, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("chunk", [None, 4])
def test_no_tensor_of_all_positions_by_the_vocabulary(chunk):
    """Forward and backward make no [positions, vocabulary] tensor of more than chunk_size
    positions; the unchunked path (None) makes one of all 16 (and padding), which shows the check can fail."""
    vocab = 97  # a size no other dimension has
    model = tiny_target(vocab)
    spy = _VocabSized(vocab, model.config.hidden_size)
    with spy:
        logps, _ = completion_logps(model, PROMPTS, COMPLETIONS, 0.8, entropy=True, chunk_size=chunk)
        logps.sum().backward()
    assert model.lm_head.weight.grad is not None
    if chunk is None:  # [rows, slots, V] with padding
        assert spy.most >= sum(map(len, COMPLETIONS))
    else:
        assert spy.most == chunk


def test_a_bad_chunk_size_is_refused():
    with pytest.raises(ValueError, match="chunk_size must be >= 1 or None"):
        completion_logps(tiny_target(50), [A], [[10]], chunk_size=0)
