"""A conversation's prompt kept within a number of tokens by leaving out its oldest turns: the
Realtime API's `truncation`. "auto" leaves out as few as it takes; `retention_ratio` leaves out
enough to come down to that share of the limit, so that the turns after it keep the same start
(and the thinker's prefix cache goes on hitting) until the limit is reached again.

The count is the prompt's own (the gateway's prompt build: template, tokenizer, processor); the
turns to leave out are found by bisection over how many, each try a build, so a conversation
that fits costs one build, as any request does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from omnistage.v1 import gateway_pb2

__all__ = ["PromptFit", "fitted"]

P = TypeVar("P")


@dataclass
class PromptFit:
    """limit: the most prompt tokens; target: when over it, the fewest turns are left out that
    bring it to this many or fewer (limit for "auto"); fixed: the leading messages always kept
    (the instructions). `dropped` is set by `fitted`: the messages it left out after them."""

    limit: int
    target: int
    fixed: int = 0
    dropped: int = 0


def without(request: gateway_pb2.GenerateRequest, fixed: int, count: int) -> gateway_pb2.GenerateRequest:
    """`request` with its `count` messages after the first `fixed` left out."""
    out = gateway_pb2.GenerateRequest()
    out.CopyFrom(request)
    del out.messages[fixed : fixed + count]
    return out


def fitted(request: gateway_pb2.GenerateRequest, fit: PromptFit, build: Callable[[gateway_pb2.GenerateRequest], P],
           length: Callable[[P], int]) -> P:  # fmt: skip
    """The prompt `build` makes of `request`, or of it with its oldest turns left out (`fit.dropped`
    of them) where it is over `fit.limit`: at most up to its last user message, which a reply
    answers. ValueError names the prompt where even that one is over the limit."""
    prompt = build(request)
    fit.dropped = 0
    if length(prompt) <= fit.limit:
        return prompt
    users = [i for i, m in enumerate(request.messages) if i >= fit.fixed and m.role == "user"]
    most = users[-1] - fit.fixed if users else 0  # (no user turn: nothing to keep it for)
    best: tuple[int, P] | None = None
    low, high = 1, most
    while low <= high:  # fewer turns left out: more tokens (the count falls as turns go)
        mid = (low + high) // 2
        tried = build(without(request, fit.fixed, mid))
        if length(tried) <= fit.target:
            best, high = (mid, tried), mid - 1
        else:
            low = mid + 1
    if best is None:  # the last user turn alone is over the target: kept if within the limit
        tried = build(without(request, fit.fixed, most)) if most else prompt
        if length(tried) > fit.limit:
            raise ValueError(f"prompt: {length(tried)} tokens with only the last turn kept exceeds the "
                             f"conversation's limit of {fit.limit}")  # fmt: skip
        best = (most, tried)
    fit.dropped = best[0]
    return best[1]
