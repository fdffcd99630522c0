"""OpenAI's Responses API (gateway/responses_api.py), through OpenAI's own SDK: the gateway request
a response's input becomes is the chat door's for the same turns; the output, streamed or not, is
OpenAI's shapes (every event validated against the SDK's types); stored responses chain; what
cannot be honoured is a 400 naming the body's field."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response as SdkResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.responses_api import ResponsesRequest, ResponseStore, to_chat
from tests.test_tool_calls import CALL, CALL2, HISTORY, REPLY, TIME, WEATHER, _service, served_gateway

FLAT = [{"type": "function", **WEATHER["function"]}, {"type": "function", **TIME["function"]}]
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
# HISTORY's turns as Responses input items (its system turn is `instructions`)
ITEMS: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather and time in Paris?"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    {"type": "function_call_output", "call_id": "call_2", "output": "noon"},
]  # fmt: skip


def _run(tiny_dir: Path, reply: list[str], calls: list[Any], finish: str = "stop") -> tuple[list[Any], list[Any]]:
    """Each `call(client, http)` in turn (OpenAI's SDK, and plain httpx) on one gateway that
    answers `reply` every time; what they gave, and the gateway requests made."""
    from gateway.app import build_app

    async def go() -> tuple[list[Any], list[Any]]:
        service, seen = served_gateway(tiny_dir, reply, finish)
        transport = httpx.ASGITransport(app=build_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway/v1") as http:
            client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="x", http_client=http, max_retries=0)
            return [await call(client, http) for call in calls], seen

    return asyncio.run(go())


def _same_request(a: Any, b: Any) -> bool:
    a, b = type(a).FromString(a.SerializeToString()), type(b).FromString(b.SerializeToString())
    a.request_id = b.request_id = ""
    return bool(a == b)


def test_a_responses_input_is_the_chat_doors_turns(tiny_dir: Path) -> None:
    """Instructions, messages, an earlier reply's words and calls, and the calls' outputs reach
    the thinker as the chat door's request for HISTORY (the same prompt, rendered as
    apply_chat_template renders it: tests/test_tool_calls.py), with the same sampling."""

    async def chat(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
        return await client.chat.completions.create(model="m", messages=HISTORY, tools=[WEATHER, TIME],  # type: ignore[arg-type]
                                                    max_completion_tokens=7, temperature=0, top_p=0.5)  # fmt: skip

    async def responses(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
        return await client.responses.create(model="m", instructions="Be brief.", input=ITEMS, tools=FLAT,  # type: ignore[arg-type]
                                             max_output_tokens=7, temperature=0, top_p=0.5)  # fmt: skip

    _, seen = _run(tiny_dir, ["Sunny at noon."], [chat, responses])
    assert len(seen) == 2
    service = _service(tiny_dir)
    assert service._prompt(seen[1]).ids == service._prompt(seen[0]).ids
    # (the earlier reply's words come as its output_text part, where the chat door's are a string:
    # the same prompt, above; the rest of the request is the same)
    assert seen[1].messages[2].parts[0].text == seen[0].messages[2].content
    seen[1].messages[2].content = seen[1].messages[2].parts[0].text
    del seen[1].messages[2].parts[:]
    assert _same_request(seen[0], seen[1])
    assert [m.role for m in seen[1].messages] == ["system", "user", "assistant", "tool", "tool"]
    assert len(seen[1].messages[2].tool_calls) == 2  # the words and both calls: one turn, as the model wrote it


def test_a_reply_that_calls_reaches_the_sdk_as_a_message_and_function_calls(tiny_dir: Path) -> None:
    async def create(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
        return await client.responses.create(model="m", input="Weather in Paris?", tools=FLAT)  # type: ignore[arg-type]

    async def chat(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
        turn = {"role": "user", "content": "Weather in Paris?"}
        return await client.chat.completions.create(model="m", messages=[turn], tools=[WEATHER, TIME])  # type: ignore[arg-type,list-item]

    (got, chat_reply), _ = _run(tiny_dir, REPLY, [create, chat])
    assert isinstance(got, SdkResponse) and got.status == "completed" and got.error is None
    SdkResponse.model_validate(got.model_dump())
    kinds = [o.type for o in got.output]
    assert kinds == ["message", "function_call", "function_call"]
    assert got.output_text == "Let me check."
    calls = got.output[1:]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),  # type: ignore[union-attr]
                                                                  ("get_time", {})]  # fmt: skip
    assert len({c.call_id for c in calls}) == 2  # type: ignore[union-attr]
    u = got.usage
    assert u is not None and (u.input_tokens, u.output_tokens) == (chat_reply.usage.prompt_tokens,
                                                                    chat_reply.usage.completion_tokens)
    assert u.output_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens
    # the chat door reads the same calls out of the same reply
    assert [(c.function.name, c.function.arguments) for c in chat_reply.choices[0].message.tool_calls] == [
        (c.name, c.arguments) for c in calls]  # type: ignore[union-attr]


def _stream(**kw: Any) -> Any:
    async def call(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
        events = []
        async with client.responses.stream(model="m", **kw) as stream:
            async for event in stream:
                events.append(event)
        # (the SDK's accumulation: only a completed response has one, as OpenAI streams them)
        final = await stream.get_final_response() if events[-1].type == "response.completed" else None
        return events, final

    return call


def _whole(**kw: Any) -> Any:
    async def call(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
        return await client.responses.create(model="m", **kw)

    return call


def _plain(value: Any) -> Any:
    """A response's JSON without its fresh ids and the fields the SDK's accumulation adds."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if k not in ("id", "call_id", "parsed", "parsed_arguments")}
    return [_plain(v) for v in value] if isinstance(value, list) else value


