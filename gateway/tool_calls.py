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
import re
import uuid
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CLOSE", "MAX_DEPTH", "NAME", "OPEN", "Call", "CallStream", "call_start_id", "chat_tool", "check_nesting",
           "nesting", "new_call_id", "parse", "read_tools", "spoken", "takes_tools", "tools_refusal"]

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a function's name
MAX_DEPTH = 64  # a tool's JSON nests at most this deep (a schema's rarely pass 10; renderers recurse)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON object's text

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's shape of the call (`index`: a streamed delta's), with a fresh id."""
        out: dict[str, Any] = {"id": new_call_id(), "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        return out if index is None else {"index": index, **out}


def chat_tool(flat: dict[str, Any]) -> dict[str, Any]:
    """A flat function tool (the Realtime and Responses APIs' `{"type": "function", "name", ...}`)
    as chat's `{"type": "function", "function": {...}}`, which the template renders as a chat
    client's."""
    return {"type": "function", "function": {k: v for k, v in flat.items() if k != "type"}}


def takes_tools(template_names: frozenset[str]) -> bool:
    """Whether a chat template renders tools (it reads a `tools` variable): one that does not
    would leave them, and the calls and results of earlier turns, out of the prompt."""
    return "tools" in template_names


def tools_refusal(template_names: frozenset[str], call_start: int | None, audio: bool, remedy: str) -> str | None:
    """Why a request's tools cannot be honoured (None: they can): a template that renders none,
    or speech that could not end where a call starts (`call_start`: `call_start_id`'s; `remedy`:
    how the client asks for text alone)."""
    if not takes_tools(template_names):
        return "this checkpoint's chat template takes no tools"
    if audio and call_start is None:
        return f"with audio, a call must start with one token ({OPEN}), which this checkpoint's tokenizer " \
               f"lacks: {remedy}"  # fmt: skip
    return None


def call_start_id(tokenizer: Any) -> int | None:
    """The token a call starts with (OPEN, one token in Qwen's tokenizers), None where the
    tokenizer has no such token: with speech the talker's input ends there (the speech is the
    text before the call; SamplingParams.speech_end_ids)."""
    ids = tokenizer.encode(OPEN, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def nesting(obj: Any) -> int:
    """How deep a JSON value nests (a scalar: 0), walked without recursion."""
    deepest, todo = 0, [(obj, 0)]
    while todo:
        value, depth = todo.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is not None:
            deepest = max(deepest, depth + 1)
            todo.extend((child, depth + 1) for child in children)
    return deepest


def check_nesting(tool: Any, where: str) -> None:
    """ValueError naming `where` if a tool nests past MAX_DEPTH."""
    if nesting(tool) > MAX_DEPTH:
        raise ValueError(f"{where}: nested more than {MAX_DEPTH} levels deep")


def read_tools(raw: Sequence[str]) -> list[dict[str, Any]]:
    """`GenerateRequest.tools` as the template's `tools` (ValueError naming the field)."""
    tools: list[dict[str, Any]] = []
    for i, text in enumerate(raw):
        where = f"tools[{i}]"
        try:
            tool = json.loads(text)
        except (ValueError, RecursionError):
            raise ValueError(f"{where}: not JSON") from None
        check_nesting(tool, where)
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise ValueError(f'{where}: expected {{"type": "function", "function": {{"name": ...}}}}')
        if not isinstance(function.get("name"), str) or not re.fullmatch(NAME, function["name"]):
            raise ValueError(f"{where}.function.name: expected the function's name: 1 to 64 of a-z, A-Z, 0-9, _ "
                             "and -")  # fmt: skip
        tools.append(tool)
    return tools


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")  # (Python's parser takes NaN and Infinity)


def _json(text: str) -> Any:
    """`text` as strict JSON (ValueError where it is not)."""
    try:
        return json.loads(text, parse_constant=_not_json)
    except RecursionError:
        raise ValueError("nested too deep") from None


def _call(block: str) -> Call | None:
    """A block's call (the text between OPEN and CLOSE), None when it reads as none."""
    try:
        obj = _json(block)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        arguments = obj.get("arguments", obj.get("parameters"))  # (some Qwen replies say "parameters")
        if arguments is None:  # (a function of no arguments)
            arguments = {}
        if isinstance(arguments, str):  # given as text: it must hold an object too
            if not isinstance(_json(arguments), dict):
                return None
        elif isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        else:
            return None
        # an escape of half a UTF-16 pair ("\ud83d") reads as a lone surrogate, which no UTF-8 holds
        (obj["name"] + arguments).encode()
    except (ValueError, UnicodeEncodeError):
        return None
    return Call(obj["name"], arguments)


def spoken(text: str) -> str:
    """What a spoken reply says of its text: the talker's input ends at the first call's start
    (SamplingParams.speech_end_ids), whether or not the call reads as one."""
    start = text.find(OPEN)
    return text if start < 0 else text[:start].rstrip()


def parse(text: str, names: Collection[str] | None = None) -> tuple[str | None, list[Call]]:
    """A whole reply's content and calls. With calls, the content is the text before the first
    one (its trailing whitespace left out) and any other text outside them, None when that is
    nothing; without, the whole text. `names`: the only functions it may call (`tool_choice:
    allowed_tools`); a reply that calls another calls nothing, as one whose block does not read."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls: list[Call] = []
    outside = [text[:start].rstrip()]
    rest = text[start:]
    while rest.startswith(OPEN):
        # the first CLOSE after which the block reads as a call (an argument's text may hold CLOSE)
        read = ((end, _call(rest[len(OPEN) : end])) for end in _finds(rest, CLOSE))
        end, call = next(((end, call) for end, call in read if call is not None), (-1, None))
        if call is None or (names is not None and call.name not in names):
            return text, []
        calls.append(call)
        rest = rest[end + len(CLOSE) :]
        after = rest.find(OPEN)
        between, rest = (rest, "") if after < 0 else (rest[:after], rest[after:])
        if between.strip():
            outside.append(between.strip())
    return "\n".join(t for t in outside if t) or None, calls


def _finds(text: str, sub: str) -> Iterator[int]:
    at = text.find(sub)
    while at >= 0:
        yield at
        at = text.find(sub, at + 1)


class CallStream:
    """A streamed reply's content as it may show before the reply ends: each piece of text is
    fed; what `feed` gives is content whatever the calls turn out to be (text that may start a
    call, or whitespace before one, waits), and `finish` gives the rest of the content and the
    calls, as `parse` reads the whole."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self._held = ""  # the text after what was given as content (before a call began)
        self._shown = 0  # characters given as content
        self._calling = False  # a call began: nothing more shows before the end

    def feed(self, piece: str) -> str:
        self._text.append(piece)
        if self._calling:
            return ""
        held = self._held + piece
        start = held.find(OPEN)
        if start >= 0:
            self._calling = True
            safe = len(held[:start].rstrip())
        else:  # hold back a tail that may be the start of OPEN, and trailing whitespace
            safe = len(held)
            for n in range(min(len(OPEN) - 1, len(held)), 0, -1):
                if OPEN.startswith(held[-n:]):
                    safe = len(held) - n
                    break
            safe = len(held[:safe].rstrip())
        self._held, self._shown = held[safe:], self._shown + safe
        return held[:safe]

    def finish(self, names: Collection[str] | None = None) -> tuple[str, list[Call]]:
        """The content not given yet, and the calls (`names`: as `parse`'s)."""
        content, calls = parse("".join(self._text), names)
        return (content or "")[self._shown :], calls

    def spoken_rest(self) -> str:
        """Of the text spoken (`spoken`), what was not given as content yet (at the end)."""
        return spoken("".join(self._text))[self._shown :]
