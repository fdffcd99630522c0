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


def _run(tiny_dir: Path, reply: list[str], calls: list[Any], finish: str = "stop", logprobs: bool = False,
         setup: Any = None) -> tuple[list[Any], list[Any]]:  # fmt: skip
    """Each `call(client, http)` in turn (OpenAI's SDK, and plain httpx) on one gateway that
    answers `reply` every time; what they gave, and the gateway requests made."""
    from gateway.app import build_app

    async def go() -> tuple[list[Any], list[Any]]:
        service, seen = served_gateway(tiny_dir, reply, finish, logprobs)
        if setup is not None:
            setup(service)
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
    """Streamed, every event is one of the SDK's types, in order (numbered from 0), the SDK's
    accumulation of them is the response the last event carries, and that is the whole
    (non-streamed) response: the same message, calls and status."""
    (streamed, whole), _ = _run(tiny_dir, reply, [_stream(input="hi", tools=FLAT), _whole(input="hi", tools=FLAT)])
    events, final = streamed
    raw = [e.model_dump(warnings=False) for e in events]
    for e in raw:
        EVENTS.validate_python(e)
    assert [e["sequence_number"] for e in raw] == list(range(len(raw)))  # (from 0, as OpenAI's)
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
        replayed = await http.get(f"/responses/{state['first'].id}?stream=true")  # (its events are not kept)
        assert replayed.status_code == 400 and replayed.json()["error"]["param"] == "stream", replayed.text
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
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].id"),
    ({"input": [{"type": "item_reference"}]}, "input[0].id"),
    ({}, "input"),
    ({"input": None}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": "a"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}]},
     "input[2].output[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "r"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": "a"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}, "input"),
    ({"input": [{"role": "user", "content": "a"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "r"},
                {"type": "function_call_output", "call_id": "c", "output": "r"}]}, "input[3].call_id"),
    ({"input": [{"role": "user", "content": "a"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}, "input[2].call_id"),
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

    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    (long, audio, tool_image), _ = _run(tiny_dir, ["x"], [
        post({"instructions": "hi", "input": huge}),
        post({"instructions": "hi", "input": [
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "r"},
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": bad_audio}}]}]}),
        post({"input": [{"role": "user", "content": "a"},
                        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                        {"type": "function_call_output", "call_id": "c", "output": [
                            {"type": "input_text", "text": "x"}, image]}]}),
    ])  # fmt: skip
    assert long.status_code == 400 and long.json()["error"]["param"] == "input", long.text
    assert audio.status_code == 400, audio.text
    assert audio.json()["error"]["param"].startswith("input[2].content[0]"), audio.text
    # a call output's parts are its `output` (the gateway takes media in user turns alone)
    assert tool_image.status_code == 400 and tool_image.json()["error"]["param"] == "input[2].output[1]", \
        tool_image.text


def test_a_failure_once_streaming_is_response_failed(tiny_dir: Path) -> None:
    """A failure once the stream began is its last event, `response.failed`, whose response holds
    what was said before (its message incomplete); it reads back, and cannot be continued. Each
    event's SSE name is its type."""
    from gateway.app import build_app
    from gateway.server import GatewayError
    from omnistage.server.grpc_common import Code

    async def go() -> tuple[list[str], Any, Any]:
        service, _ = served_gateway(tiny_dir, ["Hello ", "there"])
        outputs = service._outputs

        async def failing(*args: Any) -> Any:
            async for out in outputs(*args):
                yield out
                raise GatewayError(Code.UNAVAILABLE, "thinker: replica lost")

        service._outputs = failing  # type: ignore[method-assign]
        transport = httpx.ASGITransport(app=build_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway/v1") as http:
            async with http.stream("POST", "/responses", json={"input": "hi", "stream": True}) as r:
                assert r.status_code == 200
                lines = [line async for line in r.aiter_lines() if line]
            rid = json.loads(lines[-1][6:])["response"]["id"]
            return lines, await http.get(f"/responses/{rid}"), await http.post(
                "/responses", json={"input": "more", "previous_response_id": rid})

    lines, stored, chained = asyncio.run(go())
    names, events = lines[0::2], [json.loads(line[6:]) for line in lines[1::2]]
    assert names == [f"event: {e['type']}" for e in events]
    for e in events:
        EVENTS.validate_python(e)
    assert events[-1]["type"] == "response.failed"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "replica lost" in failed["error"]["message"]
    said = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert said and failed["output"][0]["content"][0]["text"] == said and failed["output"][0]["status"] == "incomplete"
    assert stored.status_code == 200 and stored.json() == failed
    assert chained.status_code == 400 and chained.json()["error"]["param"] == "previous_response_id"


def test_the_store_is_bounded_by_count_bytes_and_age() -> None:
    now = [0.0]
    store = ResponseStore(ttl_s=10, capacity=3, max_bytes=2000, clock=lambda: now[0])

    def put(i: int, size: int = 10) -> None:
        store.put({"id": f"r{i}", "output": [{"id": f"msg{i}"}]}, [{"role": "user", "content": "x" * size}])

    for i in range(4):
        put(i)
    assert store.response("r0") is None and store.turns("r3") == [{"role": "user", "content": "x" * 10}]
    assert store.item("msg0") is None and store.item("msg3") == {"id": "msg3"}  # (an evicted one's items go too)
    put(4, 1500)
    assert store.response("r4") is not None and store.response("r1") is None and store.bytes <= 2000
    put(5, 5000)  # larger than the whole store: not kept, pushes nothing out
    assert store.response("r5") is None and store.response("r4") is not None
    now[0] = 11
    assert store.response("r4") is None and store.turns("r3") is None and store.item("msg2") is None
    assert store.delete("r3") is False


def test_to_chat_merges_a_call_into_the_words_before_it_only() -> None:
    """A call joins the assistant message right before it in the input (its words: one turn);
    after a user or tool turn, or first after the turns of the response it continues, it is an
    assistant turn of its own."""
    body = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "a"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "r"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": "r"}]})  # fmt: skip
    chat = to_chat(body, ResponseStore())
    assert [(m.role, len(m.tool_calls or ())) for m in chat.request.messages] == [
        ("user", 0), ("assistant", 1), ("tool", 0), ("assistant", 1), ("tool", 0)]
    stored = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "words"}]
    store = ResponseStore()
    store.put({"id": "r", "output": []}, stored)
    chained = to_chat(ResponsesRequest.model_validate({"previous_response_id": "r", "input": [
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c3", "output": "r"}]}), store)  # fmt: skip
    # (a call after the turns it continues is a turn of its own: the stored ones are never changed)
    assert [len(m.tool_calls or ()) for m in chained.request.messages] == [0, 0, 1, 0]
    assert stored[1] == {"role": "assistant", "content": "words"}
    assert [o.where for o in chained.origins] == [*["previous_response_id"] * 2, "input[0]", "input[1]"]


@pytest.mark.parametrize(("limit", "calls"), [({"parallel_tool_calls": False}, 1), ({"max_tool_calls": 1}, 2), ({}, 2)])
def test_a_reply_gives_as_many_calls_as_asked(tiny_dir: Path, limit: dict[str, Any], calls: int) -> None:
    """`parallel_tool_calls: false` gives a reply's first call alone, streamed or not; by default
    every call (`max_tool_calls` bounds built-in tools' calls, of which there are none here)."""
    kw = {"input": "hi", "tools": FLAT, **limit}
    (whole, (events, final)), _ = _run(tiny_dir, [CALL, "\n", CALL2], [_whole(**kw), _stream(**kw)])
    names = ["get_weather", "get_time"][:calls]
    assert [o.name for o in whole.output] == names  # type: ignore[union-attr]
    assert _shape(final) == _shape(whole)
    assert [e.name for e in events if e.type == "response.function_call_arguments.done"] == names


@pytest.mark.parametrize(("reply", "tools", "said"), [
    (REPLY, True, "Let me check."), (REPLY, False, "".join(REPLY)),
    (["Hi.", "\n", CALL, "\nDone."], True, "Hi."),  # (the text after a call has none: it shows at the end)
    (["Hi ", "<|vision_start|>", " there."], True, "Hi <|vision_start|> there."),  # (a special token: not in the text)
])  # fmt: skip
def test_a_messages_logprobs_are_its_texts_tokens_streamed_or_not(tiny_dir: Path, reply: list[str], tools: bool,
                                                                  said: str) -> None:  # fmt: skip
    """With `include: ["message.output_text.logprobs"]`, the message's entries are the tokens of
    its text before any call (not the call's): the same whole, streamed in the deltas, and in the
    done event; their token texts join to that text."""
    kw: dict[str, Any] = {"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 2,
                          **({"tools": FLAT} if tools else {})}  # fmt: skip
    (whole, (events, final)), _ = _run(tiny_dir, reply, [_whole(**kw), _stream(**kw)], logprobs=True)
    entries = [e.model_dump() for e in whole.output[0].content[0].logprobs]
    assert "".join(e["token"] for e in entries) == said and all(len(e["top_logprobs"]) == 2 for e in entries)
    deltas = [lp.model_dump() for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = [lp.model_dump() for e in events if e.type == "response.output_text.done" for lp in e.logprobs]
    assert [e["token"] for e in deltas] == [e["token"] for e in done] == [e["token"] for e in entries]
    assert [e["logprob"] for e in deltas] == [e["logprob"] for e in entries]
    assert [e.model_dump() for e in final.output[0].content[0].logprobs] == entries


def test_an_item_reference_stands_for_a_stored_output_item(tiny_dir: Path) -> None:
    """An `item_reference` to a stored response's message or call (as the Vercel AI SDK sends an
    earlier turn back) is that item: the same gateway request as sending the items themselves."""
    state: dict[str, Any] = {}

    async def first(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
        state["made"] = await client.responses.create(model="m", input="Weather?", tools=FLAT)  # type: ignore[arg-type]
        return state["made"]

    def follow(by_reference: bool, typed: bool = True, twice: bool = False, chained: bool = False) -> Any:
        async def call(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
            made = state["made"]
            ref = {"type": "item_reference"} if typed else {}  # (its type may be left out)
            items = [{**ref, "id": o.id} if by_reference else o.model_dump(exclude_none=True) for o in made.output]
            calls = [o for o in made.output if o.type == "function_call"]
            outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "ok"} for c in calls]
            again = [items[0]] if twice else []
            body = {"input": [{"role": "user", "content": "Weather?"}, *items, *again, *outputs], "tools": FLAT,
                    **({"previous_response_id": made.id} if chained else {})}  # fmt: skip
            return await http.post("/responses", json=body)

        return call

    (made, by_items, by_refs, untyped, twice, chained), seen = _run(tiny_dir, REPLY, [
        first, follow(False), follow(True), follow(True, typed=False), follow(True, twice=True),
        follow(True, chained=True)])  # fmt: skip
    assert [o.type for o in made.output] == ["message", "function_call", "function_call"]
    assert by_items.status_code == by_refs.status_code == untyped.status_code == 200, by_refs.text
    assert _same_request(seen[1], seen[2]) and _same_request(seen[1], seen[3])
    # an item is in a conversation once (as OpenAI's): not twice, nor besides the response holding it
    assert twice.status_code == 400 and twice.json()["error"]["param"] == "input[4].id", twice.text
    assert chained.status_code == 400 and chained.json()["error"]["param"] == "input[1].id", chained.text
    assert len(seen) == 4
    assert [m.role for m in seen[2].messages] == ["user", "assistant", "tool", "tool"]
    assert len(seen[2].messages[1].tool_calls) == 2


def test_a_stored_chain_keeps_each_turn_once_and_its_links_while_used() -> None:
    """A chain's turns are its links' own turns, each stored once; using a chain keeps its links
    (least recently used go first, and the hour counts from the last use); a chain whose link is
    gone, or that ends at a failed response, cannot be continued."""
    now = [0.0]
    store = ResponseStore(ttl_s=10, capacity=3, clock=lambda: now[0])

    def turn(text: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": text}]

    store.put({"id": "r1", "output": []}, turn("a"))
    store.put({"id": "r2", "output": []}, turn("b"), parent="r1")
    store.put({"id": "x", "output": []}, turn("x"))
    size = store.bytes
    now[0] = 8
    assert store.turns("r2") == turn("a") + turn("b")  # (used: r1 and r2 are the most recent now)
    store.put({"id": "r3", "output": []}, turn("c"), parent="r2")  # over capacity: x goes, not r1
    assert store.response("x") is None and store.turns("r3") == turn("a") + turn("b") + turn("c")
    assert store.bytes == size - store_size(turn("x"), "x") + store_size(turn("c"), "r3")
    now[0] = 17  # 9 s after the chain's last use, 17 after r1 was made: kept
    assert store.turns("r3") is not None
    store.delete("r1")
    assert store.turns("r3") is None and store.response("r3") is not None  # (a broken chain reads back still)
    store.put({"id": "f", "output": [{"id": "msg_f"}]}, None)  # failed
    assert store.response("f") is not None and store.turns("f") is None and store.item("msg_f") is None
    # an item referred to counts as its response's use; a response made counts as its chain's
    used = ResponseStore(ttl_s=10, capacity=2, clock=lambda: now[0])
    used.put({"id": "a", "output": [{"id": "msg_a"}]}, turn("a"))
    used.put({"id": "b", "output": []}, turn("b"))
    assert used.item("msg_a") == {"id": "msg_a"}
    used.put({"id": "c", "output": []}, turn("c"))
    assert used.response("b") is None and used.response("a") is not None
    now[0] = 20
    used.put({"id": "d", "output": []}, turn("d"), parent="a")
    now[0] = 28  # (a was made at 17, its hour over at 27; continued at 20: kept until 30)
    assert used.turns("d") == turn("a") + turn("d")


def store_size(turns: list[dict[str, Any]], response_id: str) -> int:
    other = ResponseStore()
    other.put({"id": response_id, "output": []}, turns)
    return other.bytes


def test_a_chain_over_the_request_size_limit_is_refused(tiny_dir: Path) -> None:
    """Chained turns count against media.max_request_bytes as one request's would: a chain cannot
    grow a conversation past what one body may hold."""
    import io
    import wave

    state: dict[str, Any] = {}
    wav = io.BytesIO()
    with wave.open(wav, "wb") as w:  # a second of silence: 32 KB, 43 KB as base64
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16_000), w.writeframes(b"\0\0" * 16_000)
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav.getvalue()).decode()}}

    def setup(service: Any) -> None:  # (a body of 91 KB of base64 at most: two turns' audio, not three)
        service.cfg.media.max_request_bytes = 64 * 1024

    async def turn(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
        body = {"input": [{"role": "user", "content": [audio]}],
                **({"previous_response_id": state["id"]} if "id" in state else {})}  # fmt: skip
        got = await http.post("/responses", json=body)
        if got.status_code == 200:
            state["id"] = got.json()["id"]
        return got

    (one, two, three), seen = _run(tiny_dir, ["ok"], [turn, turn, turn], setup=setup)
    assert one.status_code == two.status_code == 200, two.text
    assert three.status_code == 400 and three.json()["error"]["param"] == "previous_response_id", three.text
    assert len(seen) == 2


def test_a_thinker_refusal_names_the_bodys_fields() -> None:
    """A stage's refusal of what chat calls `max_tokens` (its message too), or of a message's part,
    names this body's field."""
    import grpc

    from gateway.http_api import from_gateway_error
    from gateway.responses_api import Origin, in_body_terms
    from gateway.server import GatewayError

    origins = [Origin("instructions"), Origin("input[0]"), Origin("input[2]", "output")]
    e = in_body_terms(from_gateway_error(GatewayError(
        grpc.StatusCode.INVALID_ARGUMENT, "thinker: sampling: max_tokens 1000000 exceeds this stage's limit 2048")),
        origins)  # fmt: skip
    assert e.param == "max_output_tokens" and "max_tokens" not in e.message and "max_output_tokens 1000000" in e.message
    e = in_body_terms(from_gateway_error(GatewayError(
        grpc.StatusCode.INVALID_ARGUMENT, "messages[2].parts[1] (image): not an image")), origins)  # fmt: skip
    assert e.param == "input[2].output[1]" and e.message.startswith("input[2].output[1]"), (e.param, e.message)


def test_a_stream_its_client_leaves_is_a_cancelled_response(tiny_dir: Path) -> None:
    """A client that goes away mid-stream cancels its request; the response it was told of
    (`response.created`) reads back as cancelled, with what it said before, and cannot be
    continued."""
    from gateway.app import build_app

    async def go() -> tuple[list[dict[str, Any]], Any, Any, int]:
        service, _ = served_gateway(tiny_dir, ["Hello ", "there"])
        outputs = service._outputs
        stopped = asyncio.Event()

        async def hanging(*args: Any) -> Any:  # the first piece, then nothing until cancelled
            async for out in outputs(*args):
                yield out
                try:
                    await asyncio.Event().wait()
                finally:
                    stopped.set()

        service._outputs = hanging  # type: ignore[method-assign]
        app = build_app(service)
        body = json.dumps({"input": "hi", "stream": True}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/responses", "raw_path": b"/v1/responses", "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"gateway")],
                 "client": ("127.0.0.1", 1), "server": ("gateway", 80)}  # fmt: skip
        sent: list[bytes] = []
        gone = asyncio.Event()
        asked = False

        async def receive() -> dict[str, Any]:
            nonlocal asked
            if not asked:
                asked = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message.get("body", b""))
            if b"response.output_text.delta" in message.get("body", b""):
                gone.set()  # the first words came: the client leaves

        await asyncio.wait_for(app(scope, receive, send), 30)
        await asyncio.wait_for(stopped.wait(), 30)  # (the thinker's call was cancelled)
        events = [json.loads(line[6:]) for line in b"".join(sent).decode().splitlines() if line.startswith("data: ")]
        rid = events[0]["response"]["id"]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway/v1") as http:
            stored = await http.get(f"/responses/{rid}")
            chained = await http.post("/responses", json={"input": "more", "previous_response_id": rid})
        return events, stored, chained, len(events)

    events, stored, chained, _ = asyncio.run(go())
    said = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert said and not any(e["type"].startswith("response.completed") for e in events)
    assert stored.status_code == 200, stored.text
    response = stored.json()
    SdkResponse.model_validate(response)
    assert response["status"] == "cancelled" and response["output"][0]["content"][0]["text"] == said
    assert response["output"][0]["status"] == "incomplete"
    assert chained.status_code == 400 and chained.json()["error"]["param"] == "previous_response_id"


def test_logprobs_go_with_the_text_where_their_token_starts() -> None:
    """`_Scores` gives a token's entry once the text shown reaches where the token starts: one
    that runs past the text before a call (Qwen's `.\n\n`) counts; a special token, which the text
    leaves out, goes with the text after it, and none at the very end."""
    from gateway.responses_api import _Scores

    def entries(*shows: int) -> list[tuple[dict[str, Any], int]]:
        return [({"token": str(i)}, n) for i, n in enumerate(shows)]

    aligned = _Scores()
    aligned.add(entries(1, 1, 3, 4))  # "a", "b", ".\n\n", then the call
    assert [e["token"] for e in aligned.upto(3)] == ["0", "1", "2"] and aligned.upto(3) == []
    aligned = _Scores()
    aligned.add(entries(3, 0, 6, 0))  # "Hi ", <special>, " there", <special>
    assert [e["token"] for e in aligned.upto(3)] == ["0"]
    assert [e["token"] for e in aligned.upto(9)] == ["1", "2"] and aligned.upto(9) == []


def test_items_referred_to_count_against_the_request_size_limit(tiny_dir: Path) -> None:
    """An item_reference brings its stored item's bytes along: a small body naming big stored
    items is held to media.max_request_bytes as if it held them (each item once)."""
    state: dict[str, Any] = {}

    def setup(service: Any) -> None:  # (91 KB of body at most)
        service.cfg.media.max_request_bytes = 64 * 1024

    async def first(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
        state["made"] = (await http.post("/responses", json={"input": "hi"})).json()
        return state["made"]

    def follow(refer: bool) -> Any:
        async def call(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
            ref = [{"type": "item_reference", "id": state["made"]["output"][0]["id"]}] if refer else []
            return await http.post("/responses", json={"input": [{"role": "user", "content": "y" * 45_000}, *ref]})

        return call

    (made, referring, alone), _ = _run(tiny_dir, ["word " * 10_000], [first, follow(True), follow(False)],
                                       setup=setup)  # fmt: skip
    assert len(made["output"][0]["content"][0]["text"]) == 50_000
    assert referring.status_code == 400 and referring.json()["error"]["param"] == "input", referring.text
    assert "media.max_request_bytes" in referring.json()["error"]["message"]
    assert "media.max_request_bytes" not in alone.text  # (its own fate: the prompt's length)


def test_allowed_tools_show_the_model_those_it_may_call(tiny_dir: Path) -> None:
    """`tool_choice: allowed_tools` in mode auto, at both doors: the model is shown the tools it
    may call alone (there is no constrained decoding to keep it from the others); mode required,
    or a name not among `tools`, is a 400 naming it."""

    def post(path: str, body: dict[str, Any]) -> Any:
        async def call(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
            return await http.post(path, json=body)

        return call

    turn = [{"role": "user", "content": "Weather?"}]
    chat_choice = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "get_weather"}}]}}  # fmt: skip
    flat_choice = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "get_weather"}]}
    calls = [
        post("/chat/completions", {"messages": turn, "tools": [WEATHER, TIME], "tool_choice": chat_choice}),
        post("/responses", {"input": turn, "tools": FLAT, "tool_choice": flat_choice}),
        post("/responses", {"input": turn, "tools": FLAT}),
        post("/chat/completions", {"messages": turn, "tools": [WEATHER, TIME], "tool_choice": {
            "type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": []}}}),
        post("/responses", {"input": turn, "tools": FLAT, "tool_choice": {**flat_choice, "mode": "required"}}),
        post("/responses", {"input": turn, "tools": FLAT, "tool_choice": {**flat_choice, "tools": [
            {"type": "function", "name": "get_weather"}, {"type": "function", "name": "nope"}]}}),
    ]  # fmt: skip
    nested = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}
    calls += [  # malformed: each a 400 naming it (a function given as a string was a 500)
        post("/chat/completions", {"messages": turn, "tools": [WEATHER, TIME], "tool_choice": {**nested,
              "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": "get_weather"}]}}}),
        post("/chat/completions", {"messages": turn, "tools": [WEATHER, TIME], "tool_choice": {**nested,
              "allowed_tools": {"tools": []}}}),
        post("/responses", {"input": turn, "tools": FLAT, "tool_choice": {**flat_choice, "tools": [
            {"type": "custom", "name": "get_weather"}]}}),
    ]  # fmt: skip
    (chat, flat, every, required, flat_required, unknown, as_string, no_mode, custom), seen = _run(
        tiny_dir, ["Sunny."], calls)
    assert chat.status_code == flat.status_code == every.status_code == 200, flat.text
    assert [json.loads(t)["function"]["name"] for t in seen[0].tools] == ["get_weather"]
    assert list(seen[1].tools) == list(seen[0].tools) and len(seen[2].tools) == 2
    assert required.json()["error"]["param"] == "tool_choice.allowed_tools.mode", required.text
    assert flat_required.json()["error"]["param"] == "tool_choice.mode", flat_required.text
    assert unknown.json()["error"]["param"] == "tool_choice.tools[1]", unknown.text
    assert as_string.status_code == 400 and as_string.json()["error"]["param"] == "tool_choice.allowed_tools.tools[0]"
    assert no_mode.status_code == 400 and no_mode.json()["error"]["param"] == "tool_choice.allowed_tools"
    assert custom.status_code == 400 and custom.json()["error"]["param"] == "tool_choice.tools[0]", custom.text
    assert len(seen) == 3


