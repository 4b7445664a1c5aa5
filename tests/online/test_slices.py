"""Training in slices between serving steps: a step cut at every layer boundary ends with the same
weights as one run whole, serving between its slices sees the old weights throughout, closing
abandons a parked step with its feedback still pending, and the co-location schedule gives a
busy engine's time to training only as max_ttft_slowdown allows."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from online_helpers import tiny_model, token_lists

from reclaim.models.mamba import MambaConfig, MambaForCausalLM
from reclaim.online.colocate import Colocated, credit_rate
from reclaim.online.learner import OnlineLearner
from reclaim.online.slices import TrainingSlices, boundaries
from reclaim.online.trainer import CostModel, OnlineTrainConfig


def learner_with_feedback(tmp_path, name: str, n: int = 2) -> OnlineLearner:
    cfg = OnlineTrainConfig(output_dir=str(tmp_path / name), record="requested", save_steps=0,
                            learning_rate=1e-2, per_device_train_batch_size=n)
    learner = OnlineLearner(tiny_model(), cfg, tokenize=lambda s: [2 + ord(c) % 90 for c in s],
                            cost=CostModel.fixed("reuse"))
    for i, prompt in enumerate(token_lists([12, 7, 9][:n])):
        if i == 0:
            learner.record(prompt, f"r{i}")  # one sample reuses its record, the others recompute
        learner.on_response(f"r{i}", prompt, [5, 6, 7])
        learner.feedback(f"r{i}", 1, "a fixed answer")
    return learner


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_a_sliced_step_equals_a_whole_one_and_serving_sees_old_weights_until_its_end(tmp_path):
    whole = learner_with_feedback(tmp_path, "whole")
    whole.train_step()
    sliced = learner_with_feedback(tmp_path, "sliced")
    model = sliced.model
    before = weights(model)
    ids = torch.tensor([token_lists([10], seed=5)[0]])
    with torch.inference_mode():
        served_before = model(ids).logits
    slices = TrainingSlices(model, sliced.train_step)
    sliced.trainer.pause = slices.boundary  # as Colocated wires it: before clipping, before the step
    entry, grants, parked_with_grads = None, 0, 0
    while entry is None:
        entry = slices.grant(0.0)  # a zero slice: park at every boundary
        grants += 1
        if entry is None and all(p.grad is not None for p in model.parameters()):
            parked_with_grads += 1  # the backward is done; the optimizer step has not run
        if entry is None:  # serving between two slices: the step's weights are not in yet
            with torch.inference_mode():
                assert torch.equal(model(ids).logits, served_before)
            assert all(torch.equal(a, b) for a, b in zip(weights(model), before))
    slices.close()
    # 2 layers and the head parked in the forward of each path, and again in the backward
    assert grants >= 2 * 3
    assert parked_with_grads >= 2  # the step's own boundaries: before clipping and before the step
    assert [d["action"] for d in entry["decisions"]] == ["reuse", "recompute"]
    assert all(torch.equal(a, b) for a, b in zip(weights(model), weights(whole.model)))
    assert not any(torch.equal(a, b) for a, b in zip(weights(model), before) if a.dim() == 2)
    assert sliced.version == 1 and sliced.log.pending_count() == 0


def test_close_abandons_a_parked_step_and_its_feedback_stays_pending(tmp_path):
    learner = learner_with_feedback(tmp_path, "closed")
    before = weights(learner.model)
    slices = TrainingSlices(learner.model, learner.train_step)
    assert slices.grant(0.0) is None and slices.in_step
    slices.close()
    assert not slices.in_step
    assert learner.version == 0 and learner.log.pending_count() == 2
    assert all(torch.equal(a, b) for a, b in zip(weights(learner.model), before))
    layers = learner.model.model.layers
    assert not any(layer._forward_pre_hooks or layer._forward_hooks for layer in layers)
    with pytest.raises(RuntimeError, match="closed"):
        slices.grant(1.0)


def test_a_failing_step_raises_in_the_serving_thread(tmp_path):
    model = tiny_model()

    def step():
        model(torch.tensor([[3, 4, 5]]))
        raise ValueError("broken batch")

    slices = TrainingSlices(model, step)
    with pytest.raises(ValueError, match="broken batch"):
        while slices.grant(0.0) is None:
            pass
    assert not slices.in_step
    slices.close()


def test_a_busy_engine_lends_training_only_its_max_ttft_slowdown(tmp_path):
    learner = learner_with_feedback(tmp_path, "colocated")
    state = SimpleNamespace(unfinished=True, changed=0)
    engine = SimpleNamespace(model=learner.model, has_unfinished=lambda: state.unfinished,
                             weights_changed=lambda: setattr(state, "changed", state.changed + 1))
    strict = Colocated(learner, engine, max_ttft_slowdown=0.0)
    assert strict.busy
    for _ in range(5):  # no slowdown allowed: a busy engine never trains
        assert strict.after_step(0.5) is None
    assert strict.slices.slices == 0 and learner.version == 0
    state.unfinished = False  # idle: short slices until the step ends
    entry = None
    while entry is None:
        entry = strict.after_step(0.0)
    assert learner.version == 1 and state.changed == 1 and engine.weights_version == 1  # the learner's version
    assert not strict.busy and strict.after_step(0.0) is None
    strict.close()


def test_a_step_waits_for_a_full_batch_or_max_feedback_wait(tmp_path):
    """Two feedback of a batch of three: no step starts (each step makes the records in flight
    stale, so steps wait to be full); the third starts one; a partial batch that waited
    max_feedback_wait_s starts one too."""
    learner = learner_with_feedback(tmp_path, "batch", n=2)
    learner.cfg.per_device_train_batch_size = 3
    state = SimpleNamespace(unfinished=False, changed=0)
    engine = SimpleNamespace(model=learner.model, has_unfinished=lambda: state.unfinished,
                             weights_changed=lambda: None)
    patient = Colocated(learner, engine, max_feedback_wait_s=3600)  # default 0: at once
    assert not patient.ready and patient.after_step(0.0) is None and patient.slices.slices == 0
    prompt = token_lists([6], seed=9)[0]
    learner.on_response("r2", prompt, [5, 6])
    learner.feedback("r2", 1)
    assert patient.ready
    while patient.after_step(0.0) is None:
        pass
    assert learner.version == 1
    patient.close()
    learner.on_response("r3", prompt, [7, 8])
    learner.feedback("r3", 1)
    hurried = Colocated(learner, engine, max_feedback_wait_s=0.0)
    assert hurried.ready
    assert hurried.train_now()["feedback_ids"] == [4] and learner.version == 2
    hurried.close()


def test_a_request_waiting_for_its_first_token_gets_no_training_slice(tmp_path):
    """Credit earned by busy steps is spent only on steps after which no request waits for its
    first token: a prefill is never held up behind training."""
    learner = learner_with_feedback(tmp_path, "first-token")
    state = SimpleNamespace(waiting=True)
    engine = SimpleNamespace(model=learner.model, has_unfinished=lambda: True,
                             awaits_first_token=lambda: state.waiting, weights_changed=lambda: None)
    now = [0.0]
    colocated = Colocated(learner, engine, max_ttft_slowdown=0.5, clock=lambda: now[0])
    for _ in range(4):
        now[0] += 1.0  # serving a fifth of the time
        assert colocated.after_step(0.2) is None
    assert colocated.slices.slices == 0 and colocated.deferred == 4 and colocated.credit_s > 0
    state.waiting = False  # every request has its first token: the credit goes to training
    now[0] += 1.0
    colocated.after_step(0.2)
    assert colocated.slices.slices == 1 and colocated.metrics()["train_slices_deferred"] == 4
    colocated.close()


def test_a_slice_starts_a_unit_only_if_it_fits_as_long_as_the_last_one():
    """Time is the step's own (a fake clock the step advances): units of 30 ms after "u"
    boundaries, then a 200 ms one after "big". A 50 ms slice runs the next unit only while one
    as long as the last of its kind still fits; the first unit of a slice always runs; a unit
    that overran once is waited for (next_unit_s) rather than overrun again."""
    now = [0.0]
    ran: list[str] = []

    def unit(name: str, seconds: float) -> None:
        now[0] += seconds
        ran.append(name)

    def step() -> str:
        unit("start", 0.01)
        for _ in range(3):
            slices.boundary("u")
            unit("u", 0.03)
        slices.boundary("big")
        unit("big", 0.2)
        return "done"

    slices = TrainingSlices(tiny_model(), step, clock=lambda: now[0])
    per_grant, next_units = [], []
    for _ in range(8):
        before = len(ran)
        entry = slices.grant(0.05)
        per_grant.append(ran[before:])
        next_units.append(slices.next_unit_s)
        if entry is not None:
            break
    # grant 1: "start", then a "u" (not timed yet: it runs); the next "u" (30 ms, as the last) would
    # end at 70 ms > 50 ms: parked. Grant 2: one "u" (the first unit always runs; a second would
    # end 60 ms after the grant). Grant 3: a "u", then "big", never timed, so it runs: 180 ms over.
    assert per_grant == [["start", "u"], ["u"], ["u", "big"]] and next_units[0] == pytest.approx(0.03)
    assert slices.unit_s["big"] == pytest.approx(0.2) and slices.max_overshoot_s == pytest.approx(0.18)
    # the second step: "big" is known, so the slice that reaches its boundary parks there
    ran.clear()
    while not ran or ran[-1] != "u" or len(ran) < 4:
        assert slices.grant(0.05) is None
    assert slices.next_unit_s == pytest.approx(0.2)  # what the serving side must grant at least
    assert slices.grant(0.2) == "done" and ran[-1] == "big"
    slices.close()


def test_boundaries_are_every_attention_mlp_block_head_and_embedding():
    model = tiny_model()
    units = set(map(id, boundaries(model)))
    for layer in model.model.layers:
        assert {id(layer), id(layer.self_attn), id(layer.mlp)} <= units
        assert id(layer.input_layernorm) not in units
    assert id(model.lm_head) in units and id(model.model.embed_tokens) in units
    mamba = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2))
    units = set(map(id, boundaries(mamba)))
    assert all(id(b) in units and id(b.mixer) not in units for b in mamba.backbone.layers)


def test_credit_is_spent_only_when_it_covers_the_steps_next_unit(tmp_path):
    """A step whose next unit is as long as 0.3 s gets no slice until busy steps have earned
    0.3 s, instead of a slice of what one step earned that the unit would overrun."""
    learner = learner_with_feedback(tmp_path, "credit")
    engine = SimpleNamespace(model=learner.model, has_unfinished=lambda: True,
                             awaits_first_token=lambda: False, weights_changed=lambda: None)
    now = [0.0]
    colocated = Colocated(learner, engine, max_ttft_slowdown=0.1, clock=lambda: now[0])
    colocated.slices.unit_s["start"] = 0.3
    per_step = 0.5 * credit_rate(0.1, 0.1)  # steps of 0.5 s every 5 s: serving 10% of the time
    for _ in range(math.ceil(0.3 / per_step) - 1):
        now[0] += 5.0
        assert colocated.after_step(0.5) is None
        assert colocated.utilization() == pytest.approx(0.1)
    assert colocated.slices.slices == 0
    now[0] += 5.0
    colocated.after_step(0.5)
    assert colocated.slices.slices == 1
    colocated.close()


def test_recording_is_paid_from_the_credit_unless_the_request_is_alone(tmp_path):
    """A recorded prefill lengthens its engine step by CostModel.record_extra_s: while other
    requests share the engine it is paid from training's credit and refused (served unrecorded)
    when the credit falls short; a request alone is recorded and pays nothing."""
    learner = learner_with_feedback(tmp_path, "record-credit")
    learner.trainer.cost = CostModel(0.0, 0.001, 0.0, 0.0, inference_fixed_s=0.05, inference_s_per_token=0.001)
    sched = SimpleNamespace(running=["a"], waiting=[])
    engine = SimpleNamespace(model=learner.model, scheduler=sched, has_unfinished=lambda: True,
                             awaits_first_token=lambda: False, weights_changed=lambda: None)
    colocated = Colocated(learner, engine, max_ttft_slowdown=0.1)
    assert engine.may_record == colocated.may_record  # the engine asks it before each recording
    assert colocated.may_record(100) and colocated.credit_s == 0.0  # alone
    sched.running.append("b")
    assert not colocated.may_record(100) and colocated.metrics()["records_refused"] == 1
    colocated.credit_s = 0.08
    assert colocated.may_record(100) and colocated.credit_s == pytest.approx(0.03)  # extra 0.05 s
    sched.running.pop()
    sched.waiting.append("c")  # one waiting counts as sharing the engine too
    assert not colocated.may_record(100) and colocated.records_refused == 2
    colocated.close()


def mm1_sojourn_ratio(rho: float, extra: float, n: int = 200_000, seed: int = 0) -> float:
    """Mean time in an M/M/1 queue (arrival rate rho, mean service 1) with every service
    lengthened by `extra`, over the mean without: Lindley's recursion on the same random draws."""
    g = torch.Generator().manual_seed(seed)
    gaps = torch.empty(n, dtype=torch.float64).exponential_(rho, generator=g).tolist()
    work = torch.empty(n, dtype=torch.float64).exponential_(1.0, generator=g).tolist()
    totals = []
    for scale in (1.0, 1.0 + extra):
        wait = total = 0.0
        for a, s in zip(gaps, work):
            wait = max(0.0, wait + s * scale - a) if total else 0.0
            total += wait + s * scale
        totals.append(total)
    return totals[1] / totals[0]


