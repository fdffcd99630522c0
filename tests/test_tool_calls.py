"""Tool calling: the tools and earlier calls rendered as transformers renders them, the calls read
out of a reply (whole and streamed alike), OpenAI's shapes through its own SDK, the refusals."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
import torch
from openai.lib.streaming.chat import ChatCompletionStreamState

from gateway.server import MAX_CHARS_PER_TOKEN, GatewayService
from gateway.tool_calls import Call, CallStream, parse, read_tools
from omnistage.config import parse_config
from omnistage.models import SamplingParams, open_checkpoint
from omnistage.models.checkpoint import chat_template
from omnistage.v1 import gateway_pb2
from services import edges

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
]  # fmt: skip


# ---- reading a reply ------------------------------------------------------------------------

PARSED: list[tuple[str, str | None, list[Call]]] = [
    ("Hello there.", "Hello there.", []),
    ("", "", []),
    (CALL, None, [Call("get_weather", '{"city": "Paris"}')]),
    ("Let me check.\n\n" + CALL, "Let me check.", [Call("get_weather", '{"city": "Paris"}')]),
    (CALL + "\n" + CALL2, None, [Call("get_weather", '{"city": "Paris"}'), Call("get_time", "{}")]),
    (CALL + "\nDone.", "Done.", [Call("get_weather", '{"city": "Paris"}')]),
    ("Hi " + CALL + " then " + CALL2 + " end", "Hi\nthen\nend",
     [Call("get_weather", '{"city": "Paris"}'), Call("get_time", "{}")]),
    # arguments given as text (an object's), or under Qwen's other key
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [Call("f", '{"a": 1}')]),
    ('<tool_call>{"name": "f", "parameters": {"a": "é"}}</tool_call>', None, [Call("f", '{"a": "é"}')]),
    ('<tool_call>{"name": "f"}</tool_call>', None, [Call("f", "{}")]),
    ('<tool_call>{"name": "f", "arguments": null}</tool_call>', None, [Call("f", "{}")]),
    # an argument's text may hold CLOSE: the block ends where it reads as a call
    ('<tool_call>{"name": "f", "arguments": {"s": "a</tool_call>b"}}</tool_call> ok', "ok",
     [Call("f", '{"s": "a</tool_call>b"}')]),
    # what reads as no call leaves the whole text as the content
    ("Look: " + CALL[:-3], "Look: " + CALL[:-3], []),  # unclosed (the reply ran out)
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     []),
    ('<tool_call>{"name": "f", "arguments": "1"}</tool_call>', '<tool_call>{"name": "f", "arguments": "1"}</tool_call>',
     []),
    (CALL + "<tool_call>[]</tool_call>", CALL + "<tool_call>[]</tool_call>", []),  # one bad block: none
    # not JSON as JSON is (Python's parser takes NaN), or text no UTF-8 holds (half a UTF-16 pair)
    ('<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": Infinity}"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "{\\"a\\": Infinity}"}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": {"a": "\\ud83d"}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"a": "\\ud83d"}}</tool_call>', []),
    ('<tool_call>{"name": "\\udc00", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "\\udc00", "arguments": {}}</tool_call>', []),
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "calls"), PARSED)
def test_a_reply_reads_as_its_content_and_calls(text: str, content: str | None, calls: list[Call]) -> None:
    assert parse(text) == (content, calls)


@pytest.mark.parametrize("text", [case[0] for case in PARSED] + ["a <tool", "<tool_cal", "x  \n", "a < b <tool_x"])
def test_a_streamed_reply_reads_as_the_whole_at_every_split(text: str) -> None:
    """Fed in pieces cut anywhere (two cuts, and one character at a time), the content shown
    as it streams and at its end is the whole reply's, and no text from a call's start on shows
    before the end."""
    content, calls = parse(text)
    cuts = [(i, j) for i in range(len(text) + 1) for j in range(i, len(text) + 1, 7)]
    for pieces in [[text[:i], text[i:j], text[j:]] for i, j in cuts] + [list(text)]:
        stream = CallStream()
        shown = [stream.feed(p) for p in pieces]
        if "<tool_call>" in text:
            assert "<" not in "".join(shown)[text.find("<tool_call>") :], pieces
        rest, got = stream.finish()
        assert ("".join(shown) + rest, got) == (content or "", calls), pieces


def test_a_call_outside_the_names_allowed_calls_nothing() -> None:
    """`names` (allowed_tools): a reply that calls another function calls nothing, whole or
    streamed; one that calls only those reads as ever."""
    text = "Hi.\n" + CALL + "\n" + CALL2
    assert parse(text, {"get_weather"}) == (text, [])
    assert parse(text, {"get_weather", "get_time"}) == parse(text)
    stream = CallStream()
    shown = "".join(stream.feed(piece) for piece in (text[:5], text[5:40], text[40:]))
    rest, calls = stream.finish({"get_weather"})
    assert (shown + rest, calls) == (text, [])


def test_text_that_cannot_start_a_call_shows_at_once() -> None:
    stream = CallStream()
    assert stream.feed("It is ") == "It is"  # (the space waits: it could stand before a call)
    assert stream.feed("sunny <t") == " sunny"
    assert stream.feed("oo>") == " <too>"
    assert stream.finish() == ("", [])


def test_a_call_in_openai_shape_has_a_fresh_id() -> None:
    a, b = Call("f", "{}").openai(), Call("f", "{}").openai(2)
    assert a["id"] != b["id"] and a["id"].startswith("call_") and b["index"] == 2
    want = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert {k: v for k, v in a.items() if k != "id"} == want


def test_tools_sent_over_grpc_are_checked() -> None:
    assert read_tools([json.dumps(WEATHER)]) == [WEATHER]
    for raw, field in [("{", "tools[0]: not JSON"), ('{"type": "function"}', "tools[0]: expected"),
                       ('{"type": "x", "function": {"name": "f"}}', "tools[0]: expected"),
                       ('{"type": "function", "function": {"name": ""}}', "tools[0].function.name"),
                       ('{"type": "function", "function": {"name": "a b"}}', "tools[0].function.name"),
                       ('{"type": "function", "function": {"name": "f\\n"}}', "tools[0].function.name")]:  # fmt: skip
        with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
            read_tools([raw])


# ---- the prompt -----------------------------------------------------------------------------


def _service(model_dir: Path) -> GatewayService:
    """A gateway over the checkpoint (made inside an event loop: its channel takes the running one)."""

    async def made() -> GatewayService:
        return GatewayService(parse_config({"served_model_name": "m"}), open_checkpoint(model_dir), "ipv4:127.0.0.1:1")

    return asyncio.run(made())


def _request(messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] = (),
             **kw: Any) -> gateway_pb2.GenerateRequest:  # fmt: skip
    req = gateway_pb2.GenerateRequest(tools=[json.dumps(t) for t in tools], **kw)
    for m in messages:
        calls = [gateway_pb2.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
                 for c in m.get("tool_calls", ())]  # fmt: skip
        req.messages.append(gateway_pb2.ChatMessage(role=m["role"], content=m["content"], tool_calls=calls,
                                                    tool_call_id=m.get("tool_call_id", "")))  # fmt: skip
    return req


@pytest.mark.parametrize("case", ["tools", "history", "both", "media"])
def test_the_prompt_is_the_templates_with_tools_as_transformers_renders_it(tiny_dir: Path, case: str) -> None:
    """The ids the thinker gets are apply_chat_template's for the same messages and tools (what a
    transformers user gives generate()): the tools in the system turn, the calls and results of
    earlier turns; with media too (the processor's path)."""
    service = _service(tiny_dir)
    tools = [] if case == "history" else [WEATHER, TIME]
    messages = HISTORY if case in ("history", "both", "media") else HISTORY[:2]
    req = _request(messages, tools)
    want = list(service.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                       tokenize=True, chat_template=chat_template(tiny_dir),
                                                       return_dict=True)["input_ids"])  # fmt: skip
    if case == "media":  # a picture in the user turn: the processor renders it (its placeholder expands)
        import io

        from PIL import Image

        png = io.BytesIO()
        Image.new("RGB", (32, 32), (200, 40, 40)).save(png, format="PNG")
        image = gateway_pb2.ContentPart(image=gateway_pb2.ImagePart(file=png.getvalue()))
        req.messages[1].parts.extend([gateway_pb2.ContentPart(text=messages[1]["content"]), image])
        # the assistant's words as a part (as LangChain sends them): its calls go with them
        req.messages[2].parts.append(gateway_pb2.ContentPart(text=messages[2]["content"]))
        req.messages[2].content = ""
        ids = service._prompt(req).ids
        assert len(ids) > len(want)
        turns = [i for i, t in enumerate(want) if t == service.tokenizer.convert_tokens_to_ids("<|im_start|>")]
        head, tail = turns[1], len(want) - turns[2]  # the tools' system turn; the assistant's turn on
        assert ids[:head] == want[:head] and ids[-tail:] == want[-tail:]
        return
    assert service._prompt(req).ids == want
    assert "get_weather" in service.tokenizer.decode(want) and ("sunny" in service.tokenizer.decode(want)) == (
        case != "tools")


