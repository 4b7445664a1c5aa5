"""Learning-rate schedules: step for step what transformers' schedulers give."""

import pytest
import torch
from transformers import get_scheduler

from reclaim.schedule import SCHEDULES, lr_scheduler


def _lrs(make, steps: int) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("warmup,total", [(0, 10), (1, 10), (3, 10), (10, 10), (4, 1)])
def test_same_learning_rate_as_transformers_at_every_step(name, warmup, total):
    ours = _lrs(lambda o: lr_scheduler(o, name, warmup_steps=warmup, total_steps=total), total + 3)
    theirs = _lrs(lambda o: get_scheduler(name, o, num_warmup_steps=warmup,
                                          num_training_steps=total), total + 3)
    assert ours == pytest.approx(theirs, abs=1e-15)


def test_warmup_starts_from_zero_and_resumes_from_its_state():
    lrs = _lrs(lambda o: lr_scheduler(o, "linear", warmup_steps=4, total_steps=8), 8)
    assert lrs[:5] == pytest.approx([0.0, 0.075, 0.15, 0.225, 0.3])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
    a = lr_scheduler(opt, "cosine", warmup_steps=2, total_steps=8)
    for _ in range(5):
        opt.step()
        a.step()
    b = lr_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3), "cosine",
                     warmup_steps=2, total_steps=8)
    b.load_state_dict(a.state_dict())
    assert (b.last_epoch, b.get_last_lr()) == (5, a.get_last_lr())


def test_unknown_schedule_names_the_allowed_ones():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
    with pytest.raises(ValueError, match="'step'.*linear"):
        lr_scheduler(opt, "step", warmup_steps=0, total_steps=5)
