"""Output processing: commit sampled tokens to a request, check its stop conditions, and build
its `RequestOutput` (deltas while running, the whole history once at the end).

Plain decoding commits one token a step and speculative decoding several; both go through
`commit`, so EOS, stop ids, stop strings, `max_tokens`, the context limit, logprobs and the
detokenizer behave the same whichever produced the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reclaim.engine.detokenize import IncrementalDetokenizer
from reclaim.engine.request import RequestOutput, TokenLogprob
from reclaim.engine.scheduler import Sequence


@dataclass
class RequestState:
    """Everything the engine keeps for one request besides what the scheduler holds."""

    seq: Sequence
    generator: torch.Generator | None
    detok: IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob] | None = None  # of prompt tokens 1.., as prefill computes them
    prompt_logprobs_sent: bool = False
    first_version: int | None = None  # weights version of the first output token
    finish_reason: str | None = None
    error: str | None = None


def stop_reason(state: RequestState, token: int, eos_token_ids: set[int], max_model_len: int) -> str | None:
    """Append `token` to the request (sequence and detokenizer); why it finishes, or None."""
    seq, p = state.seq, state.seq.params
    seq.token_ids.append(token)
    if p.constraint is not None:
        p.constraint.accept(token)
        if p.constraint.finished():
            state.detok.add(token)
            return "stop"
    if token in p.stop_token_ids or (token in eos_token_ids and not p.ignore_eos):
        return "stop"  # the stop token stays in token_ids but adds no text
    if state.detok.add(token):
        return "stop"
    if len(seq.token_ids) - seq.num_prompt_tokens >= p.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


def commit(
    state: RequestState,
    tokens: list[int],
    lps: list[TokenLogprob | None] | None,
    version: int,
    eos_token_ids: set[int],
    max_model_len: int,
) -> RequestOutput:
    """Append `tokens` in order until one finishes the request (the rest are dropped).

    Returns the step's output; `state.finish_reason` is set when the request finished.
    """
    if state.first_version is None:
        state.first_version = version
    if state.seq.params.max_tokens == 0:  # prefill only
        state.finish_reason = "length"
        return output(state, [], [] if state.logprobs is not None else None, version)
    added: list[int] = []
    new_lps: list[TokenLogprob] | None = [] if state.logprobs is not None else None
    for i, token in enumerate(tokens):
        reason = stop_reason(state, token, eos_token_ids, max_model_len)
        added.append(token)
        if new_lps is not None and lps is not None and lps[i] is not None:
            new_lps.append(lps[i])
            state.logprobs.append(lps[i])
        if reason is not None:
            state.finish_reason = reason
            break
    return output(state, added, new_lps, version)


def output(state: RequestState, new_ids: list[int], new_lps: list[TokenLogprob] | None,
           version: int) -> RequestOutput:
    """The output for what this step added; the final one also carries the whole history."""
    done = state.finish_reason is not None
    if done and state.finish_reason not in ("abort", "error"):
        state.detok.flush()  # an aborted tail is cut, not shown as a half character
    offset = state.detok.emitted
    delta = state.detok.delta(final=done)
    seq = state.seq
    out = RequestOutput(
        request_id=seq.request_id,
        new_token_ids=new_ids,
        delta_text=delta,
        new_logprobs=new_lps,
        finished=done,
        finish_reason=state.finish_reason,
        weights_version=version,
        first_weights_version=state.first_version if state.first_version is not None else version,
        text_offset=offset,
        num_output_tokens=seq.num_tokens - seq.num_prompt_tokens,
        error=state.error,
    )
    prefilled = seq.num_computed >= seq.num_prompt_tokens or done
    if state.prompt_logprobs is not None and prefilled and (done or not state.prompt_logprobs_sent):
        out.prompt_logprobs = [None, *state.prompt_logprobs]
        state.prompt_logprobs_sent = True
    if done:
        out.prompt_token_ids = seq.token_ids[: seq.num_prompt_tokens]
        out.token_ids = seq.output_token_ids
        out.text = state.detok.text[: state.detok.emitted]
        out.logprobs = list(state.logprobs) if state.logprobs is not None else None
    return out
