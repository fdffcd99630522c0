"""Tool calls: the tools a request offers, as its chat template renders them, and the calls a
reply makes, read out of its text.

Qwen's checkpoints (both omni families' templates, where they take tools) write a call as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (the Hermes format): `parse`
reads a whole reply, `CallStream` a streamed one, to the same content and calls. A reply whose
blocks do not all read as calls (unclosed, not JSON, no name) calls nothing: its whole text is
its content, as vLLM's parser leaves it, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CLOSE", "OPEN", "Call", "CallStream", "call_start_id", "parse", "read_tools", "takes_tools"]

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON object's text

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's shape of the call (`index`: a streamed delta's), with a fresh id."""
        out: dict[str, Any] = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        return out if index is None else {"index": index, **out}


def takes_tools(template_names: frozenset[str]) -> bool:
    """Whether a chat template renders tools (it reads a `tools` variable): one that does not
    would leave them, and the calls and results of earlier turns, out of the prompt."""
    return "tools" in template_names


def call_start_id(tokenizer: Any) -> int | None:
    """The token a call starts with (OPEN, one token in Qwen's tokenizers), None where the
    tokenizer has no such token: with speech the talker's input ends there (the speech is the
    text before the call; SamplingParams.speech_end_ids)."""
    ids = tokenizer.encode(OPEN, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def read_tools(raw: Sequence[str]) -> list[dict[str, Any]]:
    """`GenerateRequest.tools` as the template's `tools` (ValueError naming the field)."""
    tools: list[dict[str, Any]] = []
    for i, text in enumerate(raw):
        where = f"tools[{i}]"
        try:
            tool = json.loads(text)
        except (ValueError, RecursionError):
            raise ValueError(f"{where}: not JSON") from None
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise ValueError(f'{where}: expected {{"type": "function", "function": {{"name": ...}}}}')
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"{where}.function.name: expected the function's name")
        tools.append(tool)
    return tools


def _call(block: str) -> Call | None:
    """A block's call (the text between OPEN and CLOSE), None when it reads as none."""
    try:
        obj = json.loads(block)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))  # (some Qwen replies say "parameters")
    if isinstance(arguments, str):  # given as text: it must hold an object too
        try:
            if not isinstance(json.loads(arguments), dict):
                return None
        except (ValueError, RecursionError):
            return None
        return Call(obj["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return Call(obj["name"], json.dumps(arguments, ensure_ascii=False))


def parse(text: str) -> tuple[str | None, list[Call]]:
    """A whole reply's content and calls. With calls, the content is the text before the first
    one (its trailing whitespace left out) and any other text outside them, None when that is
    nothing; without, the whole text."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls: list[Call] = []
    outside = [text[:start].rstrip()]
    rest = text[start:]
    while rest.startswith(OPEN):
        end = rest.find(CLOSE)
        call = _call(rest[len(OPEN) : end]) if end >= 0 else None
        if call is None:
            return text, []
        calls.append(call)
        rest = rest[end + len(CLOSE) :]
        after = rest.find(OPEN)
        between, rest = (rest, "") if after < 0 else (rest[:after], rest[after:])
        if between.strip():
            outside.append(between.strip())
    return "\n".join(t for t in outside if t) or None, calls


class CallStream:
    """A streamed reply's content as it may show before the reply ends: each piece of text is
    fed; what `feed` gives is content whatever the calls turn out to be (text that may start a
    call, or whitespace before one, waits), and `finish` gives the rest of the content and the
    calls, as `parse` reads the whole."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self._shown = 0  # characters given as content
        self._calling = False  # a call began: nothing more shows before the end

    def feed(self, piece: str) -> str:
        self._text.append(piece)
        if self._calling:
            return ""
        text = "".join(self._text)
        start = text.find(OPEN, self._shown)
        if start >= 0:
            self._calling = True
            safe = len(text[:start].rstrip())
        else:  # hold back a tail that may be the start of OPEN, and trailing whitespace
            safe = len(text)
            for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
                if OPEN.startswith(text[-n:]):
                    safe = len(text) - n
                    break
            safe = len(text[:safe].rstrip())
        out = text[self._shown : max(safe, self._shown)]
        self._shown = max(safe, self._shown)
        return out

    def finish(self) -> tuple[str, list[Call]]:
        """The content not given yet, and the calls."""
        content, calls = parse("".join(self._text))
        return (content or "")[self._shown :], calls