def _shape(response: Any) -> list[Any]:
    """A response's output without its fresh ids."""
    return [_plain(o.model_dump(warnings=False)) for o in response.output]


@pytest.mark.parametrize("reply", [REPLY, ["Hello ", "there", "."], [CALL], ["A", " ", "<", "tool_call>", CALL[11:]],
                                   ["No <tool_call> here"], []])  # fmt: skip
def test_a_streamed_response_is_the_whole_one(tiny_dir: Path, reply: list[str]) -> None:
    """Streamed, every event is one of the SDK's types, in order (numbered from 1), the SDK's
    accumulation of them is the response the last event carries, and that is the whole
    (non-streamed) response: the same message, calls and status."""
    (streamed, whole), _ = _run(tiny_dir, reply, [_stream(input="hi", tools=FLAT), _whole(input="hi", tools=FLAT)])
    events, final = streamed
    raw = [e.model_dump(warnings=False) for e in events]
    for e in raw:
        EVENTS.validate_python(e)
    assert [e["sequence_number"] for e in raw] == list(range(1, len(raw) + 1))
    assert raw[0]["type"] == "response.created" and raw[1]["type"] == "response.in_progress"
    assert raw[-1]["type"] == "response.completed" and raw[-1]["response"]["id"] == raw[0]["response"]["id"]
    assert _shape(final) == _shape(whole) and final.output_text == whole.output_text
    text = "".join(e["delta"] for e in raw if e["type"] == "response.output_text.delta")
    assert text == whole.output_text
    added = [e for e in raw if e["type"] == "response.output_item.added"]
    done = [e for e in raw if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in added] == [e["output_index"] for e in done] == list(range(len(whole.output)))
    assert [e["item"]["type"] for e in done] == [o.type for o in whole.output]


def test_a_response_cut_at_max_output_tokens_is_incomplete(tiny_dir: Path) -> None:
    (whole, streamed), _ = _run(tiny_dir, ["Hello ", "there"], [_whole(input="hi"), _stream(input="hi")],
                                finish="length")  # fmt: skip
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output[0].status == "incomplete" and whole.output_text == "Hello there"
    events, final = streamed
    assert events[-1].type == "response.incomplete" and final is None
    last = events[-1].response
    assert last.status == "incomplete" and last.incomplete_details.reason == "max_output_tokens"
    assert _shape(last) == _shape(whole)