def test_tools_are_refused_where_they_cannot_be_honoured(tiny_dir: Path, q25_dir: Path) -> None:
    """A template that takes no tools (Qwen2.5-Omni's) refuses tools and earlier calls and
    results, naming them; tools with a plain prompt are refused, and with speech where the
    tokenizer has no token a call starts with (the speech could not end there)."""
    q25 = _service(q25_dir)
    with pytest.raises(ValueError, match=r"^tools: this checkpoint's chat template takes no tools"):
        q25._prompt(_request(HISTORY[:2], [WEATHER]))
    with pytest.raises(ValueError, match=r"^messages\[2\]\.tool_calls: this checkpoint's chat template takes no"):
        q25._prompt(_request(HISTORY))
    with pytest.raises(ValueError, match=r"^messages\[1\]: this checkpoint's chat template takes no tools"):
        q25._prompt(_request([HISTORY[1], HISTORY[3]]))
    q3 = _service(tiny_dir)
    q3._prompt(_request(HISTORY[:2], [WEATHER], want_audio=True))
    q3.call_start = None
    with pytest.raises(ValueError, match=r"^tools: with audio, a call must start with one token \(<tool_call>\)"):
        q3._prompt(_request(HISTORY[:2], [WEATHER], want_audio=True))
    q3._prompt(_request(HISTORY[:2], [WEATHER]))
    with pytest.raises(ValueError, match=r"^tools: they go with messages"):
        q3._prompt(gateway_pb2.GenerateRequest(prompt="hi", tools=[json.dumps(WEATHER)]))
    with pytest.raises(ValueError, match=r"^tools\[1\]: not JSON"):
        q3._prompt(gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user", content="hi")],
                                               tools=[json.dumps(WEATHER), "{"]))  # fmt: skip