@pytest.mark.parametrize("door", ["chat", "responses"])
def test_a_reply_that_calls_a_tool_it_was_not_allowed_calls_nothing(tiny_dir: Path, door: str) -> None:
    """With `allowed_tools`, a reply that calls another tool (earlier turns may show it) calls
    nothing: its whole text is its content, streamed or not, as a reply whose block does not read."""
    turn = [{"role": "user", "content": "Time?"}]
    if door == "chat":
        choice = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
            {"type": "function", "function": {"name": "get_weather"}}]}}  # fmt: skip

        async def whole(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
            reply = await client.chat.completions.create(model="m", messages=turn, tools=[WEATHER, TIME],  # type: ignore[arg-type]
                                                         tool_choice=choice)  # type: ignore[arg-type]  # fmt: skip
            return reply.choices[0].message.content, reply.choices[0].message.tool_calls

        async def streamed(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
            chunks = [c async for c in await client.chat.completions.create(
                model="m", messages=turn, tools=[WEATHER, TIME], tool_choice=choice, stream=True)]  # type: ignore[arg-type,call-overload]  # fmt: skip
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return content, [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()] or None
    else:
        choice = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "get_weather"}]}

        async def whole(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
            made = await client.responses.create(model="m", input=turn, tools=FLAT, tool_choice=choice)  # type: ignore[arg-type]
            return made.output_text, [o for o in made.output if o.type == "function_call"] or None

        async def streamed(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
            _, final = await _stream(input=turn, tools=FLAT, tool_choice=choice)(client, http)
            return final.output_text, [o for o in final.output if o.type == "function_call"] or None

    (got, got_streamed), _ = _run(tiny_dir, ["Let me see.\n", CALL2], [whole, streamed])
    assert got == got_streamed == ("Let me see.\n" + CALL2, None)


def test_media_in_a_responses_input_is_the_chat_doors_media(tiny_dir: Path) -> None:
    """An image and a sound in a Responses message reach the thinker as the chat door's same
    parts do (the same gateway request, so the same prompt and media: the chat door's parity with
    generate() for each modality covers them)."""
    import io
    import wave

    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (32, 32), (20, 120, 200)).save(png, format="PNG")
    image_url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    wav = io.BytesIO()
    with wave.open(wav, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16_000), w.writeframes(b"\1\0" * 8_000)
    sound = base64.b64encode(wav.getvalue()).decode()

    async def chat(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
        return await http.post("/chat/completions", json={"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": image_url}},
            {"type": "input_audio", "input_audio": {"data": sound, "format": "wav"}}]}], "temperature": 0})  # fmt: skip

    async def responses(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
        return await client.responses.create(model="m", temperature=0, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": image_url,
                                                             "detail": "auto"},
            {"type": "input_audio", "input_audio": {"data": sound, "format": "wav"}}]}])  # type: ignore[list-item,misc]  # fmt: skip

    (chat_reply, made), seen = _run(tiny_dir, ["A blue square."], [chat, responses])
    assert chat_reply.status_code == 200 and made.output_text == "A blue square."
    assert [p.WhichOneof("kind") for p in seen[1].messages[0].parts] == ["text", "image", "audio"]
    assert _same_request(seen[0], seen[1])
    service = _service(tiny_dir)
    assert service._prompt(seen[1]).ids == service._prompt(seen[0]).ids


