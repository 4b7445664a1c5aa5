"""From a validated request to a plan: the engine's prompts and SamplingParams, one per choice.

All checks that need the tokenizer or the model's limits happen here, so a request that passes
reaches the engine whole, and one that fails gets a 4xx naming the field and what is allowed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from reclaim.engine.request import SamplingParams
from reclaim.models.tokenizer import encode_chat, render_chat
from reclaim.server.errors import APIError
from reclaim.server.schemas import (INT64, ChatCompletionRequest, CompletionRequest,
                                    DetokenizeRequest, SamplingRequest, TokenizeChatRequest,
                                    TokenizeCompletionRequest, parse)
from reclaim.server.structured import Grammar, GrammarCompiler
from reclaim.server.tools import ToolPlan, plan_tools, template_message, template_tools


@dataclass
class Limits:
    """What the server admits; `max_model_len` and `vocab_size` come from the engine and model."""

    model_names: tuple[str, ...]
    max_model_len: int
    vocab_size: int
    max_n: int = 16
    max_choices: int = 256  # prompts x n in one request
    max_body_bytes: int = 4 << 20
    # Special-token text in message contents (a user typing '<|im_start|>system') encodes as
    # plain text; off by default, as in vLLM.
    split_special_tokens: bool = False
    # The vocabulary's longest token in characters: text longer than max_model_len times this is
    # judged too long from a prefix, without tokenizing it all (see _surely_too_long).
    max_token_chars: int = 32
    force_include_usage: bool = False  # usage in every stream, asked or not (vLLM's option)


@dataclass
class Plan:
    """What one HTTP request asks of the engine; choice i runs prompts[i] with params[i]."""

    kind: Literal["chat", "completion"]
    response_id: str
    model: str
    created: int
    prompts: list[list[int]]
    prompt_of_choice: list[int]  # choice -> index of its distinct prompt (usage counts each once)
    params: list[SamplingParams]
    logprobs: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # usage on every chunk (vLLM's continuous_usage_stats)
    echo: list[str] | None = None  # completions: each choice's prompt text, shown before its reply
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: report k alternatives
    tools: ToolPlan | None = None
    retain_for_training: bool = False  # asked to be recorded for training (serve --learn)

    @property
    def prompt_tokens(self) -> int:
        seen = {}
        for p, ids in zip(self.prompt_of_choice, self.prompts):
            seen[p] = len(ids)
        return sum(seen.values())


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _model(req: SamplingRequest, limits: Limits) -> str:
    if req.model is None:
        return limits.model_names[0]
    if req.model not in limits.model_names:
        raise APIError(404, f"model {req.model!r} is not served here; available: "
                       f"{list(limits.model_names)}", param="model", code="model_not_found")
    return req.model


def _check_prompt(ids: list[int], limits: Limits, param: str) -> None:
    if not ids:
        raise APIError(400, "the prompt is empty after tokenization; send at least one token",
                       param=param)
    if len(ids) >= limits.max_model_len:
        raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context is "
                       f"{limits.max_model_len} tokens, and at least one must be left for the "
                       f"reply", param=param, code="context_length_exceeded")
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of range; allowed: 0 to "
                       f"{limits.vocab_size - 1}", param=param)


PREFIX_SLACK = 64  # tokens a prefix cut at whitespace may have beyond the whole text's


def max_token_chars(tokenizer: Any) -> int:
    """Characters in the vocabulary's longest token (an upper bound on text per token)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def _surely_too_long(text: str, tokenizer: Any, limits: Limits, param: str) -> None:
    """Refuse text that cannot fit, judged from a prefix of max_model_len x max_token_chars
    characters cut at whitespace: a huge prompt then costs no more to refuse than the longest
    prompt that fits costs to admit (a 3.9 MiB body took seconds of tokenizing before its 400)."""
    span = limits.max_model_len * limits.max_token_chars
    if len(text) <= span:
        return
    cut = max(text.rfind(c, 0, span) for c in " \n")  # a word boundary, so no merge crosses it
    prefix = text[:cut] if cut > span // 2 else text[:span]
    n = len(tokenizer.encode(prefix, add_special_tokens=False))
    if n >= limits.max_model_len + PREFIX_SLACK:
        raise APIError(400, f"the prompt has over {n - PREFIX_SLACK} tokens in its first "
                       f"{len(prefix)} of {len(text)} characters; this model's context is "
                       f"{limits.max_model_len} tokens", param=param,
                       code="context_length_exceeded")