# ---- the HTTP door, through OpenAI's SDK --------------------------------------------------------


def served_gateway(tiny_dir: Path, reply: list[str], finish: str = "stop",
                   logprobs: bool = False) -> tuple[GatewayService, list[Any]]:  # fmt: skip
    """A gateway (made in the running event loop) whose thinker answers every request with the
    tokens of the text pieces `reply`, a chunk each, then ends it (`finish`: "stop", its stop id;
    "length", its token count), each token with a log-probability and two alternatives where
    `logprobs`; the requests it renders prompts of are collected."""
    service = GatewayService(parse_config({"served_model_name": "m"}), open_checkpoint(tiny_dir), "ipv4:127.0.0.1:1")
    seen: list[Any] = []
    prompt = service._prompt

    def recorded(req: gateway_pb2.GenerateRequest, *args: Any) -> Any:
        seen.append(req)
        return prompt(req, *args)

    chunks = [service.tokenizer.encode(piece, add_special_tokens=False) for piece in reply]
    if finish == "stop":
        chunks.append([service.ckpt.spec.im_end_id])

    async def thinker(messages: Any, *args: Any) -> Any:
        async for first in messages():  # the Start
            service.test_starts.append(first.start)  # type: ignore[attr-defined]
            break
        offset = 0
        for k, ids in enumerate(chunks):
            last = k == len(chunks) - 1
            meta = {edges.FINISH_REASON: "stop_id" if finish == "stop" else "max_tokens"} if last else {}
            tensors = {edges.IDS: torch.tensor(ids)}
            if logprobs:  # (token k's log-probability: -k/100, its alternatives itself and id 0)
                tensors[edges.LOGPROB] = -torch.arange(offset, offset + len(ids), dtype=torch.float32) / 100
                tensors[edges.TOP_IDS] = torch.stack([torch.tensor(ids), torch.zeros(len(ids), dtype=torch.long)])
                tensors[edges.TOP_LOGPROBS] = torch.stack([tensors[edges.LOGPROB], tensors[edges.LOGPROB] - 1])
            yield "thinker", SimpleNamespace(tensors=tensors, meta=meta, offset=offset, length=len(ids),
                                             finished=last)  # fmt: skip
            offset += len(ids)

    service.test_starts = []  # type: ignore[attr-defined]
    service._prompt = recorded  # type: ignore[method-assign]
    service._outputs = thinker  # type: ignore[method-assign]
    return service, seen


