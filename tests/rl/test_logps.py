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
