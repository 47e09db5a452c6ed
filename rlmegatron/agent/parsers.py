"""Tool-call formats: how a model's turn (its decoded text) names the tools it calls. A registry by name
(`rollout.multi_turn.tool_call_format`), so another model family's format is one class and one `register` away."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    """Why the call could not be read (bad JSON, no name); the model is told this instead of a tool's answer."""


class ToolCallParser:
    """Finds the tool calls in one model turn; none means the turn is a final answer."""

    def parse(self, text: str) -> list[ToolCall]:
        raise NotImplementedError


PARSERS: dict[str, Callable[[], ToolCallParser]] = {}


def register(name: str) -> Callable[[type], type]:
    def decorator(parser_class: type) -> type:
        if name in PARSERS:
            raise ValueError(f"tool-call format {name!r} is already registered")
        PARSERS[name] = parser_class
        return parser_class

    return decorator


def tool_call_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise LookupError(f"unknown tool-call format {name!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


@register("hermes")
class HermesParser(ToolCallParser):
    """Hermes/Qwen (Qwen2.5, Qwen3, QwQ): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per
    turn. An unclosed `<tool_call>` at the end of a turn (cut by its token budget) counts as a malformed call."""

    CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for match in self.CALL.finditer(text):
            body = match.group(1).strip()
            try:
                payload = json.loads(body)
            except json.JSONDecodeError as err:
                calls.append(ToolCall("", error=f"the tool call is not valid JSON ({err.msg} at char {err.pos})"))
                continue
            name = payload.get("name") if isinstance(payload, dict) else None
            arguments = payload.get("arguments", {}) if isinstance(payload, dict) else None
            if isinstance(arguments, str):  # some models emit the arguments as a JSON string
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    arguments = None
            if not isinstance(name, str) or not isinstance(arguments, dict):
                calls.append(ToolCall(str(name or ""), error='a tool call needs {"name": "...", "arguments": {...}}'))
                continue
            calls.append(ToolCall(name, arguments))
        return calls
