"""The regression gate: with a held-out probe set, an update that raises its loss by more than
max_probe_regression is undone (weights and optimizer bit for bit) and its feedback quarantined;
good corrections are kept. A probe file that does not parse is refused with its line number."""

from __future__ import annotations

import json

import pytest
import torch
from online_helpers import tiny_model

from reclaim.online.learner import OnlineLearner
from reclaim.online.probe import load_probes
from reclaim.online.recorder import recompute_loss
from reclaim.online.trainer import CostModel, OnlineTrainConfig

FACTS = [(f"capital {c}?", f" {c.lower()}{c.lower()}ville") for c in "ABCDEFGH"]
KNOWN, NEW = FACTS[:4], FACTS[4:]  # the model knows the first four (the probe set), not the rest
POISON = " zzzzzzzzzzzzville"


def tokenize(text: str) -> list[int]:
    return [2 + ord(c) % 90 for c in text]


def loss_on(model, facts) -> float:
    with torch.no_grad():
        loss, n = recompute_loss(model, [tokenize(p) for p, _ in facts], [tokenize(a) for _, a in facts])
    return float(loss) / n


def knowing(facts, steps=10):
    """A tiny model taught `facts` with a few Adam steps (in well under a second)."""
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        loss, n = recompute_loss(model, [tokenize(p) for p, _ in facts], [tokenize(a) for _, a in facts])
        (loss / n).backward()
        opt.step()
    return model


def test_poisoned_corrections_are_undone_and_good_ones_kept(tmp_path):
    probe = tmp_path / "probe.jsonl"
    probe.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in KNOWN))
    cfg = OnlineTrainConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2,
                            learning_rate=2e-3, save_steps=0, keep_versions=2, probe_path=str(probe),
                            max_probe_regression=0.03)
    model = knowing(KNOWN)
    new_before = loss_on(model, NEW)
    learner = OnlineLearner(model, cfg, tokenize=tokenize, cost=CostModel.fixed("recompute"))
    good, bad = [], []
    # batches of two: new facts taught right, then known facts "corrected" to a wrong answer
    for i, ((prompt, answer), poisoned) in enumerate(zip(NEW[:2] + KNOWN[:2] + NEW[2:] + KNOWN[2:],
                                                         [False] * 2 + [True] * 2 + [False] * 2 + [True] * 2)):
        learner.on_response(f"r{i}", tokenize(prompt), tokenize(" no idea"))
        if poisoned:
            bad.append(learner.feedback(f"r{i}", -1, POISON))
        else:
            good.append(learner.feedback(f"r{i}", 1, answer))
    entries = []
    while True:
        before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
        version = learner.version
        entry = learner.train_step()
        if entry is None:
            break
        entries.append(entry)
        if not entry["accepted"]:  # undone: the weights of the version before, every bit
            assert learner.version == version
            assert all(torch.equal(p, before[n]) for n, p in learner.model.named_parameters())
    verdicts = {fid: e["accepted"] for e in entries for fid in e["feedback_ids"]}
    assert [verdicts[f] for f in bad] == [False] * len(bad)  # 100% of the poisoned batches undone
    assert [verdicts[f] for f in good] == [True] * len(good)  # every good one kept
    log = learner.log
    assert {f.id for f in log.all() if f.rejected == "quarantined"} == set(bad)
    assert all(log.get(f).trained_at_step is not None and log.get(f).rejected is None for f in good)
    assert loss_on(learner.model, NEW) < new_before  # the good corrections were learned
    m = learner.metrics()
    assert m["quarantined_feedback"] == len(bad) and m["train_probe_rejected"] == 2
    assert m["train_probe_accepted"] == 2 and m["train_probe_loss"] == learner.trainer.gate.loss
    lines = [json.loads(ln) for ln in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [e["accepted"] for e in lines] == [True, False, True, False]
    assert all(e["probe_loss"] - e["probe_loss_before"] > 0.03 for e in lines if not e["accepted"])
    # a restart reopens the kept feedback (save_steps=0: its weights were never saved), never the
    # quarantined
    again = OnlineLearner(tiny_model(), cfg, tokenize=tokenize, cost=CostModel.fixed("recompute"))
    assert [f.id for f in again.log.pending()] == good


@pytest.mark.parametrize("text,where", [
    ('{"prompt": "a", "answer": "b"}\n{"prompt": "a", "answer": \n', "line 2: not JSON"),
    ('{"text": "fine"}\n\n{"prompt": "a"}\n', r"line 3: got \['prompt'\]"),
    ('{"text": ""}\n', "line 1: prompt must be a string and answer"),
    ('["text"]\n', "line 1: got list"),
    ("\n", "has no examples"),
])
def test_a_probe_file_that_does_not_parse_is_refused_with_its_line(tmp_path, text, where):
    path = tmp_path / "probe.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=where):
        load_probes(path)


def test_probe_config_is_checked():
    with pytest.raises(ValueError, match="keep_versions=0 with probe_path"):
        OnlineTrainConfig(probe_path="p.jsonl", keep_versions=0)
    with pytest.raises(ValueError, match=r"max_probe_regression=-1; allowed: >= 0"):
        OnlineTrainConfig(max_probe_regression=-1)
