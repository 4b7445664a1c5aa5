"""The feedback log: durable before acknowledged (kill -9 loses nothing), idempotent, each
feedback trained once, bad input refused by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from reclaim.online.feedback import FeedbackError, FeedbackLog, UnknownResponse


@pytest.fixture
def log(tmp_path):
    log = FeedbackLog(tmp_path / "feedback.db")
    log.add_response("r1", [5, 6, 7], [8, 9], version=0)
    log.add_response("r2", [5], [10], version=1)
    yield log
    log.close()


def test_repeated_feedback_is_one_feedback(log):
    a = log.append("r1", 1)
    assert log.append("r1", 1) == a
    b = log.append("r1", 0, "a better answer")
    assert b != a and log.append("r1", 0, "a better answer") == b
    assert [f.id for f in log.all()] == [a, b]


def test_pending_is_trainable_untrained_feedback_oldest_first(log):
    a = log.append("r2", 1)
    log.append("r1", -1)  # a bare negative is stored, not trained on
    log.append("r1", 0)  # so is a neutral one
    c = log.append("r1", -1, "the corrected answer")
    assert [f.id for f in log.pending()] == [a, c]
    assert [f.id for f in log.pending(limit=1)] == [a] and log.pending_count() == 2
    log.mark_trained([a], step=1)
    assert [f.id for f in log.pending()] == [c] and log.get(a).trained_at_step == 1
    with pytest.raises(ValueError, match=rf"already trained \(id, step\): \[\({a}, 1\)\]"):
        log.mark_trained([a, c], step=2)
    assert log.get(c).trained_at_step is None  # the refused mark changed nothing
    log.mark_trained([c], step=2)
    assert log.unmark_after(1) == 1 and [f.id for f in log.pending()] == [c]


@pytest.mark.parametrize("rating", [2, -2, "1", 1.0, True, None])
def test_a_malformed_rating_is_refused_by_value(log, rating):
    with pytest.raises(FeedbackError, match=rf"rating={rating!r}: must be one of \[-1, 0, 1\]"):
        log.append("r1", rating)
    assert log.all() == []


@pytest.mark.parametrize("correction", ["", "  ", 5, ["text"]])
def test_a_malformed_correction_is_refused_by_value(log, correction):
    with pytest.raises(FeedbackError, match=r"correction=.*: must be a non-empty string or None"):
        log.append("r1", 1, correction)
    assert log.all() == []


def test_unknown_response_id_is_refused_by_name(log):
    with pytest.raises(UnknownResponse, match="unknown response_id 'chatcmpl-nope'"):
        log.append("chatcmpl-nope", 1)
    with pytest.raises(FeedbackError, match="response_id=''"):
        log.append("", 1)
    assert log.all() == []


def test_a_response_id_cannot_be_reused_for_other_tokens(log):
    log.add_response("r1", [5, 6, 7], [8, 9], version=0)  # the same again: fine
    with pytest.raises(FeedbackError, match="'r1' is already logged with other tokens"):
        log.add_response("r1", [5, 6, 7], [8, 8], version=0)
    with pytest.raises(FeedbackError, match=r"prompt_ids=\[\]"):
        log.add_response("r3", [], [8], version=0)


WRITER = r"""
import sys
from reclaim.online.feedback import FeedbackLog
log = FeedbackLog(sys.argv[1])
i = 0
while True:
    rid = f"r{i}"
    log.add_response(rid, [1, 2, 3], [4, 5], 0)
    fid = log.append(rid, 1 if i % 3 else 0, None if i % 3 else f"fix {i}")
    print(f"ack {fid} {rid}", flush=True)
    if i % 4 == 3:
        batch = log.pending(limit=3)
        log.mark_trained([f.id for f in batch], step=i)
        print("marked", i, *[f.id for f in batch], flush=True)
    i += 1
"""


def test_kill_9_loses_no_acknowledged_feedback_and_trains_none_twice(tmp_path):
    path = tmp_path / "feedback.db"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line.split())
        if sum(w[0] == "ack" for w in lines) >= 150:
            break
    os.kill(proc.pid, signal.SIGKILL)  # mid-stream: the writer never stops on its own
    rest, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err
    lines += [ln.split() for ln in rest.splitlines() if ln.strip()]
    acked = {int(w[1]): w[2] for w in lines if w[0] == "ack" and len(w) == 3}
    marked = [(int(w[1]), [int(x) for x in w[2:]]) for w in lines if w[0] == "marked"]

    log = FeedbackLog(path)
    for fid, rid in acked.items():
        assert log.get(fid).response_id == rid
    ids = [fid for _, batch in marked for fid in batch]
    assert len(ids) == len(set(ids))  # none trained twice
    for step, batch in marked:
        assert all(log.get(fid).trained_at_step == step for fid in batch)
    pending = {f.id for f in log.pending()}
    assert not pending & set(ids)
    # a client retrying an acknowledged feedback after the crash gets the same id
    fid, rid = max(acked.items())
    i = int(rid[1:])
    assert log.append(rid, 1 if i % 3 else 0, None if i % 3 else f"fix {i}") == fid
    log.close()