def with_sdk(tiny_dir: Path, reply: list[str], call: Any, finish: str = "stop") -> tuple[Any, list[Any]]:
    """`call(client)` with OpenAI's SDK on a gateway that answers `reply` (`served_gateway`)."""
    from gateway.app import build_app

    async def go() -> tuple[Any, list[Any]]:
        service, seen = served_gateway(tiny_dir, reply, finish)
        transport = httpx.ASGITransport(app=build_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway/v1") as http:
            client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="x", http_client=http, max_retries=0)
            return await call(client), seen

    return asyncio.run(go())


REPLY = ["Let me ", "check.\n", "\n<tool", "_call>\n", '{"name": "get_weather", ', '"arguments": {"city": ',
         '"Paris"}}\n</tool_call>\n', CALL2]  # fmt: skip


def test_a_reply_that_calls_tools_reaches_the_sdk_as_tool_calls(tiny_dir: Path) -> None:
    async def call(client: openai.AsyncOpenAI) -> Any:
        return await client.chat.completions.create(model="m", messages=HISTORY[:2], tools=[WEATHER, TIME])  # type: ignore[arg-type]

    got, seen = with_sdk(tiny_dir, REPLY, call)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    assert [json.loads(t) for t in seen[0].tools] == [WEATHER, TIME]


@pytest.mark.parametrize("parallel", [None, False])
def test_a_streamed_reply_that_calls_tools_accumulates_in_the_sdk(tiny_dir: Path, parallel: bool | None) -> None:
    """The SDK's own stream state joins the chunks to the whole reply's message."""
    async def call(client: openai.AsyncOpenAI) -> Any:
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        stream = await client.chat.completions.create(model="m", messages=HISTORY[:2], tools=[WEATHER, TIME],  # type: ignore[arg-type]
                                                      stream=True, **extra)  # fmt: skip
        state = ChatCompletionStreamState()
        chunks = [chunk async for chunk in stream]
        for chunk in chunks:
            state.handle_chunk(chunk)
        return chunks, state.get_final_completion()

    (chunks, whole), _ = with_sdk(tiny_dir, REPLY, call)
    message = whole.choices[0].message
    assert message.content == "Let me check." and whole.choices[0].finish_reason == "tool_calls"
    names = [c.function.name for c in message.tool_calls]
    assert names == (["get_weather"] if parallel is False else ["get_weather", "get_time"])
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}
    shown = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<" not in shown