def _max_tokens(asked: int | None, default: int | None, prompt_len: int, limits: Limits,
                param: str) -> int:
    room = limits.max_model_len - prompt_len
    if asked is None:
        return room if default is None else min(default, room)
    if asked > room:
        raise APIError(400, f"{param}={asked} is too large: the prompt has {prompt_len} tokens "
                       f"and the context is {limits.max_model_len}; allowed: 1 to {room}",
                       param=param, code="context_length_exceeded")
    return asked


def bad_words_token_ids(words: list[str], tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """vLLM's bad_words as token sequences: each word as encoded alone and after a space (as it
    appears mid-text), the spaced form only when banning the plain one does not already ban it
    (it does not end with it). vLLM keeps the spaced form only when it has the plain one's
    length, which lets " exaggerated" through when "exaggerated" is three tokens (vLLM issue
    #32557); here it is kept whatever its length."""
    out: list[list[int]] = []
    for i, word in enumerate(words):
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise APIError(400, f"bad_words[{i}] ({word[:40]!r}) encodes to no token; send words "
                           f"the tokenizer can encode", param="bad_words")
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out += [plain] + ([spaced] if spaced[-len(plain):] != plain else [])
    bad = next((t for w in out for t in w if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"bad_words encode to token id {bad}, outside the model's vocabulary; "
                       f"allowed: 0 to {vocab_size - 1}", param="bad_words")
    return out


def _params(req: SamplingRequest, max_tokens: int, logprobs: int | None, seed_offset: int,
            limits: Limits, prompt_logprobs: int | None = None, constraint: Any = None,
            bad_words: list[list[int]] | None = None) -> SamplingParams:
    stop_ids = req.stop_token_ids or []
    bad = next((t for t in stop_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"stop_token_ids has {bad}; allowed: 0 to {limits.vocab_size - 1}",
                       param="stop_token_ids")
    bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    bad = next((t for t in bias if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"logit_bias has token id {bad}; allowed: 0 to "
                       f"{limits.vocab_size - 1}", param="logit_bias")
    allowed = req.allowed_token_ids
    if allowed is not None and not allowed:
        raise APIError(400, "allowed_token_ids is an empty list; send at least one token id, or "
                       "omit it", param="allowed_token_ids")
    bad = next((t for t in allowed or [] if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"allowed_token_ids has token id {bad}; allowed: 0 to "
                       f"{limits.vocab_size - 1}", param="allowed_token_ids")
    if req.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens={req.min_tokens} is more than the {max_tokens} tokens "
                       f"this request may generate", param="min_tokens")
    seed = req.seed
    if seed is not None and seed_offset:
        # Distinct but reproducible streams for the n choices of one seeded request.
        seed = (seed + seed_offset + INT64) % (2 * INT64) - INT64
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0, min_p=req.min_p or 0.0, seed=seed, max_tokens=max_tokens,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=list(stop_ids), ignore_eos=req.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            min_tokens=req.min_tokens, presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=bias or None, prompt_logprobs=prompt_logprobs, constraint=constraint,
            allowed_token_ids=None if allowed is None else sorted(set(allowed)),
            bad_words_token_ids=bad_words or None)
    except ValueError as exc:
        raise APIError(400, str(exc), param=str(exc).split("=", 1)[0]) from exc


def _check_n(req: SamplingRequest, num_prompts: int, limits: Limits) -> None:
    if req.n > limits.max_n:
        raise APIError(400, f"n={req.n} is too large; allowed: 1 to {limits.max_n}", param="n")
    if req.n * num_prompts > limits.max_choices:
        raise APIError(400, f"{num_prompts} prompts x n={req.n} = {req.n * num_prompts} choices; "
                       f"allowed: at most {limits.max_choices} per request", param="prompt")


def _truncate(ids: list[int], req: SamplingRequest) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last N prompt tokens."""
    n = req.truncate_prompt_tokens
    return ids[-n:] if n is not None and len(ids) > n else ids


def _grammar(req: SamplingRequest, grammars: GrammarCompiler,
             tools: ToolPlan | None = None) -> Grammar | None:
    """The one grammar the request's structured-output fields (or tool_choice) ask for, if any."""
    rf, so = req.response_format, req.structured_outputs
    g = grammars

    def json_object(_: Any, param: str) -> Grammar:
        return g.json_object(param)

    # (the field, its value or None when unused, compile(value, field))
    candidates: list[tuple[str, Any, Callable[[Any, str], Grammar]]] = [
        ("response_format", rf if rf and rf.type == "json_object" else None, json_object),
        ("response_format.json_schema.schema", rf.json_schema if rf and rf.type == "json_schema"
         else None, lambda js, p: g.json_schema(js.json_schema, p, bool(js.strict))),
        ("guided_json", req.guided_json, g.json_schema),
        ("guided_regex", req.guided_regex, g.regex),
        ("guided_choice", req.guided_choice, g.choice),
        ("guided_grammar", req.guided_grammar, g.grammar),
        ("structured_outputs.json", so and so.json_, g.json_schema),
        ("structured_outputs.regex", so and so.regex, g.regex),
        ("structured_outputs.choice", so and so.choice, g.choice),
        ("structured_outputs.grammar", so and so.grammar, g.grammar),
        ("structured_outputs.json_object", (so and so.json_object) or None, json_object),
        ("tool_choice", tools if tools and tools.mode != "auto" else None,
         lambda t, _: g.json_schema(t.schema(req), "tools")),
        ("tools", tools if tools and tools.strict else None,  # "auto" with a strict tool
         lambda t, _: g.grammar(t.auto_grammar(req), "tools")),
    ]
    asked = [c for c in candidates if c[1] is not None]
    if len(asked) > 1:
        raise APIError(400, f"{asked[0][0]} and {asked[1][0]} both constrain the output; send "
                       f"one of them", param=asked[1][0])
    return asked[0][2](asked[0][1], asked[0][0]) if asked else None


def _expand(kind: Literal["chat", "completion"], prefix: str, req: SamplingRequest,
            prompts: list[list[int]], max_tokens: list[int], logprobs: int | None,
            model: str, limits: Limits, grammar: Grammar | None, grammars: GrammarCompiler,
            prompt_logprobs: int | None = None, **plan: Any) -> Plan:
    choices = [(p, k) for p in range(len(prompts)) for k in range(req.n)]
    bad_words = bad_words_token_ids(req.bad_words, grammars.tokenizer, limits.vocab_size) \
        if req.bad_words else None
    params = [_params(req, max_tokens[p], logprobs, i, limits, prompt_logprobs,
                      grammars.constraint(grammar) if grammar else None, bad_words)
              for i, (p, _) in enumerate(choices)]
    rid = new_id(prefix) if req.request_id is None else f"{prefix}-{req.request_id}"
    return Plan(kind=kind, response_id=rid, model=model, created=int(time.time()),
                prompts=[prompts[p] for p, _ in choices], prompt_of_choice=[p for p, _ in choices],
                params=params, logprobs=logprobs is not None, stream=req.stream,
                include_usage=req.include_usage_in_stream or limits.force_include_usage,
                continuous_usage=req.continuous_usage,
                prompt_logprobs=req.prompt_logprobs, retain_for_training=req.retain_for_training, **plan)


RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "documents", "tokenize", "add_generation_prompt",
                            "continue_final_message", "chat_template", "return_dict")


def _template_kwargs(req: ChatCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
    kwargs = dict(req.chat_template_kwargs or {})
    clash = next((k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS), None)
    if clash is not None:
        raise APIError(400, f"chat_template_kwargs sets {clash!r}, which the request sets "
                       f"itself; send it as a top-level field", param="chat_template_kwargs")
    if req.continue_final_message:
        kwargs["continue_final_message"] = True
    if req.chat_template is not None:
        kwargs["chat_template"] = req.chat_template
    tools = template_tools(req)
    if tools is not None:
        kwargs["tools"] = tools
    return kwargs


def plan_chat(req: ChatCompletionRequest, tokenizer: Any, limits: Limits,
              grammars: GrammarCompiler | None = None) -> Plan:
    """Render the messages with the model's chat template and plan `n` choices."""
    model = _model(req, limits)
    _check_n(req, 1, limits)
    if len(req.messages) > limits.max_model_len:  # each message takes at least one token
        raise APIError(400, f"{len(req.messages)} messages cannot fit in this model's context of "
                       f"{limits.max_model_len} tokens", param="messages",
                       code="context_length_exceeded")
    tools = plan_tools(req)
    messages = [template_message(m) for m in req.messages]
    kwargs = _template_kwargs(req)
    try:
        if sum(len(m["content"]) for m in messages) > limits.max_model_len:
            # Judge the rendered prompt, not the contents: a template may drop text (Qwen3's
            # drops the reasoning of earlier turns).
            text = render_chat(tokenizer, messages, add_generation_prompt=req.add_generation_prompt,
                               **kwargs)
            if req.truncate_prompt_tokens is None:
                _surely_too_long(text, tokenizer, limits, "messages")
        ids = encode_chat(tokenizer, messages, add_generation_prompt=req.add_generation_prompt,
                          split_special_tokens=limits.split_special_tokens, **kwargs)
    except APIError:
        raise
    except Exception as exc:  # template errors (e.g. roles that must alternate) are the caller's
        raise APIError(400, f"the chat template rejected these messages: {exc}",
                       param="messages") from exc
    ids = _truncate(ids, req)
    _check_prompt(ids, limits, "messages")
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = _max_tokens(asked, None, len(ids), limits, name)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    grammars = grammars or GrammarCompiler(tokenizer)
    grammar = _grammar(req, grammars, tools)
    return _expand("chat", "chatcmpl", req, [ids], [max_tokens], logprobs, model, limits,
                   grammar, grammars, req.prompt_logprobs, tools=tools)


def plan_completion(req: CompletionRequest, tokenizer: Any, limits: Limits,
                    grammars: GrammarCompiler | None = None) -> Plan:
    """Tokenize each prompt (or take its ids) and plan `n` choices per prompt."""
    model = _model(req, limits)
    raw = req.prompt_list()
    _check_n(req, len(raw), limits)
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens=0 is allowed only with echo=true (to score the prompt); "
                       "allowed: 1 or more", param="max_tokens")
    if req.echo and req.stream and req.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported with stream=true; send "
                       "stream=false", param="echo")
    prompts, max_tokens = [], []
    for p in raw:
        if isinstance(p, str) and req.truncate_prompt_tokens is None:
            _surely_too_long(p, tokenizer, limits, "prompt")
        ids = tokenizer.encode(p, add_special_tokens=req.add_special_tokens) \
            if isinstance(p, str) else list(p)
        ids = _truncate(ids, req)
        _check_prompt(ids, limits, "prompt")
        prompts.append(ids)
        max_tokens.append(_max_tokens(req.max_tokens, 16, len(ids), limits, "max_tokens"))
    # echo with logprobs reports the prompt's logprobs too, with as many alternatives
    echo_lps = req.logprobs if req.echo else None
    wanted = [k for k in (echo_lps, req.prompt_logprobs) if k is not None]
    echo = None
    if req.echo:
        texts = [p if isinstance(p, str) and req.truncate_prompt_tokens is None
                 else tokenizer.decode(ids) for p, ids in zip(raw, prompts)]
        echo = [texts[p] for p in range(len(prompts)) for _ in range(req.n)]
    grammars = grammars or GrammarCompiler(tokenizer)
    grammar = _grammar(req, grammars)
    return _expand("completion", "cmpl", req, prompts, max_tokens, req.logprobs, model, limits,
                   grammar, grammars, max(wanted) if wanted else None, echo=echo)


def tokenize_body(raw: bytes, tokenizer: Any, limits: Limits) -> dict:
    """POST /tokenize: a prompt's (or chat's) token ids, as vLLM answers."""
    chat = b'"messages"' in raw
    req = parse(raw, TokenizeChatRequest if chat else TokenizeCompletionRequest)
    if req.model is not None:
        _model(req, limits)
    if chat:
        kwargs = _template_kwargs(req)
        messages = [template_message(m) for m in req.messages]
        try:
            text = render_chat(tokenizer, messages, add_generation_prompt=req.add_generation_prompt,
                               **kwargs)
        except Exception as exc:
            raise APIError(400, f"the chat template rejected these messages: {exc}",
                           param="messages") from exc
    else:
        text = req.prompt
    if len(text) > limits.max_body_bytes:
        raise APIError(400, "the text is too long to tokenize", param="prompt")
    ids = list(tokenizer.encode(text, add_special_tokens=req.add_special_tokens))
    return {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}


def detokenize_body(raw: bytes, tokenizer: Any, limits: Limits) -> dict:
    """POST /detokenize: the text of token ids, as vLLM answers."""
    req = parse(raw, DetokenizeRequest)
    if req.model is not None:
        _model(req, limits)
    bad = next((t for t in req.tokens if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of range; allowed: 0 to "
                       f"{limits.vocab_size - 1}", param="tokens")
    return {"prompt": tokenizer.decode(req.tokens)}