@pytest.mark.parametrize("rho", [0.2, 0.5, 0.8])
def test_the_credit_rate_keeps_a_simulated_queues_latency_within_the_bound(rho):
    """The training a busy second may earn at utilization rho, added to every service of a
    simulated M/M/1 queue, stretches its mean latency by max_ttft_slowdown (10%), not more; s
    itself (the schedule before this rate) stretches it far more at a high load."""
    rate = credit_rate(0.1, rho)
    assert mm1_sojourn_ratio(rho, rate) == pytest.approx(1.1, abs=0.03)
    assert credit_rate(0.1, 0.0) == pytest.approx(0.1) and credit_rate(0.1, 1.0) == 0.0
    if rho >= 0.5:
        assert mm1_sojourn_ratio(rho, 0.1) > 1.2


def test_utilization_is_the_busy_share_of_a_recent_window(tmp_path):
    """Steps of 1 s every 2 s: utilization 0.5, and a busy step earns credit_rate(s, 0.5) per
    second; after the window has passed with the engine idle, the old load is forgotten."""
    learner = learner_with_feedback(tmp_path, "utilization")
    state = SimpleNamespace(unfinished=True)
    engine = SimpleNamespace(model=learner.model, has_unfinished=lambda: state.unfinished,
                             awaits_first_token=lambda: True, weights_changed=lambda: None)
    now = [0.0]
    colocated = Colocated(learner, engine, max_ttft_slowdown=0.2, utilization_window_s=10.0,
                          clock=lambda: now[0])
    for _ in range(10):
        now[0] += 2.0
        before = colocated.credit_s
        colocated.after_step(1.0)  # a first token is awaited: credit is earned, not spent
    assert colocated.utilization() == pytest.approx(0.5)
    assert colocated.credit_s - before == pytest.approx(credit_rate(0.2, 0.5))
    assert colocated.metrics()["serving_utilization"] == pytest.approx(0.5)
    now[0] += 11.0
    assert colocated.utilization() == 0.0
    colocated.close()


