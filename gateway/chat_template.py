"""A request's own variables for the checkpoint's chat template (vLLM's `chat_template_kwargs`,
as Qwen3 clients send `{"enable_thinking": false}`).

A variable the template reads is rendered with the request's value; one it never names changes
nothing and is dropped (as vLLM drops it); one the renderer sets itself (the messages, the
generation prompt, the special tokens, apply_chat_template's own options) is refused, as it
would change what this server renders, not what the template asks. Both front doors come here:
the values travel as JSON in `GenerateRequest.chat_template_kwargs`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["FIELD", "MAX_VARIABLES", "RENDERER_NAMES", "template_kwargs", "template_names"]

FIELD = "chat_template_kwargs"
MAX_VARIABLES = 64
# what transformers' apply_chat_template sets or takes itself: a template variable of these names is
# not the request's to set (and `*_token`: the tokenizer's special tokens, which it passes too)
RENDERER_NAMES = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs", "raise_exception", "strftime_now",
})  # fmt: skip


def template_names(template: str) -> frozenset[str]:
    """Every name a chat template's text holds (a superset of the variables it reads)."""
    return frozenset(re.findall(r"[A-Za-z_]\w*", template))


def template_kwargs(raw: Mapping[str, str], names: frozenset[str]) -> dict[str, Any]:
    """`raw` (variable -> its JSON value) as the template is rendered with: the variables `names`
    holds. ValueError names the field."""
    if len(raw) > MAX_VARIABLES:
        raise ValueError(f"{FIELD}: {len(raw)} variables; at most {MAX_VARIABLES}")
    refused = sorted(k for k in raw if k in RENDERER_NAMES or k.endswith("_token"))
    if refused:
        raise ValueError(f"{FIELD}: {', '.join(refused)}: set by this server's renderer, not by a request")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in names:
            continue
        try:
            out[key] = json.loads(value)
        except (ValueError, RecursionError):  # (nested past the parser's stack: over gRPC, no body parser before)
            raise ValueError(f"{FIELD}: {key}: not a JSON value") from None
    return out
