"""Structured output: JSON schemas, regexes, choices and grammars as engine constraints.

A request's grammar is compiled once (llguidance, over the tokenizer's vocabulary) and each
choice gets a fresh `GrammarConstraint` holding its own parser state: the engine asks it for the
tokens allowed next, tells it each committed token, and stops the choice when it is complete.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import torch

from reclaim.server.errors import APIError

# Compact JSON (no optional whitespace): a model cannot run out of tokens on spaces and newlines.
JSON_OPTIONS = {"whitespace_flexible": False}
MAX_GRAMMAR_CHARS = 64 << 10
_BITS = torch.arange(8, dtype=torch.uint8)


class GrammarConstraint:
    """One choice's parser state, behind reclaim.engine.constraint.Constraint."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """Bool mask [vocab_size] of the tokens the grammar allows next (ids past the
        tokenizer's vocabulary never are)."""
        packed = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
        bits = ((packed.unsqueeze(1) >> _BITS) & 1).flatten().bool()[:self.vocab_size]
        if self.matcher.is_error():
            raise ValueError(f"grammar error: {self.matcher.get_error()}")
        if bits.numel() >= vocab_size:
            return bits[:vocab_size]
        return torch.cat([bits, bits.new_zeros(vocab_size - bits.numel())])

    def accept(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):
            raise ValueError(f"token {token_id} does not fit the grammar: "
                             f"{self.matcher.get_error()}")

    def finished(self) -> bool:
        return self.matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (a speculative draft checked and not kept)."""
        if not self.matcher.rollback(num_tokens):
            raise ValueError(f"the grammar could not roll back {num_tokens} tokens: {self.matcher.get_error()}")


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar (llguidance's text form) and what it was made from, for messages."""

    source: str  # e.g. "response_format.json_schema"
    text: str


class GrammarCompiler:
    """Compiles requests' grammars for one tokenizer; thread-safe (prep threads share it)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._lltok = None
        self._lock = threading.Lock()

    def _tokenizer(self) -> Any:
        with self._lock:  # about a second for a 50k vocabulary: built once, on first use
            if self._lltok is None:
                import llguidance.hf

                self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=len(self.tokenizer))
            return self._lltok

    def _check(self, text: str, param: str, what: str) -> Grammar:
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(text, self._tokenizer())
        if error:
            lines = " ".join(line.strip() for line in error.splitlines() if line.strip())
            raise APIError(400, f"{param} is not a valid {what}: {lines[:300]}", param=param)
        return Grammar(param, text)

    def json_schema(self, schema: Any, param: str, strict: bool = False) -> Grammar:
        """Output that is JSON valid against `schema` (a dict, or its JSON text); `strict` as
        OpenAI's: objects without `additionalProperties` take no properties beyond theirs."""
        from llguidance import LLMatcher

        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise APIError(400, f"{param} is not JSON: {exc}", param=param) from None
        if not isinstance(schema, (dict, bool)):
            raise APIError(400, f"{param} must be a JSON schema object", param=param)
        _check_size(json.dumps(schema), param)
        if strict:
            schema = closed(schema)
        try:
            text = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise APIError(400, f"{param} is not a usable JSON schema: {exc}", param=param) from None
        return self._check(text, param, "JSON schema")

    def json_object(self, param: str) -> Grammar:
        """Any JSON object."""
        return self.json_schema({"type": "object"}, param)

    def regex(self, pattern: str, param: str) -> Grammar:
        from llguidance import LLMatcher

        _check_size(pattern, param)
        return self._check(LLMatcher.grammar_from_regex(pattern), param, "regular expression")

    def choice(self, choices: list[str], param: str) -> Grammar:
        """Exactly one of `choices`."""
        from llguidance import LLMatcher

        if not choices:
            raise APIError(400, f"{param} is empty; send at least one choice", param=param)
        _check_size(json.dumps(choices), param)
        lark = "start: " + " | ".join(json.dumps(c) for c in choices)
        return self._check(LLMatcher.grammar_from_lark(lark), param, "choice list")

    def grammar(self, text: str, param: str) -> Grammar:
        """A Lark grammar (llguidance's syntax) or a GBNF one (llama.cpp's, as vLLM takes)."""
        from llguidance import grammar_from

        _check_size(text, param)
        try:
            compiled = grammar_from("grammar", text)
        except ValueError as exc:
            raise APIError(400, f"{param} is not a valid grammar (Lark or GBNF): {exc}",
                           param=param) from None
        return self._check(compiled, param, "grammar (Lark or GBNF)")

    def constraint(self, grammar: Grammar) -> GrammarConstraint:
        """A fresh parser state for one choice."""
        from llguidance import LLMatcher

        lltok = self._tokenizer()
        return GrammarConstraint(LLMatcher(lltok, grammar.text, log_level=0), lltok.vocab_size)


def closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object that does not set it (OpenAI's
    strict mode requires that of a schema; a schema that leaves it open is read that way)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in MAPS and isinstance(value, dict):  # name -> schema, not a schema itself
            out[key] = {name: closed(sub) for name, sub in value.items()}
        elif key in LITERALS:
            out[key] = value
        else:
            out[key] = closed(value)
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
LITERALS = ("const", "enum", "default", "examples", "required")


def _check_size(text: str, param: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise APIError(400, f"{param} has {len(text)} characters; allowed: at most "
                       f"{MAX_GRAMMAR_CHARS}", param=param)
