"""A conversation's prompt kept within a number of tokens by leaving out its oldest turns: the
Realtime API's `truncation`. "auto" leaves out as few as it takes; `retention_ratio` leaves out
enough to come down to that share of the limit, so that the turns after it keep the same start
(and the thinker's prefix cache goes on hitting) until the limit is reached again.

The count is the prompt's own (the gateway's prompt build: template, tokenizer, processor); the
turns to leave out are found by search over how many (doubling, then bisecting), each try a build,
so a conversation that fits costs one build, as any request does.
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
    builds: int = 0  # (set by `fitted`: the prompt builds it took)


def without(request: gateway_pb2.GenerateRequest, fixed: int, count: int) -> gateway_pb2.GenerateRequest:
    """`request` with its `count` messages after the first `fixed` left out."""
    out = gateway_pb2.GenerateRequest()
    out.CopyFrom(request)
    del out.messages[fixed : fixed + count]
    return out


def fitted(request: gateway_pb2.GenerateRequest, fit: PromptFit, build: Callable[[gateway_pb2.GenerateRequest], P],
           length: Callable[[P], int]) -> P:  # fmt: skip
    """The prompt `build` makes of `request`, or of it with its oldest turns left out (`fit.dropped`
    of them) where it is over `fit.limit`: the fewest that bring it to `fit.target` or under, at
    most up to its last user message, which a reply answers (that one kept whatever its length:
    the caller refuses a prompt over the model's own). The count tried doubles from one, then is
    bisected: a conversation its last truncation left just over the limit costs two or three
    builds, not a bisection of all its turns."""
    prompt = build(request)
    fit.builds, fit.dropped = 1, 0
    if length(prompt) <= fit.limit:
        return prompt
    users = [i for i, m in enumerate(request.messages) if i >= fit.fixed and m.role == "user"]
    most = users[-1] - fit.fixed if users else 0  # (no user turn: nothing to keep it for)
    tried: dict[int, P] = {0: prompt}

    def over(count: int) -> bool:
        if count not in tried:
            tried[count] = build(without(request, fit.fixed, count))
            fit.builds += 1
        return length(tried[count]) > fit.target

    low, high = 0, 1  # over at `low`; `high`: the first count tried that is not, or `most`
    while high < most and over(high):
        low, high = high, min(2 * high, most)
    if high > most or over(high):  # (most == 0, or the last user turn alone over the target)
        high = most
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if over(mid) else (low, mid)
    if high not in tried:
        over(high)
    fit.dropped = high
    return tried[high]
