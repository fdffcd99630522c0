"""prompt_fit: a conversation's oldest turns left out until its prompt fits (the Realtime API's
truncation), counted by the prompt build itself; here a build that counts each message's words."""

from __future__ import annotations

from gateway.prompt_fit import PromptFit, fitted
from omnistage.v1 import gateway_pb2


def _request(*turns: tuple[str, int]) -> gateway_pb2.GenerateRequest:
    """Messages of (role, tokens): each message's content is that many words."""
    req = gateway_pb2.GenerateRequest()
    for i, (role, n) in enumerate(turns):
        req.messages.append(gateway_pb2.ChatMessage(role=role, content=" ".join([f"w{i}"] * n)))
    return req


def _fit(req: gateway_pb2.GenerateRequest, fit: PromptFit) -> tuple[gateway_pb2.GenerateRequest, list[int]]:
    built: list[int] = []

    def build(r: gateway_pb2.GenerateRequest) -> gateway_pb2.GenerateRequest:
        built.append(len(r.messages))
        return r

    return fitted(req, fit, build, lambda r: sum(len(m.content.split()) for m in r.messages)), built


def test_a_prompt_that_fits_is_built_once_and_kept_whole() -> None:
    req = _request(("system", 5), ("user", 10), ("assistant", 10), ("user", 10))
    fit = PromptFit(limit=35, target=35, fixed=1)
    out, built = _fit(req, fit)
    assert out == req and built == [4] and fit.dropped == 0


def test_auto_leaves_out_the_fewest_oldest_turns_and_keeps_the_instructions() -> None:
    req = _request(("system", 5), ("user", 10), ("assistant", 10), ("user", 10), ("assistant", 10), ("user", 10))
    fit = PromptFit(limit=36, target=36, fixed=1)  # 55 in all: two turns must go (35)
    out, _ = _fit(req, fit)
    assert fit.dropped == 2 and [m.role for m in out.messages] == ["system", "user", "assistant", "user"]
    assert out.messages[0].content == req.messages[0].content and out.messages[1].content == req.messages[3].content


def test_a_retention_target_leaves_out_more_and_the_last_user_turn_stays() -> None:
    req = _request(("user", 10), ("assistant", 10), ("user", 10), ("assistant", 10), ("user", 10), ("assistant", 3))
    fit = PromptFit(limit=45, target=20, fixed=0)  # 53: down to 20 or fewer
    out, _ = _fit(req, fit)
    assert fit.dropped == 4 and sum(len(m.content.split()) for m in out.messages) == 13
    # a target nothing reaches: as far as the last user turn, which must be within the limit
    fit = PromptFit(limit=45, target=5, fixed=0)
    out, _ = _fit(req, fit)
    assert fit.dropped == 4 and out.messages[0].role == "user"
    # over the limit even so: the last user turn on is what is left (the gateway refuses it past the
    # model's own length; within it, it is served with less room for the reply)
    fit = PromptFit(limit=12, target=12, fixed=0)
    out, _ = _fit(req, fit)
    assert fit.dropped == 4 and [m.role for m in out.messages] == ["user", "assistant"]


def test_a_single_turn_over_the_limit_is_left_as_it_is() -> None:
    req = _request(("system", 10), ("user", 40))
    fit = PromptFit(limit=30, target=30, fixed=1)
    out, built = _fit(req, fit)
    assert out == req and fit.dropped == 0 and built == [2]


def test_a_conversation_just_over_takes_few_builds() -> None:
    """What its last truncation left, then a turn or two: the count tried doubles from one."""
    req = _request(*[("user" if i % 2 == 0 else "assistant", 10) for i in range(41)])
    fit = PromptFit(limit=400, target=400, fixed=0)  # 410: one turn goes
    out, built = _fit(req, fit)
    assert fit.dropped == 1 and fit.builds == len(built) == 2 and len(out.messages) == 40
    fit = PromptFit(limit=400, target=300, fixed=0)  # 11 turns go: 1, 2, 4, 8, 16, then 12, 10, 11
    _fit(req, fit)
    assert fit.dropped == 11 and fit.builds == 9
