"""The server's view: record a requested prompt, log the response, take feedback, train with the
record reused, and report it in the metrics."""

from __future__ import annotations

import pytest
from online_helpers import tiny_model, token_lists

from reclaim.online.feedback import FeedbackError, UnknownResponse
from reclaim.online.learner import OnlineLearner
from reclaim.online.trainer import CostModel, OnlineTrainConfig


def test_serve_feedback_train_round_trip(tmp_path):
    cfg = OnlineTrainConfig(output_dir=str(tmp_path), record="requested", save_steps=0)
    learner = OnlineLearner(tiny_model(), cfg, tokenize=lambda s: [2 + ord(c) % 90 for c in s],
                            cost=CostModel.fixed("reuse"))
    prompts = token_lists([9, 5])
    assert learner.should_record(True) and not learner.should_record(False)
    rec = learner.record(prompts[0], "chat-1")  # asked to be retained
    assert rec.last_logits.shape == (96,) and rec.keys[0].shape[2] == 9
    learner.on_response("chat-1", prompts[0], [7, 8, 9])
    learner.on_response("chat-2", prompts[1], [10, 11])  # not recorded
    learner.feedback("chat-1", 0, "ok")
    learner.feedback("chat-2", 1)
    with pytest.raises(UnknownResponse, match="'chat-3'"):
        learner.feedback("chat-3", 1)
    with pytest.raises(FeedbackError, match="correction of 300 tokens after a prompt of 5: must be "
                                            r"1 to 251 tokens \(the context is 256\)"):
        learner.feedback("chat-2", 0, "x" * 300)
    entry = learner.train_step()
    assert [(d["response_id"], d["reason"]) for d in entry["decisions"]] == [
        ("chat-1", "record"), ("chat-2", "no_record")]
    assert learner.train_step() is None and learner.version == 1
    m = learner.metrics()
    assert (m["train_reuse_rate"], m["record_hits"], m["record_records"], m["train_tokens"]) == (
        0.5, 1, 0, 4)
    assert m["train_tokens_per_s"] > 0 and m["pending_feedback"] == 0
