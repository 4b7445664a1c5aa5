"""Incremental detokenization with stop strings.

Text grows a token at a time; a token that ends in the middle of a UTF-8 character waits for the
next one. Text that could be the start of a stop string is held back until it is resolved, so a
streamed response never shows part of a stop string.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas, finding stop strings."""

    def __init__(self, tokenizer: Any, stop: list[str] = (), include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.include_stop = include_stop
        self.ids: list[int] = []
        self.text = ""  # all text decoded so far (cut at a stop string once found)
        self.emitted = 0  # characters of `text` already handed out
        self.stop_found: str | None = None
        self._prefix = 0  # ids[_prefix:_read] decode to text already in `text`
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> bool:
        """Append one token; True if it completed a stop string. Without a tokenizer, no text."""
        self.ids.append(token_id)
        if self.tokenizer is None:
            return False
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return False  # no new text yet, or a partial character
        start = len(self.text)
        self.text += now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        return self._find_stop(start)

    def flush(self) -> None:
        """At the end: keep whatever undecodable tail remains, as decode() would show it."""
        if self.tokenizer is not None and self.stop_found is None and self._read < len(self.ids):
            before = self._decode(self.ids[self._prefix:self._read])
            self.text += self._decode(self.ids[self._prefix:])[len(before):]
            self._read = len(self.ids)

    def _find_stop(self, start: int) -> bool:
        if not self.stop:
            return False
        lo = max(0, start - max(len(s) for s in self.stop) + 1)
        hits = [(self.text.find(s, lo), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        i, s = min(hits)
        self.text = self.text[: i + len(s) if self.include_stop else i]
        self.stop_found = s
        return True

    def delta(self, final: bool) -> str:
        """Text not handed out yet, minus any tail that might begin a stop string (unless final)."""
        end = len(self.text)
        if not final and self.stop_found is None:
            end -= self._held_back()
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the unsent text that is a proper prefix of a stop string."""
        tail = self.text[self.emitted:]
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(tail)), best, -1):
                if tail.endswith(s[:n]):
                    best = n
                    break
        return best
