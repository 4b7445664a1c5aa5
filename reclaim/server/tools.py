"""Tool calling: what a request's tool_choice asks of the output, and tool calls parsed from text.

Formats read from a model's text (tool_choice "auto"): Hermes/Qwen blocks
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (one or more), and a reply that is
only a JSON object `{"name": ..., "arguments"|"parameters": {...}}` or a list of them (Llama 3
style). With tool_choice "required" the output is constrained to a JSON list of such objects,
and with a named function to that function's arguments, so the call always parses. With "auto"
and a tool marked `strict` (OpenAI: the arguments follow the schema), the text stays free but a
`<tool_call>` block, once opened, is constrained to a call of a given tool with arguments that
fit its schema; only that format is read then.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from reclaim.server.errors import APIError
from reclaim.server.schemas import ChatCompletionRequest, NamedToolChoice
from reclaim.server.structured import closed

FORMATS = ("hermes", "json")  # what "auto" parses
HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
OPEN_TAG = "<tool_call>"
# A constrained Hermes call (auto_grammar): OPEN_TAG, HERMES_HEAD, the arguments, HERMES_TAIL.
HERMES_HEAD = '\n{{"name": {name}, "arguments": '
HERMES_TAIL = "}\n</tool_call>"
ANY_OBJECT = {"type": "object"}


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def body(self, index: int | None = None) -> dict:
        """OpenAI's `tool_calls[i]` (with `index` in a stream delta)."""
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's output relates to its tools."""

    mode: Literal["auto", "required", "named"]
    names: tuple[str, ...]
    named: str | None = None  # the function tool_choice names
    parallel: bool = True  # parallel_tool_calls: more than one call per reply
    strict: bool = False  # "auto" with a strict tool: <tool_call> blocks are constrained

    @staticmethod
    def _parameters(request: ChatCompletionRequest) -> dict[str, dict]:
        return {t.function.name: closed(t.function.parameters or ANY_OBJECT)
                if t.function.strict else t.function.parameters or ANY_OBJECT
                for t in request.tools or []}

    def schema(self, request: ChatCompletionRequest) -> dict | None:
        """The JSON schema the output is constrained to (None for 'auto': free text)."""
        params = self._parameters(request)
        if self.mode == "named":
            return params[self.named]
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": name},
                                                       "arguments": params[name]},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for name in self.names]
            item = calls[0] if len(calls) == 1 else {"anyOf": calls}
            array = {"type": "array", "items": item, "minItems": 1}
            if not self.parallel:
                array["maxItems"] = 1
            return array
        return None

    def auto_grammar(self, request: ChatCompletionRequest) -> str:
        """A Lark grammar (llguidance's) for "auto" with strict tools: free text in which each
        `<tool_call>` opens a Hermes call of one of the tools, its arguments fitting the schema.
        The opening tag is a lazy lexeme: text runs until it appears, then the call is forced."""
        params = self._parameters(request)
        heads = " | ".join(f'{json.dumps(HERMES_HEAD.format(name=json.dumps(n)))} %json '
                           f'{json.dumps(params[n])}' for n in self.names)
        return ("%llguidance {}\n"
                f"start: call{'*' if self.parallel else '?'} TEXT\n"
                f"call: call_open ({heads}) {json.dumps(HERMES_TAIL)}\n"
                f"call_open[lazy]: TEXT {json.dumps(OPEN_TAG)}\n"
                "TEXT: /(.|\\n)*/\n")

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished output."""
        if self.mode == "named":
            return None, [ToolCall(self.named, _arguments(text))]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []  # cut short by max_tokens or a stop string
            return None, [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
                          for c in items]
        content, calls = parse_tool_calls(text, self.names, hermes_only=self.strict)
        return content, calls if self.parallel else calls[:1]


def plan_tools(req: ChatCompletionRequest) -> ToolPlan | None:
    """What tool_choice asks; None when no tool may be called."""
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    names = tuple(t.function.name for t in tools)
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise APIError(400, f"two tools are named {dup!r}; tool names must be unique", param="tools")
    if choice == "none":
        return None
    if not tools:
        raise APIError(400, f"tool_choice asks for a tool call but no tools are given; send "
                       f"tools, or tool_choice 'none'", param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice names function {choice.function.name!r}, which is "
                           f"not among the tools; allowed: {list(names)}", param="tool_choice")
        return ToolPlan("named", names, choice.function.name, req.parallel_tool_calls)
    return ToolPlan(choice, names, parallel=req.parallel_tool_calls,
                    strict=choice == "auto" and any(t.function.strict for t in tools))


def template_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools as chat templates take them (OpenAI's JSON schema form)."""
    if not req.tools or req.tool_choice == "none":
        return None
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)}
            for t in req.tools]


def _arguments(text: str) -> str:
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except json.JSONDecodeError:
        return text  # cut short: OpenAI passes the text on, the client's parser decides


def _call(obj: Any, names: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return ToolCall(obj["name"], _arguments(args))
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, names: tuple[str, ...],
                     hermes_only: bool = False) -> tuple[str | None, list[ToolCall]]:
    """Tool calls in a model's free text (FORMATS, or Hermes blocks only), and the content left
    beside them."""
    if OPEN_TAG in text:
        calls = []
        for block in HERMES.findall(text):
            try:
                call = _call(json.loads(block), names)
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []  # a malformed call is shown as text, not half-parsed
            calls.append(call)
        content = text[:text.index(OPEN_TAG)].strip()
        return content or None, calls
    stripped = text.strip()
    if stripped[:1] in ("{", "[") and not hermes_only:
        try:
            obj = json.loads(stripped)
        except json.JSONDecodeError:
            return text, []
        items = obj if isinstance(obj, list) else [obj]
        calls = [_call(o, names) for o in items]
        if items and all(calls):
            return None, calls
    return text, []


def template_message(m: Any) -> dict:
    """A request message as chat templates take it (tool calls' arguments as objects)."""
    msg: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        msg["name"] = m.name
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            args = c.function.arguments
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    raise APIError(400, f"an earlier tool call to {c.function.name!r} has "
                                   f"arguments that are not JSON", param="messages") from None
            calls.append({"id": c.id, "type": "function",
                          "function": {"name": c.function.name, "arguments": args}})
        msg["tool_calls"] = calls
    return msg