def test_stored_responses_chain_and_can_be_read_and_deleted(tiny_dir: Path) -> None:
    """A response's turns come before the next one's input (`previous_response_id`), its
    instructions not (OpenAI's rule); a call it made is answered by its call_id. A stored response
    reads back as it was made; deleted, or made with store false, it is unknown (404, 400)."""
    state: dict[str, Any] = {}

    async def first(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
        state["first"] = await client.responses.create(model="m", instructions="Be brief.", tools=FLAT,  # type: ignore[arg-type]
                                                       input="Weather and time in Paris?")  # fmt: skip
        return state["first"]

    async def second(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
        calls = [o for o in state["first"].output if o.type == "function_call"]
        outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": out}
                   for c, out in zip(calls, ["sunny", "noon"], strict=True)]  # fmt: skip
        return await client.responses.create(model="m", instructions="Be brief.", tools=FLAT,  # type: ignore[arg-type]
                                             previous_response_id=state["first"].id, input=outputs)  # type: ignore[arg-type]  # fmt: skip

    async def read(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
        return await client.responses.retrieve(state["first"].id)

    async def delete(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
        await client.responses.delete(state["first"].id)
        gone = await http.get(f"/responses/{state['first'].id}")
        again = await http.delete(f"/responses/{state['first'].id}")
        chained = await http.post("/responses", json={"input": "more", "previous_response_id": state["first"].id})
        return gone, again, chained

    async def unstored(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
        made = await client.responses.create(model="m", input="hi", store=False)
        return made, await http.get(f"/responses/{made.id}")

    reply = ["Let me look.\n", CALL, "\n", CALL2]
    (made, _, stored, (gone, again, chained), (made2, unknown)), seen = _run(
        tiny_dir, reply, [first, second, read, delete, unstored])
    assert stored.model_dump() == made.model_dump()
    # the second request is HISTORY with the first reply's calls' ids (fresh ones)
    ids = [o.call_id for o in made.output if o.type == "function_call"]
    history = json.loads(json.dumps(HISTORY))
    for call, new in zip(history[2]["tool_calls"], ids, strict=True):
        call["id"] = new
    for turn, new in zip(history[3:], ids, strict=True):
        turn["tool_call_id"] = new
    assert [(m.role, m.content or "".join(p.text for p in m.parts)) for m in seen[1].messages] == [
        (m["role"], m["content"]) for m in history]
    assert [c.id for c in seen[1].messages[2].tool_calls] == ids
    assert [m.tool_call_id for m in seen[1].messages[3:]] == ids
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"
    assert again.status_code == 404
    assert chained.status_code == 400 and chained.json()["error"]["param"] == "previous_response_id"
    assert made2.store is False and unknown.status_code == 404
    assert len(seen) == 2 + 1  # (the chain that named a deleted response never ran)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
    ({"input": "hi", "tool_choice": "required", "tools": FLAT}, "tool_choice"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "get_time"}, "tools": FLAT}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "include": ["everything"]}, "include[0]"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input[0].content[0].file_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                              {"type": "input_image", "image_url": "data:image/png;base64,!!"}]}]},
     "input[0].content[1].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": 5}}]}]},
     "input[0].content[0].input_audio.data"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "x\"}", "arguments": "{}"}]}, "input[0].name"),
    ({"input": []}, "input"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": "1"}, "temperature"),
    ({"input": "hi", "model": "other"}, "model"),
])  # fmt: skip
def test_what_cannot_be_honoured_is_a_400_naming_the_field(tiny_dir: Path, body: dict[str, Any], param: str) -> None:
    async def post(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
        return await http.post("/responses", json=body)

    (got,), seen = _run(tiny_dir, ["x"], [post])
    assert got.status_code == (404 if param == "model" else 400), got.text
    error = got.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    assert not seen  # refused before the thinker


def test_a_refusal_of_a_message_names_the_item_it_came_from(tiny_dir: Path) -> None:
    """The chat door's refusals name `messages[i]`; here that is the input item (or the
    instructions, or the chained response) the message came from."""
    huge = "word " * 40_000
    bad_audio = base64.b64encode(b"not audio").decode()

    def post(body: dict[str, Any]) -> Any:
        async def call(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
            return await http.post("/responses", json=body)

        return call

    (long, audio), _ = _run(tiny_dir, ["x"], [
        post({"instructions": "hi", "input": huge}),
        post({"instructions": "hi", "input": [
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": bad_audio}}]}]}),
    ])  # fmt: skip
    assert long.status_code == 400 and long.json()["error"]["param"] == "input", long.text
    assert audio.status_code == 400, audio.text
    assert audio.json()["error"]["param"].startswith("input[1].content[0]"), audio.text


def test_a_failure_once_streaming_is_response_failed(tiny_dir: Path) -> None:
    from gateway.app import build_app
    from gateway.server import GatewayError
    from omnistage.server.grpc_common import Code

    async def go() -> list[Any]:
        service, _ = served_gateway(tiny_dir, ["Hello ", "there"])
        outputs = service._outputs

        async def failing(*args: Any) -> Any:
            async for out in outputs(*args):
                yield out
                raise GatewayError(Code.UNAVAILABLE, "thinker: replica lost")

        service._outputs = failing  # type: ignore[method-assign]
        transport = httpx.ASGITransport(app=build_app(service))
        async with (httpx.AsyncClient(transport=transport, base_url="http://gateway/v1") as http,
                    http.stream("POST", "/responses", json={"input": "hi", "stream": True}) as r):  # fmt: skip
            assert r.status_code == 200
            return [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: ")]

    events = asyncio.run(go())
    for e in events:
        EVENTS.validate_python(e)
    assert events[-1]["type"] == "response.failed"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "replica lost" in failed["error"]["message"]
    assert any(e["type"] == "response.output_text.delta" for e in events)


def test_the_store_is_bounded_by_count_bytes_and_age() -> None:
    now = [0.0]
    store = ResponseStore(ttl_s=10, capacity=3, max_bytes=2000, clock=lambda: now[0])

    def put(i: int, size: int = 10) -> None:
        store.put({"id": f"r{i}"}, [{"role": "user", "content": "x" * size}])

    for i in range(4):
        put(i)
    assert store.response("r0") is None and store.turns("r3") == [{"role": "user", "content": "x" * 10}]
    put(4, 1500)
    assert store.response("r4") is not None and store.response("r1") is None and store.bytes <= 2000
    put(5, 5000)  # larger than the whole store: not kept, pushes nothing out
    assert store.response("r5") is None and store.response("r4") is not None
    now[0] = 11
    assert store.response("r4") is None and store.turns("r3") is None
    assert store.delete("r3") is False


def test_to_chat_merges_a_call_into_the_words_before_it_only() -> None:
    """A call joins the assistant message right before it (its words: one turn); after a user
    or tool turn it is an assistant turn of its own; a chained response's turns are copied, not
    changed, when a call joins their last."""
    body = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "a"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "r"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"}]})  # fmt: skip
    chat = to_chat(body)
    assert [(m.role, len(m.tool_calls or ())) for m in chat.request.messages] == [
        ("user", 0), ("assistant", 1), ("tool", 0), ("assistant", 1)]
    stored = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "words"}]
    chained = to_chat(ResponsesRequest.model_validate({"previous_response_id": "r", "input": [
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"}]}), lambda _id: stored)  # fmt: skip
    assert [len(m.tool_calls or ()) for m in chained.request.messages] == [0, 1]
    assert stored[1] == {"role": "assistant", "content": "words"}
    assert chained.origins == ["previous_response_id", "previous_response_id"]


@pytest.mark.parametrize("limit", [{"parallel_tool_calls": False}, {"max_tool_calls": 1}, {}])
def test_a_reply_gives_as_many_calls_as_asked(tiny_dir: Path, limit: dict[str, Any]) -> None:
    """`parallel_tool_calls: false` or `max_tool_calls: 1` give a reply's first call alone,
    streamed or not; by default every call."""
    kw = {"input": "hi", "tools": FLAT, **limit}
    (whole, (events, final)), _ = _run(tiny_dir, [CALL, "\n", CALL2], [_whole(**kw), _stream(**kw)])
    names = ["get_weather"] if limit else ["get_weather", "get_time"]
    assert [o.name for o in whole.output] == names  # type: ignore[union-attr]
    assert _shape(final) == _shape(whole)
    assert [e.name for e in events if e.type == "response.function_call_arguments.done"] == names
