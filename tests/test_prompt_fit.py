"""prompt_fit: a conversation's oldest turns left out until its prompt fits (the Realtime API's
truncation), counted by the prompt build itself; here a build that counts each message's words."""

from __future__ import annotations

import pytest

from gateway.prompt_fit import PromptFit, fitted
from omnistage.v1 import gateway_pb2


def _request(*turns: tuple[str, int]) -> gateway_pb2.GenerateRequest:
    """Messages of (role, tokens): each message's content is that many words."""
    req = gateway_pb2.GenerateRequest()
    for i, (role, n) in enumerate(turns):
        req.messages.append(gateway_pb2.ChatMessage(role=role, content=" ".join([f"w{i}"] * n)))
    return req


def _fit(req: gateway_pb2.GenerateRequest, fit: PromptFit,
         max_chars: int = 1 << 20) -> tuple[gateway_pb2.GenerateRequest, list[int]]:  # fmt: skip
    built: list[int] = []

    def build(r: gateway_pb2.GenerateRequest) -> gateway_pb2.GenerateRequest:
        built.append(len(r.messages))
        return r

    def words(r: gateway_pb2.GenerateRequest) -> int:
        return sum(len(m.content.split()) for m in r.messages)

    return fitted(req, fit, build, words, lambda text: len(text.split()), max_chars), built


def test_a_prompt_that_fits_is_built_once_and_kept_whole() -> None:
    req = _request(("system", 5), ("user", 10), ("assistant", 10), ("user", 10))
    fit = PromptFit(limit=35, fixed=1)
    out, built = _fit(req, fit)
    assert out == req and built == [4] and fit.dropped == 0


def test_auto_leaves_out_the_fewest_oldest_turns_and_keeps_the_instructions() -> None:
    req = _request(("system", 5), ("user", 10), ("assistant", 10), ("user", 10), ("assistant", 10), ("user", 10))
    fit = PromptFit(limit=36, fixed=1)  # 55 in all: two turns must go (35)
    out, _ = _fit(req, fit)
    assert fit.dropped == 2 and [m.role for m in out.messages] == ["system", "user", "assistant", "user"]
    assert out.messages[0].content == req.messages[0].content and out.messages[1].content == req.messages[3].content


def test_a_retention_target_leaves_out_more_and_the_last_user_turn_stays() -> None:
    req = _request(("user", 10), ("assistant", 10), ("user", 10), ("assistant", 10), ("user", 10), ("assistant", 3))
    fit = PromptFit(limit=45, ratio=20 / 45)  # 53: down to 20 or fewer
    out, _ = _fit(req, fit)
    assert fit.dropped == 4 and sum(len(m.content.split()) for m in out.messages) == 13
    # a target nothing reaches: as far as the last user turn, which must be within the limit
    fit = PromptFit(limit=45, ratio=5 / 45)
    out, _ = _fit(req, fit)
    assert fit.dropped == 4 and out.messages[0].role == "user"
    # over the limit even so: the last user turn on is what is left (the gateway refuses it past the
    # model's own length; within it, it is served with less room for the reply)
    fit = PromptFit(limit=12)
    out, _ = _fit(req, fit)
    assert fit.dropped == 4 and [m.role for m in out.messages] == ["user", "assistant"]


def test_a_single_turn_over_the_limit_is_left_as_it_is() -> None:
    req = _request(("system", 10), ("user", 40))
    fit = PromptFit(limit=30, fixed=1)
    out, built = _fit(req, fit)
    assert out == req and fit.dropped == 0 and built == [2]


def test_a_conversation_just_over_takes_few_builds() -> None:
    """What its last truncation left, then a turn or two: the count tried doubles from one."""
    req = _request(*[("user" if i % 2 == 0 else "assistant", 10) for i in range(41)])
    fit = PromptFit(limit=400)  # 410: one turn goes
    out, built = _fit(req, fit)
    assert fit.dropped == 1 and fit.builds == len(built) == 2 and len(out.messages) == 40
    fit = PromptFit(limit=400, ratio=0.75)  # to 300: 11 turns go: 1, 2, 4, 8, 16, then 12, 10, 11
    _fit(req, fit)
    assert fit.dropped == 11 and fit.builds == 9


def test_the_targets_arithmetic_counts_the_instructions_where_a_retention_ratio_needs_them() -> None:
    counted: list[str] = []

    def count(text: str) -> int:
        counted.append(text)
        return len(text.split())

    fit = PromptFit(limit=924, instructions="be brief please", fixed=1)
    fit.resolve(count)
    assert (fit.limit, fit.target, counted) == (924, 924, [])  # "auto": nothing counted
    fit = PromptFit(limit=924, ratio=0.5, instructions="be brief please", post_instructions=200, fixed=1)
    fit.resolve(count)
    assert (fit.limit, fit.target, counted) == (203, 103, ["be brief please"])  # 3 + 200; 3 + 100


def test_turns_whose_text_cannot_fit_go_before_any_build() -> None:
    """What the gateway refuses of any request before tokenizing (too many characters for the
    model's length): those turns could never be in the prompt, so no build tokenizes them."""
    req = _request(*[("user" if i % 2 == 0 else "assistant", 100) for i in range(9)])
    fit = PromptFit(limit=10_000)
    chars = len(req.messages[0].content)  # (each message's: 100 words)
    out, built = _fit(req, fit, max_chars=3 * chars)
    assert fit.dropped == 6 and built == [3] and len(out.messages) == 3
    with pytest.raises(ValueError, match="characters of text from its last user turn on cannot fit"):
        _fit(_request(("user", 100)), PromptFit(limit=10_000), max_chars=chars - 1)


def test_a_cut_takes_a_calls_results_along() -> None:
    """Leaving out the oldest turns never starts the prompt at a tool turn whose call went: the
    results go with it (the template would render them as answering nothing)."""
    req = _request(("system", 5), ("user", 10), ("assistant", 10), ("tool", 3), ("tool", 3), ("assistant", 10),
                   ("user", 10))  # fmt: skip
    fit = PromptFit(limit=35, fixed=1)  # 51 in all: dropping [user, assistant] (31) is enough but for the tools
    out, _ = _fit(req, fit)
    assert fit.dropped == 4 and [m.role for m in out.messages] == ["system", "assistant", "user"]


def test_a_conversation_that_fits_keeps_a_leading_tool_turn() -> None:
    """Nothing over the limit: nothing left out, a tool turn first too (a cut takes results along
    only where it cuts)."""
    req = _request(("system", 5), ("tool", 3), ("user", 10))
    fit = PromptFit(limit=35, fixed=1)
    out, _ = _fit(req, fit)
    assert fit.dropped == 0 and out == req