def test_a_reply_without_calls_is_plain_content(tiny_dir: Path) -> None:
    """With tools offered, a reply that calls none (or writes a block that reads as no call) is
    its text, whole and streamed alike; its finish reason is the thinker's."""
    text = ["Sunny, ", "I think. <tool_call>", "oops"]

    async def call(client: openai.AsyncOpenAI) -> Any:
        whole = await client.chat.completions.create(model="m", messages=HISTORY[:2], tools=[WEATHER])  # type: ignore[arg-type]
        stream = await client.chat.completions.create(model="m", messages=HISTORY[:2], tools=[WEATHER], stream=True)  # type: ignore[arg-type]
        chunks = [c async for c in stream]
        return whole, chunks

    (whole, chunks), _ = with_sdk(tiny_dir, text, call, finish="length")
    assert whole.choices[0].message.content == "".join(text) and not whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "".join(text)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_earlier_calls_and_results_reach_the_gateway_request(tiny_dir: Path) -> None:
    async def call(client: openai.AsyncOpenAI) -> Any:
        return await client.chat.completions.create(model="m", messages=HISTORY, tools=[WEATHER, TIME])  # type: ignore[arg-type]

    got, seen = with_sdk(tiny_dir, ["It is sunny at noon."], call)
    assert got.choices[0].message.content == "It is sunny at noon." and got.choices[0].finish_reason == "stop"
    req = seen[0]
    assert [(c.id, c.name, c.arguments) for c in req.messages[2].tool_calls] == [
        ("call_1", "get_weather", '{"city": "Paris"}'), ("call_2", "get_time", "{}")]
    assert [(m.role, m.tool_call_id, m.content) for m in req.messages[3:]] == [("tool", "call_1", "sunny"),
                                                                              ("tool", "call_2", "noon")]


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [WEATHER], "messages": [{"role": "tool", "content": "sunny"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": HISTORY[2]["tool_calls"]}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}, {"role": "user", "content": "hi"}],
      "tools": [WEATHER], "tool_choice": "none"}, None),  # (taken: tools unread, the result rendered)
])  # fmt: skip
def test_what_cannot_be_honoured_is_a_400_naming_the_field(tiny_dir: Path, body: dict[str, Any],
                                                           param: str | None) -> None:  # fmt: skip
    async def call(client: openai.AsyncOpenAI) -> Any:
        try:
            return await client.chat.completions.create(model="m", **{"messages": HISTORY[:2], **body})
        except openai.BadRequestError as e:
            return e

    got, seen = with_sdk(tiny_dir, ["ok"], call)
    if param is None:
        assert got.choices[0].message.content == "ok" and not seen[0].tools
        return
    assert isinstance(got, openai.BadRequestError), got
    assert got.body["param"] == param, got.body  # type: ignore[index]
    assert seen == [] or param == "tools", seen  # (refused at the door, or by the gateway's prompt)


def test_a_grpc_client_gets_the_raw_reply_and_speech_that_ends_at_a_call(tiny_dir: Path) -> None:
    """Over gRPC the reply's text is as the model wrote it (the client reads its calls); with
    audio, the thinker is told to end the talker's input at a call's first token."""
    async def go() -> tuple[list[Any], list[Any]]:
        service, _ = served_gateway(tiny_dir, [CALL])
        out = [[r async for r in service.serve(_request(HISTORY[:2], [WEATHER], want_audio=audio), None, "grpc")]
               for audio in (False, True)]  # fmt: skip
        out.append([r async for r in service.serve(_request(HISTORY[:2], want_audio=True), None, "grpc")])
        return out, service.test_starts  # type: ignore[attr-defined]

    replies, starts = asyncio.run(go())
    assert all("".join(r.text.text for r in reply if r.WhichOneof("kind") == "text") == CALL for reply in replies)
    start = _service(tiny_dir).tokenizer.convert_tokens_to_ids("<tool_call>")
    assert [list(s.sampling["thinker"].speech_end_ids) for s in starts] == [[], [start], []]


# ---- speech with tools ----------------------------------------------------------------------


@pytest.fixture(scope="module", params=["single", "split"])
def thinker_kind(request: pytest.FixtureRequest, pipeline: Any, tiny_dir: Path) -> Any:
    if request.param == "single":
        return pipeline
    from services.pipeline import InProcessPipeline

    return InProcessPipeline(tiny_dir, parse_config({"thinker": {"disaggregated": True}}))


@pytest.mark.parametrize("lead", ["Let me check the weather.", ""])
def test_the_speech_ends_where_a_call_starts(thinker_kind: Any, lead: str) -> None:
    """With `speech_end_ids` (the gateway's, for tools with audio) the talker's input ends at a
    call's first token: the speech equals that of a reply that ended there (the thinker stopped
    on it) while the text goes on to the call's end; a reply that only calls says what a reply of
    that one token says. Through a split thinker too (the decode role forwards the first token)."""
    from services.pipeline import AudioEvent, PipelineRequest

    pipe = thinker_kind
    tok, eos = pipe.tokenizer, pipe.spec.im_end_id
    start = tok.convert_tokens_to_ids("<tool_call>")
    assert isinstance(start, int) and tok.encode("<tool_call>", add_special_tokens=False) == [start]
    lead_ids = tok.encode(lead, add_special_tokens=False)
    call = tok.encode(CALL, add_special_tokens=False)
    assert call[0] == start and len(call) > 5
    base = pipe.thinker_defaults().with_overrides(max_tokens=80, do_sample=False)

    def run(**thinker: Any) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        req = PipelineRequest(prompt_ids=pipe.prompt_ids("What is the weather in Paris?"),
                              thinker=base.with_overrides(forced_ids=lead_ids + call, **thinker),
                              talker=SamplingParams(max_tokens=200))  # fmt: skip
        events = list(pipe.run(req))
        pcm = torch.cat([e.pcm for e in events if isinstance(e, AudioEvent)] or [torch.zeros(0)])
        return events[-1].token_ids, events[-1].codes, pcm

    gated = run(stop_ids=[eos], speech_end_ids=[start])
    ended = run(stop_ids=[start, eos])
    spoken = run(stop_ids=[eos])
    assert gated[0] == lead_ids + call + [eos] and ended[0] == [*lead_ids, start]
    assert torch.equal(gated[1], ended[1]) and torch.equal(gated[2], ended[2])
    # unended, the talker reads the call on (the tiny talker ends where its own stop code falls)
    assert spoken[1].shape != gated[1].shape or not torch.equal(spoken[1], gated[1])


