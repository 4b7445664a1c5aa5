"""The durable feedback log: served responses (and the API key that made each), user feedback on
them, which weights version trained each, and the versions rolled back.

SQLite in WAL mode with synchronous=FULL: `append` returns only after its commit, so feedback is
on disk before the server acknowledges it. Repeating a feedback (same response, rating and
correction) returns the first one's id. A feedback trains once: `mark_trained` refuses one already
marked, and after a crash `unmark_after(step)` reopens those whose step the last checkpoint lacks.

Versions: each optimizer step makes weights version `step`, with the version it started from as
its parent (`mark_trained`). A rollback (or the regression gate) rejects versions in one commit:
they and the feedback they trained are marked with the reason (`rollback`, `quarantined`), and
rejected feedback is neither pending nor reopened at restart. Version numbers are never reused.

    log = FeedbackLog("runs/online/feedback.db")
    log.add_response("r1", prompt_ids, response_ids, version=0)
    fid = log.append("r1", rating=1)           # or rating=0, correction="the right answer"
    batch = log.pending(limit=8); ...; log.mark_trained([f.id for f in batch], step=1)
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

RATINGS = (-1, 0, 1)
PENDING = ("trained_at_step IS NULL AND rejected IS NULL "  # trainable, untrained, not rejected
           "AND (rating = 1 OR correction IS NOT NULL)")

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    response_id TEXT PRIMARY KEY,
    prompt_ids TEXT NOT NULL,
    response_ids TEXT NOT NULL,
    version INTEGER NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS feedback (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    response_id TEXT NOT NULL REFERENCES responses(response_id),
    rating INTEGER NOT NULL,
    correction TEXT,
    content_key TEXT NOT NULL UNIQUE,
    created REAL NOT NULL,
    trained_at_step INTEGER
);
CREATE INDEX IF NOT EXISTS feedback_untrained ON feedback(trained_at_step, id);
CREATE TABLE IF NOT EXISTS versions (
    version INTEGER PRIMARY KEY,
    parent INTEGER NOT NULL,
    rejected TEXT,
    created REAL NOT NULL
);
"""
# columns added after the first release: (table, column, type); old logs get them at open
ADDED_COLUMNS = (("responses", "owner", "TEXT"), ("feedback", "rejected", "TEXT"))
REJECT_REASONS = ("rollback", "quarantined")


class UnknownResponse(LookupError):
    """Feedback names a response id the log has never seen (the server answers 404)."""


class FeedbackError(ValueError):
    """Malformed feedback: the message names the field, the value and what is allowed."""


class NotOwner(PermissionError):
    """Feedback from an API key other than the one that made the response (the server answers 403)."""


@dataclass(frozen=True)
class Response:
    """A served response: its prompt and response token ids, the weights version that made it and
    the API key that asked for it (a digest; None on a server without keys)."""

    response_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    version: int
    owner: str | None = None


@dataclass(frozen=True)
class Feedback:
    """One feedback row. Trainable when rating is 1 (train on the served response) or a
    correction is given (train on it); other feedback is stored only."""

    id: int
    response_id: str
    rating: int
    correction: str | None
    trained_at_step: int | None
    rejected: str | None = None  # "rollback" | "quarantined": its version was undone


def _check(response_id: object, rating: object, correction: object) -> None:
    if not isinstance(response_id, str) or not response_id:
        raise FeedbackError(f"response_id={response_id!r}: must be a non-empty string")
    if isinstance(rating, bool) or not isinstance(rating, int) or rating not in RATINGS:
        raise FeedbackError(f"rating={rating!r}: must be one of {list(RATINGS)} (an integer)")
    if correction is not None and (not isinstance(correction, str) or not correction.strip()):
        raise FeedbackError(f"correction={correction!r}: must be a non-empty string or None")


