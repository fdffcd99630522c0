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

__all__ = ["PromptFit", "fitted", "text_chars", "without"]

P = TypeVar("P")


@dataclass
class PromptFit:
    """limit: the most prompt tokens; ratio: when over it, the fewest turns are left out that bring
    it to this share of what follows the instructions (1: the limit, "auto"); fixed: the leading
    messages always kept (the instructions, `instructions` their text); post_instructions: a
    lower limit for what follows them. `fitted` sets `target` (counting the instructions in the
    worker thread: not on the event loop), `dropped` (the messages it left out after `fixed`)
    and `builds` (the prompt builds it took)."""

    limit: int
    ratio: float = 1.0
    fixed: int = 0
    instructions: str = ""
    post_instructions: int | None = None
    target: int = 0
    dropped: int = 0
    builds: int = 0

    def resolve(self, count: Callable[[str], int]) -> None:
        """The limit and target in tokens, the instructions counted by `count` where they matter."""
        if self.ratio == 1.0 and self.post_instructions is None:
            self.target = self.limit
            return
        instruction_tokens = count(self.instructions) if self.instructions else 0
        if self.post_instructions is not None:
            self.limit = min(self.limit, instruction_tokens + self.post_instructions)
        after = max(0, self.limit - instruction_tokens)
        self.target = min(self.limit, instruction_tokens + int(self.ratio * after))


def without(request: gateway_pb2.GenerateRequest, fixed: int, count: int) -> gateway_pb2.GenerateRequest:
    """`request` with its `count` messages after the first `fixed` left out."""
    out = gateway_pb2.GenerateRequest()
    out.CopyFrom(request)
    del out.messages[fixed : fixed + count]
    return out


def text_chars(message: gateway_pb2.ChatMessage) -> int:
    """The characters of a message's text (what bounds its tokens before it is tokenized)."""
    calls = sum(len(c.name) + len(c.arguments) for c in message.tool_calls)
    return len(message.content) + sum(len(p.text) for p in message.parts) + calls


def fitted(request: gateway_pb2.GenerateRequest, fit: PromptFit, build: Callable[[gateway_pb2.GenerateRequest], P],
           length: Callable[[P], int], count: Callable[[str], int], max_chars: int) -> P:  # fmt: skip
    """The prompt `build` makes of `request`, or of it with its oldest turns left out (`fit.dropped`
    of them) where it is over `fit.limit`: the fewest that bring it to `fit.target` or under, at
    most up to its last user message, which a reply answers (that one kept whatever its length:
    the caller refuses a prompt over the model's own). The turns whose text cannot fit in any
    case (more than `max_chars` characters with those after them: what the caller refuses of any
    request before tokenizing) go before the first build; then the count tried doubles from one,
    then is bisected: a conversation its last truncation left just over the limit costs two or
    three builds, not a bisection of all its turns. Only the lengths of the builds tried are
    kept, and the best one's prompt."""
    fit.resolve(count)
    users = [i for i, m in enumerate(request.messages) if i >= fit.fixed and m.role == "user"]
    most = users[-1] - fit.fixed if users else 0  # (no user turn: nothing to keep it for)
    chars = sum(text_chars(m) for m in request.messages)
    floor = 0  # turns that cannot fit whatever follows: their text alone is past the bound
    while floor < most and chars > max_chars:
        chars -= text_chars(request.messages[fit.fixed + floor])
        floor += 1
    if chars > max_chars:
        raise ValueError(f"prompt: {chars} characters of text from its last user turn on cannot fit in the model's "
                         f"length (at most {max_chars})")  # fmt: skip
    fit.builds, fit.dropped = 0, 0
    lengths: dict[int, int] = {}

    def cut(n: int) -> int:  # a cut takes a call's results along (a tool turn never starts what it kept)
        while 0 < n < most and request.messages[fit.fixed + n].role == "tool":
            n += 1
        return n

    kept: dict[int, P] = {}  # the first build's prompt, and the fewest count's found within the target

    def made(n: int) -> P:  # the prompt with the first `n` turns after `fixed` left out
        fit.builds += 1
        return build(without(request, fit.fixed, cut(n)) if cut(n) else request)

    def over(n: int) -> bool:
        if n not in lengths:
            prompt = made(n)
            lengths[n] = length(prompt)
            best = min((k for k in kept if k != floor), default=None)
            if n == floor or (lengths[n] <= fit.target and (best is None or n < best)):
                kept[n] = prompt
                if n != floor and best is not None:
                    del kept[best]
        return lengths[n] > fit.target

    over(floor)
    if lengths[floor] <= (fit.limit if floor == 0 else fit.target):  # (it fits as it is: nothing to leave out)
        fit.dropped = cut(floor)
        return kept[floor]
    low, high = floor, floor + 1  # over at `low`; `high`: the first count tried that is not, or `most`
    while high < most and over(high):
        low, high = high, min(floor + 2 * (high - floor), most)
    if high > most or over(high):  # (the last user turn alone over the target, or nothing to leave out)
        high = max(most, floor)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if over(mid) else (low, mid)
    if high not in kept:  # (the fallback, not within the target: built again)
        kept[high] = made(high)
    fit.dropped = cut(high)
    return kept[high]