def test_a_spoken_reply_that_calls_a_tool_has_the_text_before_the_call_as_transcript(tiny_dir: Path) -> None:
    async def call(client: openai.AsyncOpenAI) -> Any:
        return await client.chat.completions.create(model="m", messages=HISTORY[:2], tools=[WEATHER, TIME],  # type: ignore[arg-type]
                                                    modalities=["text", "audio"],
                                                    audio={"voice": "alloy", "format": "wav"})  # fmt: skip

    got, seen = with_sdk(tiny_dir, REPLY, call)
    message = got.choices[0].message
    assert message.audio.transcript == message.content == "Let me check." and len(message.tool_calls) == 2
    assert seen[0].want_audio


def test_a_reply_that_only_calls_has_null_content_and_one_call_where_asked(tiny_dir: Path) -> None:
    async def call(client: openai.AsyncOpenAI) -> Any:
        asks: list[dict[str, Any]] = [{}, {"parallel_tool_calls": False}]
        return [await client.chat.completions.create(model="m", messages=HISTORY[:2], tools=[WEATHER, TIME],  # type: ignore[arg-type]
                                                     **extra) for extra in asks]  # fmt: skip

    (both, first), _ = with_sdk(tiny_dir, [CALL, "\n", CALL2], call)
    assert both.choices[0].message.content is None and first.choices[0].message.content is None
    assert [c.function.name for c in both.choices[0].message.tool_calls] == ["get_weather", "get_time"]
    assert [c.function.name for c in first.choices[0].message.tool_calls] == ["get_weather"]
    assert first.choices[0].finish_reason == "tool_calls"


def test_tools_and_calls_count_towards_the_text_bound_before_tokenizing(tiny_dir: Path) -> None:
    """A prompt whose tools or earlier calls hold more text than could ever fit is refused before
    the template renders it (as a message's own text is)."""
    service = _service(tiny_dir)
    big = "x" * (MAX_CHARS_PER_TOKEN * service.max_prompt_tokens)
    long_tool = {"type": "function", "function": {"name": "f", "description": big}}
    long_call = [{**HISTORY[2], "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": big}}]}]
    for req in (_request(HISTORY[:2], [long_tool]), _request(HISTORY[:2] + long_call)):
        with pytest.raises(ValueError, match=r"^prompt: \d+ characters of text cannot fit"):
            service._prompt(req)


@pytest.mark.parametrize(("reply", "finish"), [(["Let me check. ", CALL, " Anything else?"], "stop"),
                                               (["Sure ", '<tool_call>\n{"name": "get_wea'], "length")])  # fmt: skip
def test_a_spoken_replys_transcript_is_what_it_said(tiny_dir: Path, reply: list[str], finish: str) -> None:
    """The speech ends where the first call starts (whether or not it reads as one): the
    transcript is the words before it, streamed or not; the content is the reply's own."""
    words = reply[0].strip()

    async def call(client: openai.AsyncOpenAI) -> Any:
        asked: dict[str, Any] = {"model": "m", "messages": HISTORY[:2], "tools": [WEATHER],
                                 "modalities": ["text", "audio"],
                                 "audio": {"voice": "alloy", "format": "pcm16"}}  # fmt: skip
        whole = await client.chat.completions.create(**asked)
        stream = await client.chat.completions.create(**asked, stream=True)
        return whole, [c async for c in stream]

    (whole, chunks), _ = with_sdk(tiny_dir, reply, call, finish)
    message = whole.choices[0].message
    assert message.audio.transcript == words
    assert message.content == ("".join(reply) if finish == "length" else words + "\nAnything else?")
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    said = "".join(getattr(d.audio, "transcript", None) or "" for d in deltas if d.audio)
    assert said == words and "".join(d.content or "" for d in deltas) == message.content


