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
from reclaim.server.runner import EngineFailure, Generation


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
    tops = []
    for lp in lps:
        top = {names.text(t): finite(v) for t, v in lp.top}
        top.setdefault(names.text(lp.token_id), finite(lp.logprob))
        tops.append(top)
    return {"tokens": [names.text(lp.token_id) for lp in lps],
            "token_logprobs": [finite(lp.logprob) for lp in lps], "top_logprobs": tops,
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


def _offsets(out: RequestOutput, lps: list[TokenLogprob] | None) -> list[int]:
    """Where this step's tokens start in the choice's text (the text released before the step)."""
    return [out.text_offset] * len(lps or [])


def request_error(out: RequestOutput) -> APIError:
    """The error a choice that failed alone in the engine reports (the others go on)."""
    return APIError(500, f"generation failed for this request: {out.error}", code="generation_error")


def _choice(plan: Plan, index: int, text: str, lps: list[TokenLogprob] | None,
            finish: str | None, names: TokenText, offsets: list[int] | None = None,
            first: bool = False) -> dict:
    if plan.kind == "chat":
        logprobs = chat_logprobs(lps, names) if lps is not None else None
        if plan.stream:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            if finish is not None and not text:
                delta = {}
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish}
    logprobs = completion_logprobs(lps, names, offsets or []) if lps is not None else None
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def _object(plan: Plan) -> str:
    if plan.kind == "chat":
        return "chat.completion.chunk" if plan.stream else "chat.completion"
    return "text_completion"


async def stream_body(plan: Plan, gen: Generation, names: TokenText,
                      weights_version: int) -> AsyncIterator[bytes]:
    """SSE frames of a streamed response, ending with `data: [DONE]`; aborts what it leaves."""
    obj, n = _object(plan), len(plan.prompts)

    def chunk(choices: list[dict], version: int, usage_: dict | None = None) -> bytes:
        body = envelope(plan.response_id, obj, plan.created, plan.model, choices, version)
        if plan.include_usage:
            body["usage"] = usage_
        return sse(body)

    try:
        if plan.kind == "chat":  # OpenAI opens each choice with the assistant role
            for i in range(n):
                yield chunk([_choice(plan, i, "", None, None, names, first=True)],
                            weights_version)
        completion_tokens = 0
        async for i, out in gen:
            if out.finish_reason == "error":
                yield sse(request_error(out).body())
                break
            completion_tokens += len(out.new_token_ids)
            lps = step_logprobs(out) if plan.logprobs else None
            if not (out.delta_text or lps or out.finished):
                continue  # a token that ends mid-character: its text comes with the next one
            yield chunk([_choice(plan, i, out.delta_text, lps, out.finish_reason, names,
                                 _offsets(out, lps))], out.weights_version)
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
    try:
        async for i, out in gen:
            if out.finish_reason == "error":
                raise request_error(out)
            finals[i] = out
            if plan.logprobs:
                step = step_logprobs(out)
                lps[i] += step
                offsets[i] += _offsets(out, step)
    finally:
        gen.abort()
    choices = [_choice(plan, i, out.text, lps[i] if plan.logprobs else None, out.finish_reason,
                       names, offsets[i]) for i, out in enumerate(finals)]
    return envelope(plan.response_id, _object(plan), plan.created, plan.model, choices,
                    max(out.weights_version for out in finals),
                    usage(plan.prompt_tokens, sum(len(out.token_ids) for out in finals)))