def test_a_response_echoes_the_sampling_its_reply_is_drawn_with(tiny_dir: Path) -> None:
    """`temperature` and `top_p` echo what the reply is drawn with, as OpenAI's do: the request's,
    else the checkpoint's defaults; greedy (temperature 0, or a greedy default) is 0 and 1. They
    were the request's alone, null when it left them out."""
    import dataclasses

    def asks(**sampling: Any) -> Any:
        async def call(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> Any:
            r = await client.responses.create(model="m", input="hi", **sampling)
            return r.temperature, r.top_p

        return call

    calls = [asks(), asks(temperature=0), asks(temperature=0.5, top_p=0.9), asks(temperature=0.5), asks(top_p=0.5)]

    def sampled(service: Any) -> None:
        service.thinker_defaults = dataclasses.replace(service.thinker_defaults, do_sample=True, temperature=0.7,
                                                       top_p=0.8)  # fmt: skip

    got, _ = _run(tiny_dir, ["Hello"], calls, setup=sampled)
    assert got == [(0.7, 0.8), (0.0, 1.0), (0.5, 0.9), (0.5, 0.8), (0.7, 0.5)]

    def greedy(service: Any) -> None:
        service.thinker_defaults = dataclasses.replace(service.thinker_defaults, do_sample=False)

    got, _ = _run(tiny_dir, ["Hello"], calls[:3], setup=greedy)
    assert got == [(0.0, 1.0), (0.0, 1.0), (0.5, 0.9)]