def test_a_tool_nested_deeper_than_any_schema_is_refused_at_every_door(tiny_dir: Path) -> None:
    """A tool's JSON nested past MAX_DEPTH is a 400 naming it (it was an internal error: the
    prompt's special-text check recursed), over HTTP and gRPC alike; the check itself walks any
    depth."""
    from gateway.tool_calls import MAX_DEPTH
    from omnistage.models.qwen3_omni.prompt import holds_special_text

    deep: Any = 1
    for _ in range(400):
        deep = {"a": deep}
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    with pytest.raises(ValueError, match=rf"^tools\[0\]: nested more than {MAX_DEPTH} levels deep"):
        read_tools([json.dumps(tool)])
    assert holds_special_text(_service(tiny_dir).tokenizer, {"x": [deep, {"y": "<|im_end|>"}]})

    async def call(client: openai.AsyncOpenAI) -> Any:
        try:
            return await client.chat.completions.create(model="m", messages=HISTORY[:2], tools=[tool])  # type: ignore[list-item]
        except openai.BadRequestError as e:
            return e

    got, seen = with_sdk(tiny_dir, ["ok"], call)
    assert isinstance(got, openai.BadRequestError) and got.body["param"] == "tools[0]" and not seen  # type: ignore[index]


def test_a_streamed_spoken_replys_stored_transcript_is_all_it_said(tiny_dir: Path) -> None:
    """The words held back to the end (trailing spaces, where a call could have begun) are in the
    transcript an audio id names later, as the non-streamed reply's are."""
    async def call(client: openai.AsyncOpenAI) -> Any:
        asked: dict[str, Any] = {"model": "m", "tools": [WEATHER], "modalities": ["text", "audio"],
                                 "audio": {"voice": "alloy", "format": "pcm16"}}  # fmt: skip
        stream = await client.chat.completions.create(messages=HISTORY[:2], stream=True, **asked)
        ids = [c.choices[0].delta.audio.id async for c in stream if c.choices and c.choices[0].delta.audio
               and getattr(c.choices[0].delta.audio, "id", None)]  # fmt: skip
        audio_id = ids[0]
        follow = [*HISTORY[:2], {"role": "assistant", "audio": {"id": audio_id}}, {"role": "user", "content": "More?"}]
        return await client.chat.completions.create(messages=follow, **asked)

    _, seen = with_sdk(tiny_dir, ["It is ", "sunny <tool"], call, finish="length")
    assert seen[-1].messages[2].content == "It is sunny <tool"


@pytest.mark.parametrize("fmt", ["wav", "pcm16"])
def test_a_spoken_reply_that_only_calls_has_no_audio(tiny_dir: Path, fmt: str) -> None:
    """As OpenAI gives it: `audio` null, streamed or not (a whole-file format's empty file was
    sent); a reply with words keeps its audio, and one that calls nothing too."""
    async def call(client: openai.AsyncOpenAI) -> Any:
        asked: dict[str, Any] = {"model": "m", "messages": HISTORY[:2], "tools": [WEATHER],
                                 "modalities": ["text", "audio"],
                                 "audio": {"voice": "alloy", "format": fmt}}  # fmt: skip
        whole = await client.chat.completions.create(**asked)
        stream = await client.chat.completions.create(**asked, stream=True)
        return whole, [c async for c in stream]

    for reply, audible in (([CALL], False), (["Let me check. ", CALL], True), (["Sunny."], True)):
        (whole, chunks), _ = with_sdk(tiny_dir, reply, call)
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert (whole.choices[0].message.audio is not None) == audible, reply
        assert any(d.audio for d in deltas) == audible, reply
        if fmt == "wav" and audible:  # (the file comes whole at the end)
            data = [getattr(d.audio, "data", None) for d in deltas if d.audio]
            assert any(data) and whole.choices[0].message.audio.data