def test_records_made_under_co_location_do_not_keep_the_learner_alive(tmp_path):
    """A prefill recorded while the slices' hooks are on holds gradient hooks on its outputs; they
    must not lead back to the learner (store -> record -> hook -> learner would be a cycle through
    C++ the garbage collector cannot see: a benchmark running several servers ran out of memory)."""
    import gc
    import weakref

    learner = learner_with_feedback(tmp_path, "freed")
    engine = SimpleNamespace(model=learner.model, has_unfinished=lambda: False, weights_changed=lambda: None)
    colocated = Colocated(learner, engine)
    colocated.record("kept-0", token_lists([8], seed=4)[0], 0)  # stays in the store, never trained
    assert learner.store.info("kept").status == "present"
    refs = [weakref.ref(learner), weakref.ref(learner.store.records["kept"])]
    colocated.close()
    learner.log.close()
    del learner, colocated, engine
    gc.collect()
    assert [r for r in refs if r() is not None] == []


def test_a_rollback_between_engine_steps_abandons_the_step_in_progress(tmp_path):
    """A rollback while a training step is parked mid-way: the step is abandoned (its feedback
    stays pending), the weights are the version asked, bit for bit, and training goes on."""
    learner = learner_with_feedback(tmp_path, "rollback")
    learner.trainer.kept.keep = 2
    learner.trainer.kept.take(0, learner.model, learner.trainer.optimizer)
    v0 = weights(learner.model)
    engine = SimpleNamespace(model=learner.model, has_unfinished=lambda: False, weights_changed=lambda: 0)
    colocated = Colocated(learner, engine)
    assert colocated.train_now()["step"] == 1 and engine.weights_version == 1
    learner.on_response("r9", token_lists([8], seed=9)[0], [5, 6])
    learner.feedback("r9", 1, "another answer")
    parked = colocated.slices
    parked.grant(0.0)  # the next step starts and parks at its first boundary
    assert parked.in_step
    done = colocated.call(lambda: colocated.rollback(0))
    assert not done.done()  # it waits for the engine thread's next turn
    colocated._run_calls()  # what after_step does first, between two engine steps
    assert done.result(timeout=30) == [1] and engine.weights_version == 0
    assert all(torch.equal(p, q) for p, q in zip(learner.model.parameters(), v0))
    assert colocated.slices is not parked and not parked.in_step and not colocated.slices.in_step
    pending = [f.response_id for f in learner.log.pending()]
    assert pending == ["r9"]  # r0, r1 rejected with version 1; the abandoned step's feedback waits
    entry = colocated.train_now()
    assert entry["step"] == 2 and entry["parent"] == 0 and engine.weights_version == 2
    colocated.close()