def _ids(name: str, ids: object) -> list[int]:
    if (not isinstance(ids, (list, tuple)) or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
        raise FeedbackError(f"{name}={ids!r}: must be a non-empty list of token ids (ints >= 0)")
    return list(ids)


class FeedbackLog:
    """The log in one SQLite file; safe to share between threads of one process."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")  # a commit is on disk when it returns
        self.db.execute("PRAGMA busy_timeout=10000")
        self.db.executescript(SCHEMA)
        for table, column, kind in ADDED_COLUMNS:
            have = {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        self.lock = threading.Lock()

    def close(self) -> None:
        self.db.close()

    def _write(self, sql_args: Sequence[tuple[str, tuple]]) -> list[sqlite3.Cursor]:
        """Run statements in one transaction, committed before returning."""
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                out = [self.db.execute(sql, args) for sql, args in sql_args]
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")
            return out

    # ---- responses ---------------------------------------------------------------------------

    def add_response(self, response_id: str, prompt_ids: Sequence[int], response_ids: Sequence[int],
                     version: int, owner: str | None = None) -> None:
        """Remember a served response so feedback on it can name it and train on it; `owner`
        names the API key that asked for it (only that key, or an admin key, may rate it)."""
        if not isinstance(response_id, str) or not response_id:
            raise FeedbackError(f"response_id={response_id!r}: must be a non-empty string")
        p, r = _ids("prompt_ids", list(prompt_ids)), _ids("response_ids", list(response_ids))
        row = (response_id, json.dumps(p), json.dumps(r), int(version), time.time(), owner)
        self._write([("INSERT OR IGNORE INTO responses (response_id, prompt_ids, response_ids, "
                      "version, created, owner) VALUES (?, ?, ?, ?, ?, ?)", row)])
        if self.response(response_id) != Response(response_id, p, r, int(version), owner):
            raise FeedbackError(f"response_id={response_id!r} is already logged with other tokens "
                                "or version; response ids must be unique")

    def response(self, response_id: str) -> Response:
        """The served response, or UnknownResponse naming the id."""
        with self.lock:
            row = self.db.execute("SELECT prompt_ids, response_ids, version, owner FROM responses "
                                  "WHERE response_id = ?", (response_id,)).fetchone()
        if row is None:
            raise UnknownResponse(f"unknown response_id {response_id!r}: no response with this id "
                                  "was served (or logged)")
        return Response(response_id, json.loads(row[0]), json.loads(row[1]), row[2], row[3])

    # ---- feedback ----------------------------------------------------------------------------

    def append(self, response_id: str, rating: int, correction: str | None = None) -> int:
        """Log feedback durably and return its id; the same feedback again returns the same id."""
        _check(response_id, rating, correction)
        self.response(response_id)  # raises UnknownResponse
        key = hashlib.sha256(json.dumps([response_id, rating, correction]).encode()).hexdigest()
        self._write([("INSERT OR IGNORE INTO feedback (response_id, rating, correction, content_key,"
                      " created) VALUES (?, ?, ?, ?, ?)",
                      (response_id, rating, correction, key, time.time()))])
        with self.lock:
            return self.db.execute("SELECT id FROM feedback WHERE content_key = ?",
                                   (key,)).fetchone()[0]

    def get(self, feedback_id: int) -> Feedback:
        with self.lock:
            row = self.db.execute("SELECT id, response_id, rating, correction, trained_at_step, rejected "
                                  "FROM feedback WHERE id = ?", (feedback_id,)).fetchone()
        if row is None:
            raise LookupError(f"no feedback with id {feedback_id!r}")
        return Feedback(*row)

    def pending(self, limit: int | None = None) -> list[Feedback]:
        """Trainable feedback not yet trained, oldest first."""
        sql = ("SELECT id, response_id, rating, correction, trained_at_step, rejected FROM feedback "
               f"WHERE {PENDING} ORDER BY id")
        with self.lock:
            rows = self.db.execute(sql + (" LIMIT ?" if limit else ""),
                                   (limit,) if limit else ()).fetchall()
        return [Feedback(*r) for r in rows]

    def pending_count(self) -> int:
        with self.lock:
            return self.db.execute(f"SELECT COUNT(*) FROM feedback WHERE {PENDING}").fetchone()[0]

    def all(self) -> list[Feedback]:
        with self.lock:
            rows = self.db.execute("SELECT id, response_id, rating, correction, trained_at_step, rejected "
                                   "FROM feedback ORDER BY id").fetchall()
        return [Feedback(*r) for r in rows]

    def mark_trained(self, feedback_ids: Sequence[int], step: int, parent: int | None = None) -> None:
        """Record that `step` (weights version `step`, made from version `parent`; default
        step - 1) trained these; refuses (changing nothing) any already trained or rejected, and a
        version number used before."""
        ids = list(feedback_ids)
        q = ",".join("?" * len(ids))
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                done = self.db.execute(f"SELECT id, trained_at_step FROM feedback WHERE id IN ({q}) "
                                       "AND (trained_at_step IS NOT NULL OR rejected IS NOT NULL)",
                                       ids).fetchall() if ids else []
                if done:
                    raise ValueError(f"feedback already trained (id, step): {done}; a feedback "
                                     "trains once, and rejected feedback never again")
                n = self.db.execute(f"UPDATE feedback SET trained_at_step = ? WHERE id IN ({q})",
                                    [step, *ids]).rowcount if ids else 0
                if n != len(set(ids)):
                    raise LookupError(f"feedback ids {ids}: only {n} exist")
                self.db.execute("INSERT INTO versions (version, parent, created) VALUES (?, ?, ?)",
                                (step, step - 1 if parent is None else parent, time.time()))
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def unmark_after(self, step: int) -> int:
        """Reopen feedback trained after `step` (its weights were lost in a crash) and forget those
        versions; rejected versions and their feedback stay rejected. Returns how many reopened."""
        return self._write([
            ("UPDATE feedback SET trained_at_step = NULL WHERE trained_at_step > ? AND rejected IS NULL",
             (step,)),
            ("DELETE FROM versions WHERE version > ? AND rejected IS NULL", (step,))])[0].rowcount

    # ---- versions ----------------------------------------------------------------------------

    def parents(self) -> dict[int, int]:
        """Every version not rejected -> the version it was trained from."""
        with self.lock:
            rows = self.db.execute("SELECT version, parent FROM versions WHERE rejected IS NULL")
            return dict(rows.fetchall())

    def rejected_versions(self) -> dict[int, str]:
        """Rejected versions -> why (`rollback` or `quarantined`)."""
        with self.lock:
            return dict(self.db.execute("SELECT version, rejected FROM versions "
                                        "WHERE rejected IS NOT NULL").fetchall())

    def last_version(self) -> int:
        """The highest version number ever made, rejected or not (0: none)."""
        with self.lock:
            return self.db.execute("SELECT COALESCE(MAX(version), 0) FROM versions").fetchone()[0]

    def reject(self, versions: Sequence[int], reason: str) -> int:
        """Mark `versions` and the feedback they trained rejected for `reason`, in one commit;
        returns how many feedback rows it rejected."""
        if reason not in REJECT_REASONS:
            raise ValueError(f"reason={reason!r}; allowed: {list(REJECT_REASONS)}")
        vs = list(versions)
        if not vs:
            return 0
        q = ",".join("?" * len(vs))
        return self._write([
            (f"UPDATE feedback SET rejected = ? WHERE trained_at_step IN ({q})", (reason, *vs)),
            (f"UPDATE versions SET rejected = ? WHERE version IN ({q})", (reason, *vs))])[0].rowcount

    def rejected_count(self, reason: str | None = None) -> int:
        """Feedback rejected (for `reason`, or any)."""
        sql = "SELECT COUNT(*) FROM feedback WHERE rejected " + ("= ?" if reason else "IS NOT NULL")
        with self.lock:
            return self.db.execute(sql, (reason,) if reason else ()).fetchone()[0]
