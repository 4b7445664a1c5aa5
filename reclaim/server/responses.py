"""OpenAI response shapes: chat and completion objects, stream chunks, logprobs and usage.

Every object carries the response `id` and, as an extra top-level key, the `weights_version`
that produced it; feedback on a response refers to both.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from functools import lru_cache

from reclaim.engine.request import RequestOutput, TokenLogprob
from reclaim.server.errors import APIError
from reclaim.server.plan import Plan
from reclaim.server.engine_thread import EngineFailure, Generation
from reclaim.server.tools import OPEN_TAG, ToolCall


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (byte-level BPE vocabularies)."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_UNBYTE = {c: b for b, c in _bytes_to_unicode().items()}


class TokenText:
    """Text and exact UTF-8 bytes of single tokens, cached per id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.text = lru_cache(maxsize=1 << 16)(self._text)
        self.bytes = lru_cache(maxsize=1 << 16)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _bytes(self, token_id: int) -> list[int]:
        # A byte-level token can hold part of a UTF-8 character; its decoded text cannot.
        if self.byte_level:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece and all(c in _UNBYTE for c in piece):
                return [_UNBYTE[c] for c in piece]
        return list(self.text(token_id).encode("utf-8"))


def finite(logprob: float) -> float:
    """JSON has no -Infinity: an impossible token reports -9999.0, as vLLM does."""
    return logprob if logprob > -9999.0 else -9999.0


def chat_logprobs(lps: list[TokenLogprob], names: TokenText) -> dict:
    """`choices[i].logprobs` of a chat completion (or chunk) for these tokens."""
    def entry(token_id: int, logprob: float) -> dict:
        return {"token": names.text(token_id), "logprob": finite(logprob),
                "bytes": names.bytes(token_id)}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps],
            "refusal": None}


def completion_logprobs(lps: list[TokenLogprob], names: TokenText, offsets: list[int]) -> dict:
    """`choices[i].logprobs` of a legacy completion; `offsets` are where each token's text starts."""
    return {"tokens": [names.text(lp.token_id) for lp in lps],
            "token_logprobs": [finite(lp.logprob) for lp in lps],
            "top_logprobs": [_top(lp, len(lp.top), names) for lp in lps],
            "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(response_id: str, obj: str, created: int, model: str, choices: list[dict],
             weights_version: int, usage_: dict | None = None) -> dict:
    """The fields every response and chunk share."""
    body = {"id": response_id, "object": obj, "created": created, "model": model,
            "choices": choices, "weights_version": weights_version}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def sse(payload: dict | str) -> bytes:
    """One server-sent event frame."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def step_logprobs(out: RequestOutput) -> list[TokenLogprob]:
    """Logprobs of the tokens this step added."""
    return out.new_logprobs or []


def _offsets(out: RequestOutput, lps: list[TokenLogprob] | None, shift: int = 0) -> list[int]:
    """Where this step's tokens start in the choice's text (the text released before the step,
    after `shift` characters of echoed prompt)."""
    return [shift + out.text_offset] * len(lps or [])


def request_error(out: RequestOutput) -> APIError:
    """The error a choice that failed alone in the engine reports (the others go on)."""
    return APIError(500, f"generation failed for this request: {out.error}", code="generation_error")


def prompt_logprobs(out: RequestOutput, k: int, names: TokenText) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first has none) {token id: {logprob,
    rank, decoded_token}} for the token itself and its k most likely alternatives."""
    entries: list[dict | None] = []
    for lp in out.prompt_logprobs or []:
        if lp is None:
            entries.append(None)
            continue
        top = lp.top[:k]
        entry = {str(t): {"logprob": finite(v), "rank": r + 1, "decoded_token": names.text(t)}
                 for r, (t, v) in enumerate(top)}
        rank = next((r + 1 for r, (t, _) in enumerate(lp.top) if t == lp.token_id), None)
        entry.setdefault(str(lp.token_id), {"logprob": finite(lp.logprob), "rank": rank,
                                            "decoded_token": names.text(lp.token_id)})
        entries.append(entry)
    return entries


def echo_logprobs(out: RequestOutput, k: int, names: TokenText) -> dict:
    """The prompt's part of an echoed completion's logprobs: its first token has null ones."""
    lps = (out.prompt_logprobs or [None])[1:]
    ids = out.prompt_token_ids or []
    tokens = [names.text(t) for t in ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    tops = [None] + [_top(lp, k, names) for lp in lps]
    return {"tokens": tokens, "token_logprobs": [None] + [finite(lp.logprob) for lp in lps],
            "top_logprobs": tops, "text_offset": offsets}


def _top(lp: TokenLogprob, k: int, names: TokenText) -> dict:
    top = {names.text(t): finite(v) for t, v in lp.top[:k]}
    top.setdefault(names.text(lp.token_id), finite(lp.logprob))
    return top


class ToolStream:
    """Holds back a streamed choice's text from where it may become a tool call (a reply that
    opens with JSON, or a `<tool_call>` tag, or what may be the start of one); passes the rest."""

    def __init__(self, plan: Plan) -> None:
        self.tools = plan.tools
        self.held, self.sent, self.in_call = "", "", plan.tools is not None and \
            plan.tools.mode != "auto"

    def feed(self, text: str) -> str:
        """The part of `text` that can go out now."""
        if self.tools is None:
            return text
        self.held += text
        if self.in_call:
            return ""
        if (not self.sent.strip() and self.held.lstrip()[:1] in ("{", "[")) or \
                OPEN_TAG in self.held:
            self.in_call = True
            cut = self.held.find(OPEN_TAG) if OPEN_TAG in self.held else 0
            return self._send(cut)
        keep = next((k for k in range(len(OPEN_TAG) - 1, 0, -1)
                     if self.held.endswith(OPEN_TAG[:k])), 0)
        return self._send(len(self.held) - keep)

    def _send(self, upto: int) -> str:
        out, self.held = self.held[:upto], self.held[upto:]
        self.sent += out
        return out

    def finish(self, text: str) -> tuple[str, list[ToolCall]]:
        """(text still to send, tool calls) once the choice's whole `text` is known."""
        if self.tools is None:
            return "", []
        content, calls = self.tools.parse(text)
        if not calls:
            return self._send(len(self.held)), []
        return "", calls


def _finish(finish: str | None, calls: list[ToolCall]) -> str | None:
    return "tool_calls" if calls and finish == "stop" else finish


def _choice(plan: Plan, index: int, text: str, lps: list[TokenLogprob] | None,
            finish: str | None, names: TokenText, offsets: list[int] | None = None,
            first: bool = False, calls: list[ToolCall] | None = None,
            echo: dict | None = None) -> dict:
    if plan.kind == "chat":
        logprobs = chat_logprobs(lps, names) if lps is not None else None
        if plan.stream:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            if calls:
                delta = {"tool_calls": [c.body(k) for k, c in enumerate(calls)]}
            elif finish is not None and not text:
                delta = {}
            return {"index": index, "delta": delta, "logprobs": logprobs,
                    "finish_reason": _finish(finish, calls or [])}
        message = {"role": "assistant", "content": text}
        if plan.tools is not None:
            content, found = plan.tools.parse(text)
            message = {"role": "assistant", "content": content}
            if found:
                message["tool_calls"] = [c.body() for c in found]
            finish = _finish(finish, found)
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
    logprobs = completion_logprobs(lps, names, offsets or []) if lps is not None else None
    if echo is not None and logprobs is not None:
        logprobs = {key: echo[key] + logprobs[key] for key in echo}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def _object(plan: Plan) -> str:
    if plan.kind == "chat":
        return "chat.completion.chunk" if plan.stream else "chat.completion"
    return "text_completion"


def _with_prompt_logprobs(plan: Plan, body: dict, choice: dict, out: RequestOutput,
                          names: TokenText) -> None:
    """vLLM puts prompt_logprobs on each completion choice, and at the top of a chat reply."""
    if plan.prompt_logprobs is None or not out.finished:
        return
    lps = prompt_logprobs(out, plan.prompt_logprobs, names)
    (body if plan.kind == "chat" else choice)["prompt_logprobs"] = lps


async def stream_body(plan: Plan, gen: Generation, names: TokenText,
                      weights_version: int) -> AsyncIterator[bytes]:
    """SSE frames of a streamed response, ending with `data: [DONE]`; aborts what it leaves."""
    obj, n = _object(plan), len(plan.prompts)
    completion_tokens = 0

    def body(choices: list[dict], version: int, usage_: dict | None = None) -> dict:
        body = envelope(plan.response_id, obj, plan.created, plan.model, choices, version)
        if plan.include_usage:
            body["usage"] = usage_
        if plan.continuous_usage and usage_ is None:
            body["usage"] = usage(plan.prompt_tokens, completion_tokens)
        return body

    def chunk(choices: list[dict], version: int, usage_: dict | None = None) -> bytes:
        return sse(body(choices, version, usage_))

    tool_streams = [ToolStream(plan) for _ in range(n)]
    try:
        if plan.kind == "chat":  # OpenAI opens each choice with the assistant role
            for i in range(n):
                yield chunk([_choice(plan, i, "", None, None, names, first=True)],
                            weights_version)
        for i, text in enumerate(plan.echo or []):  # completions: the prompt comes first
            yield chunk([_choice(plan, i, text, None, None, names)], weights_version)
        async for i, out in gen:
            if out.finish_reason == "error":
                yield sse(request_error(out).body())
                break
            completion_tokens += len(out.new_token_ids)
            lps = step_logprobs(out) if plan.logprobs else None
            text = tool_streams[i].feed(out.delta_text)
            calls: list[ToolCall] = []
            if out.finished:
                rest, calls = tool_streams[i].finish(out.text or "")
                text += rest
            if not (text or lps or out.finished):
                continue  # a token that ends mid-character (or held back): its text comes later
            if calls and text:
                yield chunk([_choice(plan, i, text, None, None, names)], out.weights_version)
                text = ""
            choice = _choice(plan, i, text, lps, out.finish_reason, names,
                             _offsets(out, lps), calls=calls)
            frame = body([choice], out.weights_version)
            _with_prompt_logprobs(plan, frame, choice, out, names)
            yield sse(frame)
            weights_version = out.weights_version
        if plan.include_usage:
            yield chunk([], weights_version, usage(plan.prompt_tokens, completion_tokens))
    except EngineFailure as exc:
        yield sse(APIError(500, str(exc)).body())
    finally:
        gen.abort()
    yield sse("[DONE]")


async def collect(plan: Plan, gen: Generation, names: TokenText) -> dict:
    """The whole (non-streamed) response once every choice has finished."""
    n = len(plan.prompts)
    finals: list[RequestOutput | None] = [None] * n
    lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
    offsets: list[list[int]] = [[] for _ in range(n)]
    echo = plan.echo or [""] * n
    try:
        async for i, out in gen:
            if out.finish_reason == "error":
                raise request_error(out)
            finals[i] = out
            if plan.logprobs:
                step = step_logprobs(out)
                lps[i] += step
                offsets[i] += _offsets(out, step, len(echo[i]))
    finally:
        gen.abort()
    body = envelope(plan.response_id, _object(plan), plan.created, plan.model, [],
                    max(out.weights_version for out in finals),
                    usage(plan.prompt_tokens, sum(len(out.token_ids) for out in finals)))
    for i, out in enumerate(finals):
        echoed = echo_logprobs(out, plan.params[i].logprobs or 0, names) \
            if plan.echo is not None and plan.logprobs else None
        choice = _choice(plan, i, echo[i] + out.text, lps[i] if plan.logprobs else None,
                         out.finish_reason, names, offsets[i], echo=echoed)
        _with_prompt_logprobs(plan, body, choice, out, names)
        body["choices"].append(choice)
    return body
