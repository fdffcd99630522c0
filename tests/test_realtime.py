"""The Realtime WebSocket (gateway/realtime.py) against a scripted gateway service: the events a
client sees, the gateway requests its turns become, refusals that leave the session going, and
cancels and hang-ups that close the request. The real stack, with the official client:
tests/integration/test_http.py::test_realtime_turns_are_the_chat_turns_they_stand_for."""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient, WebSocketDenialResponse
from starlette.websockets import WebSocketDisconnect

from gateway.prompt_fit import PromptFit
from gateway.realtime import realtime_route
from gateway.server import GatewayError
from omnistage.config import parse_config
from omnistage.v1 import gateway_pb2

pytestmark = pytest.mark.timeout(60)  # (a lost event would otherwise wait out the suite's 300 s)

HANG = "hang"  # a script step: the reply waits (for a cancel) here
GATE = "gate"  # a script step: the reply waits for the test to set `service.gate`


def _text(t: str) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(text=gateway_pb2.TextDelta(text=t))


def _audio(data: bytes) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(audio=gateway_pb2.AudioChunk(data=data))


def _final(reason: str = "stop") -> gateway_pb2.GenerateResponse:
    usage = gateway_pb2.Usage(prompt_tokens=7, completion_tokens=2, audio_frames=3)
    return gateway_pb2.GenerateResponse(final=gateway_pb2.Final(finish_reason=reason, usage=usage))


REPLY = [_text("Hel"), _audio(b"\x01\x02\x03"), _text("lo"), _audio(b"\x04"), _final()]


class ScriptedService:
    """What the Realtime route uses of GatewayService; each request's reply is `script`'s."""

    def __init__(self, script: list[Any] = REPLY, api_key: str = "", audio: bool = True, **media: Any) -> None:
        self.cfg = parse_config({"media": media} if media else {})
        self.cfg.audio_output = audio
        self.media_limits = self.cfg.media
        self.model_name, self.sample_rate, self.api_key, self.script = "tiny", 24_000, api_key, script
        self.template_names, self.call_start = frozenset({"messages", "tools"}), 508  # (a template with tools)
        self.ckpt = SimpleNamespace(spec=SimpleNamespace(speakers=["ethan", "chelsie"], default_speaker="ethan"))
        self.requests: list[gateway_pb2.GenerateRequest] = []
        self.closed: list[str] = []
        self.log: list[tuple[str, str]] = []  # ("start" | "end", request id), in order
        self.refusals: list[tuple[str, str]] = []
        self.stall_after: int | None = None  # deliver's sends before the client stops taking them
        self.gate = threading.Event()
        self.max_prompt_tokens = 1023
        self.fits: list[PromptFit | None] = []  # each request's truncation
        self.drop: list[int] = []  # the turns each request's prompt leaves out, in turn (none once empty)

    def check_api_key(self, authorization: str | None) -> bool:
        return not self.api_key or authorization == f"Bearer {self.api_key}"

    def refused(self, api: str, outcome: str, message: str, seconds: float = 0.0, request_id: str = "") -> None:
        self.refusals.append((api, outcome))

    async def serve(self, req: gateway_pb2.GenerateRequest, timeout: float | None, api: str,
                    fit: PromptFit | None = None) -> AsyncIterator[gateway_pb2.GenerateResponse]:  # fmt: skip
        assert api == "realtime"
        self.requests.append(req)
        self.fits.append(fit)
        if fit is not None and self.drop:  # as the gateway's prompt build leaves turns out
            fit.dropped = self.drop.pop(0)
        self.log.append(("start", req.request_id))
        try:
            for step in self.script:
                if step == HANG:
                    await asyncio.sleep(60)
                elif step == GATE:
                    while not self.gate.is_set():
                        await asyncio.sleep(0.005)
                elif isinstance(step, Exception):
                    raise step
                else:
                    yield step
        finally:
            self.closed.append(req.request_id)
            self.log.append(("end", req.request_id))

    async def deliver(self, write: Any, replies: Any, request_id: str) -> None:
        if self.stall_after is not None and self.stall_after <= 0:  # as GatewayService.deliver at its stall timeout
            write.close()
            raise GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, "gateway: the client took nothing more")
        if self.stall_after is not None:
            self.stall_after -= 1
        await write


@pytest.fixture
def connect() -> Iterator[Callable[..., Any]]:
    clients: list[TestClient] = []

    def open_(service: ScriptedService, path: str = "/v1/realtime", **kw: Any) -> Any:
        client = TestClient(Starlette(routes=[realtime_route(service)]))  # type: ignore[arg-type]
        client.__enter__()  # one event loop for the test: the app's tasks outlive a socket closed in it
        clients.append(client)
        return client.websocket_connect(path, **kw)

    yield open_
    for c in clients:
        c.__exit__(None, None, None)


def _until(ws: Any, kind: str, limit: int = 200) -> list[dict[str, Any]]:
    """Events up to and including the first of `kind`."""
    events = []
    for _ in range(limit):
        events.append(ws.receive_json())
        if events[-1]["type"] == kind:
            return events
    raise AssertionError(f"no {kind} in {[e['type'] for e in events]}")


def _say(ws: Any, text: str) -> str:
    """A typed user turn, added: its id."""
    ws.send_json({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})
    return str(_until(ws, "conversation.item.done")[-1]["item"]["id"])


# OpenAI's server_vad defaults: a session's turn detection until the client says otherwise
DEFAULT_VAD = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500,
               "create_response": True, "interrupt_response": True, "idle_timeout_ms": None}


def _push_to_talk(ws: Any) -> None:
    """turn_detection null: the client commits its turns."""
    ws.send_json({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
    _until(ws, "session.updated")


def _pcm16(n: int, rate: int = 24_000) -> bytes:
    t = np.arange(n) / rate
    return (0.25 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2").tobytes()


def test_a_spoken_and_a_typed_turn_are_answered_with_speech_and_its_transcript(connect: Callable[..., Any]) -> None:
    service = ScriptedService()
    with connect(service) as ws:
        created = ws.receive_json()
        assert created["type"] == "session.created"
        session = created["session"]
        assert session["model"] == "tiny" and session["output_modalities"] == ["audio"]
        assert session["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24_000}
        assert session["audio"]["input"]["turn_detection"] == DEFAULT_VAD
        ws.send_json({"type": "session.update", "session": {
            "type": "realtime", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0,
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24_000}, "turn_detection": None},
                      "output": {"voice": "chelsie", "speed": 1.25}}}})  # fmt: skip
        updated = ws.receive_json()
        assert updated["type"] == "session.updated", updated
        assert updated["session"]["instructions"] == "Be brief." and updated["session"]["max_output_tokens"] == 9
        assert updated["session"]["audio"]["output"]["voice"] == "chelsie"
        pcm = _pcm16(4800)
        for i in range(0, len(pcm), 3000):
            ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i:i + 3000]).decode()})
        ws.send_json({"type": "input_audio_buffer.commit", "event_id": "c1"})
        committed, added, done = _until(ws, "conversation.item.done")
        assert done["item"] == added["item"]
        assert committed["type"] == "input_audio_buffer.committed" and committed["previous_item_id"] is None
        assert added["item"]["id"] == committed["item_id"] and added["item"]["role"] == "user"
        ws.send_json({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is it?"}]}})
        typed = _until(ws, "conversation.item.done")[0]
        assert typed["previous_item_id"] == committed["item_id"]
        ws.send_json({"type": "response.create"})
        events = _until(ws, "response.done")
        kinds = [e["type"] for e in events]
        assert kinds[:4] == ["response.created", "response.output_item.added", "conversation.item.added",
                             "response.content_part.added"]  # fmt: skip
        assert kinds[-6:] == ["response.output_audio.done", "response.output_audio_transcript.done",
                              "response.content_part.done", "response.output_item.done", "conversation.item.done",
                              "response.done"]  # fmt: skip
        # the pieces in the order they came, each audio delta whole 16-bit samples
        middle = [(e["type"], e["delta"]) for e in events[4:-6]]
        assert middle == [("response.output_audio_transcript.delta", "Hel"),
                          ("response.output_audio.delta", base64.b64encode(b"\x01\x02").decode()),
                          ("response.output_audio_transcript.delta", "lo"),
                          ("response.output_audio.delta", base64.b64encode(b"\x03\x04").decode())]  # fmt: skip
        final = events[-1]["response"]
        assert final["status"] == "completed" and final["output"][0]["content"] == [
            {"type": "output_audio", "transcript": "Hello"}]
        assert final["usage"]["input_tokens"] == 7 and final["usage"]["output_tokens"] == 5
        assert final["usage"]["output_token_details"] == {"text_tokens": 2, "audio_tokens": 3}
        assert len({e.get("event_id") for e in events}) == len(events)  # every event its own id
        # the request: the instructions, the spoken turn at its rate, the typed one; the settings
        (req,) = service.requests
        assert [m.role for m in req.messages] == ["system", "user", "user"]
        assert req.messages[0].content == "Be brief."
        raw = req.messages[1].parts[0].audio.pcm
        assert raw.sample_rate == 24_000
        expected = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768
        assert np.array_equal(np.frombuffer(raw.f32le, "<f4"), expected)
        assert req.messages[2].parts[0].text == "What is it?"
        assert req.want_audio and req.audio_format == gateway_pb2.AudioFormat.PCM16
        assert req.speaker == "chelsie" and req.speed == pytest.approx(1.25)
        assert req.sampling["thinker"].max_tokens == 9
        assert not req.sampling["thinker"].do_sample and not req.sampling["talker"].do_sample  # temperature 0
        assert req.request_id == final["id"] and service.closed == [req.request_id]
        # the next response's request holds this reply's words as the assistant's turn
        ws.send_json({"type": "response.create", "response": {"instructions": "Now in French.",
                                                              "metadata": {"k": "v"}}})  # fmt: skip
        second = _until(ws, "response.done")[-1]["response"]
        assert second["metadata"] == {"k": "v"}
        req2 = service.requests[1]
        assert [m.role for m in req2.messages] == ["system", "user", "user", "assistant"]
        assert req2.messages[0].content == "Now in French." and req2.messages[3].content == "Hello"


def test_text_out_and_a_reply_cut_at_max_output_tokens(connect: Callable[..., Any]) -> None:
    service = ScriptedService([_text("Hi"), _text(" there"), _final("length")])
    with connect(service) as ws:
        ws.receive_json()
        ws.send_json({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]}})
        _until(ws, "conversation.item.done")
        ws.send_json({"type": "response.create", "response": {"output_modalities": ["text"], "max_output_tokens": 2}})
        events = _until(ws, "response.done")
        assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["Hi", " there"]
        assert not any("audio" in e["type"] for e in events)
        assert [e["text"] for e in events if e["type"] == "response.output_text.done"] == ["Hi there"]
        final = events[-1]["response"]
        assert final["status"] == "incomplete"
        assert final["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
        assert final["output"][0]["content"] == [{"type": "output_text", "text": "Hi there"}]
    (req,) = service.requests
    assert not req.want_audio and req.sampling["thinker"].max_tokens == 2
    assert not req.sampling["thinker"].HasField("do_sample") or req.sampling["thinker"].do_sample is False


def test_a_text_only_stack_answers_in_text(connect: Callable[..., Any]) -> None:
    service = ScriptedService([_text("ok"), _final()], audio=False)
    with connect(service) as ws:
        assert ws.receive_json()["session"]["output_modalities"] == ["text"]
        ws.send_json({"type": "session.update", "session": {"output_modalities": ["audio"]}})
        error = ws.receive_json()
        assert error["type"] == "error" and error["error"]["param"] == "session.output_modalities"


BAD_EVENTS = [
    ({"type": "session.update", "session": {"include": ["item.input_audio_transcription.logprobs", "reasoning"]}},
     "session.include", None),
    ({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}},
     "session.audio.input.turn_detection.type", "unsupported_turn_detection"),
    ({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "server_vad", "idle_timeout_ms": 500}}}}}, "session.audio.input.turn_detection.idle_timeout_ms", None),
    ({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "server_vad", "threshold": 2}}}}}, "session.audio.input.turn_detection.threshold", None),
    ({"type": "session.update", "session": {"audio": {"input": {"transcription": {"model": "other-asr"}}}}},
     "session.audio.input.transcription.model", None),
    ({"type": "session.update", "session": {"audio": {"input": {"transcription": {"language": "not a code"}}}}},
     "session.audio.input.transcription.language", None),
    ({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/opus"}}}}},
     "session.audio.input.format.type", None),
    ({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcmu", "rate": 16000}}}}},
     "session.audio.input.format.rate", None),
    ({"type": "session.update", "session": {"audio": {"output": {"format": {"type": "audio/pcma", "rate": 24000}}}}},
     "session.audio.output.format.rate", None),
    ({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 4000}}}}},
     "session.audio.input.format.rate", None),
    ({"type": "session.update", "session": {"audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}}},
     "session.audio.output.format.rate", None),
    ({"type": "session.update", "session": {"audio": {"output": {"voice": "nobody"}}}},
     "session.audio.output.voice", None),
    ({"type": "session.update", "session": {"audio": {"output": {"speed": 3.0}}}}, "session.audio.output.speed", None),
    ({"type": "session.update", "session": {"tools": [{"type": "mcp", "name": "f"}]}}, "session.tools[0].type", None),
    ({"type": "session.update", "session": {"truncation": "sometimes"}}, "session.truncation", None),
    ({"type": "session.update", "session": {"truncation": {"type": "retention_ratio", "retention_ratio": 1.5}}},
     "session.truncation.retention_ratio", None),
    ({"type": "session.update", "session": {"max_output_tokens": 5000}}, "session.max_output_tokens", None),
    ({"type": "session.update", "session": {"output_modalities": ["text", "audio"]}},
     "session.output_modalities", None),
    ({"type": "session.update", "session": {"model": "gpt-realtime"}}, "session.model", "model_not_found"),
    ({"type": "session.update", "session": {"colour": "blue"}}, "session.colour", None),
    ({"type": "input_audio_buffer.append", "audio": "not base64!"}, "audio", None),
    ({"type": "input_audio_buffer.commit"}, None, "input_audio_buffer_commit_empty"),
    ({"type": "conversation.item.create", "item": {"type": "function_call", "name": "f"}}, "item.call_id", None),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "system",
                                                   "content": [{"type": "input_audio", "audio": ""}]}},
     "item.content[0].type", None),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}}, "item.content[0].image_url", None),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": []}},
     "item.content", None),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": 5}]}}, "item.content[0].text", None),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "half a pair: \ud800"}]}}, "item.content[0].text", None),
    ({"type": "session.update", "session": {"instructions": "\udfff"}}, "session.instructions", None),
    ({"type": "conversation.item.create", "previous_item_id": "nope", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}},
     "previous_item_id", "item_not_found"),
    ({"type": "conversation.item.delete", "item_id": "nope"}, "item_id", "item_not_found"),
    ({"type": "response.create"}, None, "empty_conversation"),
    ({"type": "response.create", "response": {"conversation": "conv_other"}}, "response.conversation", None),
    ({"type": "response.create", "response": {"input": [{"type": "item_reference", "id": "nope"}]}},
     "response.input[0].id", "item_not_found"),
    ({"type": "response.create", "response": {"input": [{"type": "function_call_output", "output": "x"}]}},
     "response.input[0].call_id", None),
    ({"type": "response.create", "response": {"input": [{"type": "web_search_call"}]}}, "response.input[0].type", None),
    ({"type": "response.create", "response": {"input": {"type": "message"}}}, "response.input", None),
    ({"type": "response.cancel", "response_id": "resp_nope"}, "response_id", "response_cancel_not_active"),
    ({"type": "response.cancel"}, None, "response_cancel_not_active"),
    ({"type": "transcription_session.update"}, "type", "invalid_event"),
    ({"kind": "session.update"}, "type", "invalid_event"),
]


def test_a_refused_event_is_an_error_naming_it_and_the_session_goes_on(connect: Callable[..., Any]) -> None:
    service = ScriptedService()
    with connect(service) as ws:
        ws.receive_json()
        for i, (event, param, code) in enumerate(BAD_EVENTS):
            ws.send_json({**event, "event_id": f"bad-{i}"})
            got = ws.receive_json()
            assert got["type"] == "error", (event, got)
            error = got["error"]
            assert error["event_id"] == f"bad-{i}" and error["type"] == "invalid_request_error", got
            assert error["param"] == param and error["message"], (event, error)
            if param:
                assert error["message"].startswith(param) or param in error["message"], error
            if code:
                assert error["code"] == code, (event, error)
        ws.send_text("{not json")
        assert ws.receive_json()["error"]["code"] == "invalid_json"
        ws.send_bytes(b"\x00\x01")
        assert "text frames" in ws.receive_json()["error"]["message"]
        # nothing refused changed the session
        ws.send_json({"type": "session.update", "session": {}})
        session = ws.receive_json()["session"]
        assert session["include"] is None  # (the refused include changed nothing either)
        assert session["audio"]["input"]["turn_detection"] == DEFAULT_VAD and session["audio"]["output"]["speed"] == 1.0
        assert session["audio"]["output"]["voice"] is None and session["max_output_tokens"] == "inf"
    assert service.requests == []


def test_items_are_placed_retrieved_and_deleted(connect: Callable[..., Any]) -> None:
    service = ScriptedService()

    def user(text: str, **item: Any) -> dict[str, Any]:
        return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}], **item}

    with connect(service) as ws:
        ws.receive_json()
        ws.send_json({"type": "conversation.item.create", "item": user("second", id="b")})
        _until(ws, "conversation.item.done")
        ws.send_json({"type": "conversation.item.create", "previous_item_id": "root", "item": user("first", id="a")})
        assert _until(ws, "conversation.item.done")[0]["previous_item_id"] is None
        ws.send_json({"type": "conversation.item.create", "item": {
            "type": "message", "role": "assistant", "content": [{"type": "output_audio", "transcript": "said"}]}})
        _until(ws, "conversation.item.done")
        ws.send_json({"type": "conversation.item.create", "item": user("again", id="a")})
        assert ws.receive_json()["error"]["param"] == "item.id"
        ws.send_json({"type": "conversation.item.retrieve", "item_id": "a"})
        got = ws.receive_json()
        assert got["type"] == "conversation.item.retrieved"
        assert got["item"]["content"] == [{"type": "input_text", "text": "first"}]
        ws.send_json({"type": "conversation.item.delete", "item_id": "b"})
        deleted = ws.receive_json()
        assert (deleted["type"], deleted["item_id"]) == ("conversation.item.deleted", "b")
        ws.send_json({"type": "response.create"})
        _until(ws, "response.done")
    (req,) = service.requests
    assert [(m.role, m.parts[0].text if m.parts else m.content) for m in req.messages] == [
        ("user", "first"), ("assistant", "said")]


def test_a_cancelled_response_keeps_what_was_made_and_closes_its_request(connect: Callable[..., Any]) -> None:
    service = ScriptedService([_text("Par"), HANG, _text("never"), _final()])
    with connect(service) as ws:
        ws.receive_json()
        _say(ws, "Talk")
        ws.send_json({"type": "response.create"})
        _until(ws, "response.output_audio_transcript.delta")
        ws.send_json({"type": "response.create"})  # one at a time
        assert ws.receive_json()["error"]["code"] == "conversation_already_has_active_response"
        ws.send_json({"type": "response.cancel"})
        events = _until(ws, "response.done")
        final = events[-1]["response"]
        assert final["status"] == "cancelled" and final["status_details"] == {"type": "cancelled",
                                                                              "reason": "client_cancelled"}
        assert final["output"][0]["status"] == "incomplete"
        assert final["output"][0]["content"] == [{"type": "output_audio", "transcript": "Par"}]
        assert service.closed == [service.requests[0].request_id]
        # the session takes the next response; its request holds the cut reply's words
        service.script = REPLY
        ws.send_json({"type": "response.create"})
        assert _until(ws, "response.done")[-1]["response"]["status"] == "completed"
        assert service.requests[1].messages[-1].content == "Par"


def test_a_hang_up_cancels_the_response_being_made(connect: Callable[..., Any]) -> None:
    service = ScriptedService([_text("Par"), HANG, _final()])
    with connect(service) as ws:
        ws.receive_json()
        _say(ws, "Talk")
        ws.send_json({"type": "response.create"})
        _until(ws, "response.output_audio_transcript.delta")
    # (the app's event loop runs on: only the hang-up can have closed the request)
    deadline = time.monotonic() + 10
    while not service.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.closed == [service.requests[0].request_id]


def test_a_client_that_stops_reading_loses_its_response_and_its_socket(connect: Callable[..., Any]) -> None:
    """output_stall_timeout_s without a taken event (GatewayService.deliver fails the request):
    the socket is closed (1008), the request closed, and the conversation keeps the words sent."""
    service = ScriptedService([_text("Par"), _text("tial"), HANG, _final()])
    service.stall_after = 1
    with connect(service) as ws:
        ws.receive_json()
        _say(ws, "Talk")
        ws.send_json({"type": "response.create"})
        events = []
        with pytest.raises(WebSocketDisconnect) as closed:
            while True:
                events.append(ws.receive_json())
        assert closed.value.code == 1008
        assert [e["delta"] for e in events if e["type"].endswith(".delta")] == ["Par"]
        assert not any(e["type"] == "response.done" for e in events)
    deadline = time.monotonic() + 10
    while not service.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.closed == [service.requests[0].request_id]


def test_a_failed_request_is_a_failed_response_and_the_session_goes_on(connect: Callable[..., Any]) -> None:
    failure = GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "prompt: 2000 tokens exceed max_model_len")
    service = ScriptedService([failure])
    with connect(service) as ws:
        ws.receive_json()
        _say(ws, "Talk")
        ws.send_json({"type": "response.create"})
        final = _until(ws, "response.done")[-1]["response"]
        assert final["status"] == "failed"
        assert final["status_details"]["error"]["message"].startswith("prompt: 2000 tokens")
        assert final["status_details"]["error"]["type"] == "invalid_request_error"
        service.script = REPLY
        ws.send_json({"type": "response.create"})
        assert _until(ws, "response.done")[-1]["response"]["status"] == "completed"


def test_media_past_the_request_limit_is_refused(connect: Callable[..., Any]) -> None:
    service = ScriptedService(max_request_bytes=64 * 1024)
    with connect(service) as ws:
        ws.receive_json()
        _push_to_talk(ws)
        piece = base64.b64encode(_pcm16(8000)).decode()  # 16 KB, held as 32 KB once committed
        ws.send_json({"type": "input_audio_buffer.append", "audio": piece})
        ws.send_json({"type": "input_audio_buffer.append", "audio": piece})
        ws.send_json({"type": "input_audio_buffer.append", "audio": piece})
        error = ws.receive_json()["error"]
        assert error["code"] == "conversation_too_large" and "media.max_request_bytes" in error["message"]
        ws.send_json({"type": "input_audio_buffer.clear"})
        assert ws.receive_json()["type"] == "input_audio_buffer.cleared"
        ws.send_json({"type": "input_audio_buffer.commit"})
        assert ws.receive_json()["error"]["code"] == "input_audio_buffer_commit_empty"


def test_the_key_and_the_model_are_checked_before_the_socket_opens(connect: Callable[..., Any]) -> None:
    service = ScriptedService(api_key="k")
    with pytest.raises(WebSocketDenialResponse) as denied, connect(service):
        pass
    assert denied.value.status_code == 401 and denied.value.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(WebSocketDenialResponse) as denied, connect(
            service, "/v1/realtime?model=gpt-realtime", headers={"authorization": "Bearer k"}):
        pass
    assert denied.value.status_code == 404 and denied.value.json()["error"]["param"] == "model"
    with connect(service, "/v1/realtime?model=tiny", headers={"authorization": "Bearer k"}) as ws:
        assert ws.receive_json()["type"] == "session.created"
    # a browser page's socket: its own server's origin, or one the deploy config lets in
    with pytest.raises(WebSocketDenialResponse) as denied, connect(
            service, headers={"authorization": "Bearer k", "origin": "https://elsewhere.example"}):
        pass
    assert denied.value.status_code == 403 and denied.value.json()["error"]["code"] == "origin_not_allowed"
    with connect(service, headers={"authorization": "Bearer k", "origin": "http://testserver"}) as ws:
        assert ws.receive_json()["type"] == "session.created"
    service.cfg.gateway.cors_allow_origins = ["https://app.example"]
    with connect(service, headers={"authorization": "Bearer k", "origin": "https://app.example"}) as ws:
        assert ws.receive_json()["type"] == "session.created"
    assert service.refusals == [("realtime", "UNAUTHENTICATED"), ("realtime", "NOT_FOUND"),
                                ("realtime", "PERMISSION_DENIED")]  # fmt: skip


def test_a_conversation_is_bounded_in_items_and_deleting_makes_room(
        connect: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.realtime as realtime

    monkeypatch.setattr(realtime, "MAX_ITEMS", 2)
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * 1000}]}
    with connect(ScriptedService(max_request_bytes=64 * 1024)) as ws:
        ws.receive_json()
        for name in ("a", "b"):
            ws.send_json({"type": "conversation.item.create", "item": {**item, "id": name}})
            _until(ws, "conversation.item.done")
        ws.send_json({"type": "conversation.item.create", "item": {**item, "id": "c"}})
        assert ws.receive_json()["error"]["code"] == "conversation_too_large"
        ws.send_json({"type": "response.create"})  # (its reply would be a third item)
        assert ws.receive_json()["error"]["code"] == "conversation_too_large"
        ws.send_json({"type": "conversation.item.delete", "item_id": "a"})
        assert ws.receive_json()["type"] == "conversation.item.deleted"
        ws.send_json({"type": "conversation.item.create", "item": {**item, "id": "c"}})
        assert _until(ws, "conversation.item.done")[-1]["item"]["id"] == "c"
        # text counts towards the bound too
        ws.send_json({"type": "conversation.item.delete", "item_id": "b"})
        ws.receive_json()
        ws.send_json({"type": "conversation.item.create", "item": {**item, "content": [
            {"type": "input_text", "text": "y" * 70_000}]}})
        assert ws.receive_json()["error"]["code"] == "conversation_too_large"


def test_a_bug_ends_its_session_not_the_server(connect: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.realtime as realtime

    async def broken(session: Any, body: dict[str, Any]) -> None:
        raise KeyError("a bug")

    monkeypatch.setitem(realtime._HANDLERS, "input_audio_buffer.clear", broken)
    service = ScriptedService()
    with connect(service) as ws:
        ws.receive_json()
        ws.send_json({"type": "input_audio_buffer.clear"})
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
        assert closed.value.code == 1011
    with connect(service) as ws:  # the next session is served
        assert ws.receive_json()["type"] == "session.created"


def _speech(rate: int = 24_000, lead_s: float = 0.5, speech_s: float = 0.8, tail_s: float = 0.7,
            speech_dbfs: float = -20.0, noise_dbfs: float = -60.0) -> bytes:  # fmt: skip
    """Quiet noise, a tone at `speech_dbfs` (RMS), quiet noise: 16-bit PCM."""
    rng = np.random.default_rng(0)
    n = [round(x * rate) for x in (lead_s, speech_s, tail_s)]
    noise = rng.standard_normal(sum(n)) * 10 ** (noise_dbfs / 20)
    t = np.arange(n[1]) / rate
    noise[n[0]:n[0] + n[1]] += np.sqrt(2) * 10 ** (speech_dbfs / 20) * np.sin(2 * np.pi * 220 * t)
    return (noise * 32767).round().astype("<i2").tobytes()


def test_energy_vad_finds_a_turn_alike_in_any_pieces() -> None:
    from gateway.realtime_vad import EnergyVad, VadEvent, VadSettings

    pcm = _speech()
    whole = EnergyVad(VadSettings(), 24_000).feed(pcm)
    # 10 ms frames: the tone's first frame at 0.5 s starts it, known 30 ms on; its end at 1.3 s
    # stops it, known silence_duration_ms (500) on
    assert whole == [VadEvent("started", 12_000, 12_720), VadEvent("stopped", 31_200, 43_200)], whole
    rng = np.random.default_rng(1)
    vad, got, at = EnergyVad(VadSettings(), 24_000), [], 0
    while at < len(pcm):
        step = int(rng.integers(1, 5000))
        got += vad.feed(pcm[at:at + step])
        at += step
    assert got == whole
    # the level: a tone at -50 dBFS is below threshold 0.5 (-40 dBFS), above 0.2 (-58 dBFS)
    quiet = _speech(speech_dbfs=-50)
    assert EnergyVad(VadSettings(), 24_000).feed(quiet) == []
    assert [e.kind for e in EnergyVad(VadSettings(threshold=0.2), 24_000).feed(quiet)] == ["started", "stopped"]
    # a click (20 ms) starts no turn; a shorter silence than silence_duration_ms ends none
    click = _speech(speech_s=0.02)
    assert EnergyVad(VadSettings(), 24_000).feed(click) == []
    gap = _speech(speech_s=0.4, tail_s=0.3) + _speech(lead_s=0.0, speech_s=0.4)
    assert [e.kind for e in EnergyVad(VadSettings(), 24_000).feed(gap)] == ["started", "stopped"]


def test_server_vad_commits_a_turn_and_answers_it(connect: Callable[..., Any]) -> None:
    """server_vad: the turn's start and end as events, its audio (from its prefix padding to where
    its end was known) committed and answered; silence before it is not kept (at the session's
    bound, all but the padding's worth goes, however long the client streams); a second turn
    over a response being made interrupts it."""
    service = ScriptedService(max_request_bytes=512 * 1024)  # (the 10 s of silence would be 960 KB, held)
    rate = 24_000
    with connect(service) as ws:
        ws.receive_json()
        ws.send_json({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
            "type": "server_vad", "prefix_padding_ms": 100, "silence_duration_ms": 300}}}}})
        vad = ws.receive_json()["session"]["audio"]["input"]["turn_detection"]
        assert vad["type"] == "server_vad" and vad["prefix_padding_ms"] == 100 and vad["threshold"] == 0.5
        silence = _speech(lead_s=10.0, speech_s=0.0, tail_s=0.0)
        pcm = silence + _speech()
        for i in range(0, len(pcm), 4800):  # 100 ms pieces
            ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i:i + 4800]).decode()})
        events = _until(ws, "response.done")
        kinds = [e["type"] for e in events]
        assert kinds[:5] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                             "input_audio_buffer.committed", "conversation.item.added",
                             "conversation.item.done"], kinds  # fmt: skip
        started, stopped, committed = events[:3]
        assert started["audio_start_ms"] == 10_500 and stopped["audio_end_ms"] == 11_300
        assert started["item_id"] == stopped["item_id"] == committed["item_id"]
        assert "error" not in kinds and events[-1]["response"]["status"] == "completed"
        (req,) = service.requests
        got = np.frombuffer(req.messages[0].parts[0].audio.pcm.f32le, "<f4")
        first, end = (10_500 - 100) * rate // 1000, (11_300 + 300) * rate // 1000  # padding; where the end was known
        want = np.frombuffer(pcm, "<i2")[first:end].astype(np.float32) / 32768
        assert np.array_equal(got, want)
        # a turn over a response being made interrupts it (its response.done first), then is answered
        service.script = [_text("Par"), HANG, _final()]
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(_speech()).decode()})
        _until(ws, "response.output_audio_transcript.delta")
        service.script = REPLY
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(_speech()).decode()})
        events = _until(ws, "response.done") + _until(ws, "response.done")
        kinds = [e["type"] for e in events]
        dones = [i for i, k in enumerate(kinds) if k == "response.done"]
        assert [events[i]["response"]["status"] for i in dones] == ["cancelled", "completed"]
        # as OpenAI's API says a barge-in (a client's response.cancel says client_cancelled)
        assert events[dones[0]]["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
        assert kinds[0] == "input_audio_buffer.speech_started"  # (then the cut response's end)
        assert kinds.index("input_audio_buffer.committed") < kinds.index("response.created") < dones[1]
    assert len(service.requests) == 3 and service.closed == [r.request_id for r in service.requests]


def test_a_turn_is_cut_at_the_longest_the_session_takes() -> None:
    from gateway.realtime_vad import EnergyVad, VadEvent, VadSettings

    steady = _speech(lead_s=0.0, speech_s=3.0, tail_s=0.0)  # noise above the level, say
    events = EnergyVad(VadSettings(), 24_000, max_turn=24_000).feed(steady)
    assert events[:3] == [VadEvent("started", 0, 720), VadEvent("stopped", 24_000, 24_000),
                          VadEvent("started", 24_000, 24_720)], events  # fmt: skip


def test_server_vad_turns_refused_changed_or_cleared_keep_their_bookkeeping(
        connect: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn refused (the conversation full) is dropped, not joined to the next; odd bytes are
    refused; the input rate changes (after a clear) without the turns' times going back."""
    import gateway.realtime as realtime

    monkeypatch.setattr(realtime, "MAX_ITEMS", 2)
    rate, service = 24_000, ScriptedService()
    with connect(service) as ws:
        ws.receive_json()
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x01\x02\x03").decode()})
        assert ws.receive_json()["error"]["message"] == "audio: audio/pcm needs whole 16-bit samples"
        for name in ("t1", "t2"):  # the conversation full
            ws.send_json({"type": "conversation.item.create", "item": {
                "id": name, "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}})
            _until(ws, "conversation.item.done")
        ws.send_json({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
            "type": "server_vad", "create_response": False, "prefix_padding_ms": 0}}}}})
        ws.receive_json()
        two = _speech(speech_s=1.0, tail_s=0.7) + _speech(lead_s=0.0, speech_s=0.3, tail_s=0.7)
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(two).decode(), "event_id": "a1"})
        events = [ws.receive_json() for _ in range(6)]
        kinds = [e["type"] for e in events]
        assert kinds == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "error",
                         "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "error"], kinds
        assert events[0]["item_id"] == events[1]["item_id"] != events[3]["item_id"] == events[4]["item_id"]
        assert {e["error"]["code"] for e in events[2::3]} == {"conversation_too_large"}
        assert events[2]["error"]["event_id"] == "a1"
        ws.send_json({"type": "conversation.item.delete", "item_id": "t1"})
        assert ws.receive_json()["type"] == "conversation.item.deleted"
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(_speech(speech_s=0.3)).decode()})
        assert _until(ws, "conversation.item.done")[-1]["item"]["role"] == "user"
        ws.send_json({"type": "conversation.item.delete", "item_id": "t2"})
        ws.receive_json()
        ws.send_json({"type": "response.create"})
        _until(ws, "response.done")
        # the refused turns' audio is not the next's: the last turn's item is its own 0.8 s alone
        # (from its first voiced frame to where its end was known: 0.3 s and 500 ms of silence)
        last = service.requests[-1].messages[-1].parts[0].audio.pcm
        assert len(last.f32le) // 4 == round(0.8 * rate), len(last.f32le) // 4
        # a clear, then 16 kHz: times go on from where the 24 kHz audio ended
        ws.send_json({"type": "input_audio_buffer.clear"})
        assert ws.receive_json()["type"] == "input_audio_buffer.cleared"
        ws.send_json({"type": "session.update", "session": {"audio": {"input": {
            "format": {"type": "audio/pcm", "rate": 16_000}}}}})
        assert ws.receive_json()["session"]["audio"]["input"]["format"]["rate"] == 16_000
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(
            _speech(rate=16_000, speech_s=0.3)).decode()})
        started = ws.receive_json()
        ended_24k = (len(two) + len(_speech(speech_s=0.3))) // 2 * 1000 // rate  # the 24 kHz audio before it
        assert started["type"] == "input_audio_buffer.speech_started"
        assert started["audio_start_ms"] == ended_24k + 500, started
        stopped = _until(ws, "input_audio_buffer.speech_stopped")[-1]
        assert stopped["audio_end_ms"] == ended_24k + 800


def test_a_turn_that_ends_over_a_response_is_answered_after_it(connect: Callable[..., Any]) -> None:
    """interrupt_response false: a turn spoken while a response is made does not cut it; it is
    committed at once and answered when that response is done."""
    service = ScriptedService([_text("Par"), GATE, _final()])
    with connect(service) as ws:
        ws.receive_json()
        ws.send_json({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
            "type": "server_vad", "interrupt_response": False}}}}})
        ws.receive_json()
        _say(ws, "Talk")
        ws.send_json({"type": "response.create"})
        _until(ws, "response.output_audio_transcript.delta")
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(_speech()).decode()})
        heard = _until(ws, "conversation.item.done")
        assert [e["type"] for e in heard][:3] == ["input_audio_buffer.speech_started",
                                                  "input_audio_buffer.speech_stopped",
                                                  "input_audio_buffer.committed"]  # fmt: skip
        assert len(service.requests) == 1  # (not answered yet: a response is being made)
        service.script = REPLY
        service.gate.set()
        first = _until(ws, "response.done")[-1]["response"]
        second = _until(ws, "response.done")[-1]["response"]
        assert (first["status"], second["status"]) == ("completed", "completed")
        assert first["output"][0]["content"][0]["transcript"] == "Par"
    turn = service.requests[1].messages
    assert [m.role for m in turn] == ["user", "assistant", "user"] and turn[2].parts[0].audio.pcm.f32le


def test_committed_turns_are_transcribed_beside_their_response(connect: Callable[..., Any]) -> None:
    """audio.input.transcription: each committed turn is also asked of the model as
    /v1/audio/transcriptions asks it (its audio, the instruction, greedy, text out); its words
    come as input_audio_transcription deltas, then .completed, and the item holds them."""
    service = ScriptedService([_text("I said"), _audio(b"\x00\x00"), _text(" hi"), _final()])
    with connect(service) as ws:
        ws.receive_json()
        _push_to_talk(ws)
        ws.send_json({"type": "session.update", "session": {"audio": {"input": {"transcription": {
            "model": "gpt-4o-transcribe", "language": "de"}}}}})
        shown = ws.receive_json()["session"]["audio"]["input"]["transcription"]
        assert shown == {"model": "gpt-4o-transcribe", "language": "de", "prompt": None}
        pcm = _pcm16(2400)
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})
        ws.send_json({"type": "input_audio_buffer.commit"})
        events = _until(ws, "conversation.item.input_audio_transcription.completed")
        item_id = events[0]["item_id"]
        deltas = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.delta"]
        assert [e["delta"] for e in deltas] == ["I said", " hi"] and {e["item_id"] for e in deltas} == {item_id}
        done = events[-1]
        assert done["transcript"] == "I said hi" and done["item_id"] == item_id and done["usage"]["input_tokens"] == 7
        ws.send_json({"type": "conversation.item.retrieve", "item_id": item_id})
        assert ws.receive_json()["item"]["content"] == [{"type": "input_audio", "transcript": "I said hi"}]
        # a failed transcription is its own event; the session goes on
        service.script = [GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "messages[0].content[0]: too long")]
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})
        ws.send_json({"type": "input_audio_buffer.commit"})
        failed = _until(ws, "conversation.item.input_audio_transcription.failed")[-1]
        assert failed["error"]["message"].startswith("messages[0].content[0]: too long")
        # transcription off: commits make no request
        ws.send_json({"type": "session.update", "session": {"audio": {"input": {"transcription": None}}}})
        assert ws.receive_json()["session"]["audio"]["input"]["transcription"] is None
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})
        ws.send_json({"type": "input_audio_buffer.commit"})
        _until(ws, "conversation.item.done")
    from gateway.transcription import instruction

    (req, _) = service.requests
    thinker = req.sampling["thinker"]
    assert not req.want_audio and thinker.HasField("do_sample") and not thinker.do_sample
    (turn,) = req.messages
    assert turn.role == "user" and turn.parts[0].audio.pcm.sample_rate == 24_000
    assert turn.parts[1].text == instruction(False, "de")  # (the speech-to-text endpoint's own)


def test_a_transcription_ends_with_its_item_or_its_session(connect: Callable[..., Any]) -> None:
    """Deleting a turn being transcribed cancels its transcription (its words would name a gone
    item); a hang-up cancels one too."""
    service = ScriptedService([_text("I said"), HANG, _final()])

    def closed(n: int) -> list[str]:
        deadline = time.monotonic() + 10
        while len(service.closed) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return service.closed

    with connect(service) as ws:
        ws.receive_json()
        _push_to_talk(ws)
        ws.send_json({"type": "session.update", "session": {"audio": {"input": {"transcription": {}}}}})
        ws.receive_json()
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(_pcm16(2400)).decode()})
        ws.send_json({"type": "input_audio_buffer.commit"})
        item_id = _until(ws, "conversation.item.input_audio_transcription.delta")[-1]["item_id"]
        ws.send_json({"type": "conversation.item.delete", "item_id": item_id})
        assert ws.receive_json()["type"] == "conversation.item.deleted"
        assert closed(1) == [service.requests[0].request_id]
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(_pcm16(2400)).decode()})
        ws.send_json({"type": "input_audio_buffer.commit"})
        _until(ws, "conversation.item.input_audio_transcription.delta")
    assert closed(2) == [r.request_id for r in service.requests]


# ---- the beta dialect (gateway/realtime_beta.py) ------------------------------------------------

BETA = {"openai-beta": "realtime=v1"}
# OpenAI's beta names for GA's server events (openai.types.beta.realtime); conversation.item.done
# has none (beta's `created` carries the item)
BETA_NAMES = {"conversation.item.added": "conversation.item.created",
              "response.output_audio.delta": "response.audio.delta",
              "response.output_audio.done": "response.audio.done",
              "response.output_audio_transcript.delta": "response.audio_transcript.delta",
              "response.output_audio_transcript.done": "response.audio_transcript.done",
              "response.output_text.delta": "response.text.delta", "response.output_text.done": "response.text.done"}


def _conversation(ws: Any, session: dict[str, Any], pcm: bytes, response: dict[str, Any]) -> list[dict[str, Any]]:
    """session.update, a committed spoken turn, a typed one and a response: every event after the update."""
    ws.send_json({"type": "session.update", "session": session})
    events = _until(ws, "session.updated")[-1:]
    ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})
    ws.send_json({"type": "input_audio_buffer.commit"})
    ws.send_json({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "And?"}]}})
    ws.send_json({"type": "response.create", "response": response})
    return events + _until(ws, "response.done")


def test_a_beta_client_is_served_in_its_dialect(connect: Callable[..., Any]) -> None:
    """The same conversation in the beta dialect and in GA's asks the same of the gateway; the
    beta client's events carry beta's names and shapes."""
    pcm = _pcm16(4800)
    ga, beta = ScriptedService(), ScriptedService()
    with connect(ga) as ws:
        ws.receive_json()
        ga_events = _conversation(ws, {
            "instructions": "Be brief.", "output_modalities": ["audio"], "max_output_tokens": 9, "temperature": 0,
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24_000}, "turn_detection": None},
                      "output": {"format": {"type": "audio/pcm"}, "voice": "chelsie", "speed": 1.25}}},
            pcm, {"instructions": "In French.", "audio": {"output": {"voice": "ethan"}}})  # fmt: skip
    with connect(beta, headers=BETA) as ws:
        created = ws.receive_json()
        assert created["type"] == "session.created"
        assert created["session"]["modalities"] == ["text", "audio"] and "output_modalities" not in created["session"]
        assert created["session"]["input_audio_format"] == "pcm16" and "audio" not in created["session"]
        assert ws.receive_json()["type"] == "conversation.created"
        beta_events = _conversation(ws, {
            "instructions": "Be brief.", "modalities": ["text", "audio"], "max_response_output_tokens": 9,
            "temperature": 0, "input_audio_format": "pcm16", "output_audio_format": "pcm16", "turn_detection": None,
            "voice": "chelsie", "speed": 1.25},
            pcm, {"instructions": "In French.", "voice": "ethan", "modalities": ["audio", "text"]})  # fmt: skip
    for service in (ga, beta):
        for req in service.requests:
            req.request_id = ""
    assert beta.requests == ga.requests and len(ga.requests) == 1
    assert ga.requests[0].speaker == "ethan" and ga.requests[0].messages[0].content == "In French."
    session = beta_events[0]["session"]
    assert {k: session[k] for k in ("modalities", "instructions", "voice", "speed", "input_audio_format",
                                    "output_audio_format", "turn_detection", "max_response_output_tokens",
                                    "temperature")} == {
        "modalities": ["text", "audio"], "instructions": "Be brief.", "voice": "chelsie", "speed": 1.25,
        "input_audio_format": "pcm16", "output_audio_format": "pcm16", "turn_detection": None,
        "max_response_output_tokens": 9, "temperature": 0}  # fmt: skip
    expected = [BETA_NAMES.get(e["type"], e["type"]) for e in ga_events if e["type"] != "conversation.item.done"]
    assert [e["type"] for e in beta_events] == expected
    assert "response.audio.delta" in expected and "conversation.item.created" in expected
    pieces = {"ga": [e.get("delta") for e in ga_events], "beta": [e.get("delta") for e in beta_events]}
    assert [d for d in pieces["beta"] if d] == [d for d in pieces["ga"] if d]  # the same words and samples
    done = beta_events[-1]["response"]
    assert done["modalities"] == ["text", "audio"] and done["voice"] == "ethan"
    assert done["output_audio_format"] == "pcm16" and "audio" not in done and "output_modalities" not in done
    assert done["output"][0]["content"] == [{"type": "audio", "transcript": "Hello"}]
    parts = [e["part"]["type"] for e in beta_events if "part" in e]
    assert parts == ["audio", "audio"]
    items = [e["item"] for e in beta_events if e["type"] == "conversation.item.created"]
    assert [[p["type"] for p in i["content"]] for i in items] == [["input_audio"], ["input_text"], []]
    done_item = next(e["item"] for e in beta_events if e["type"] == "response.output_item.done")
    assert done_item["content"] == [{"type": "audio", "transcript": "Hello"}]  # (GA's: output_audio)


def test_beta_text_replies_and_refusals(connect: Callable[..., Any]) -> None:
    service = ScriptedService([_text("Hi"), _final()])
    with connect(service, headers={"openai-beta": "assistants=v2, realtime=v1"}) as ws:
        _until(ws, "conversation.created")
        ws.send_json({"type": "session.update", "event_id": "u1", "session": {"client_secret": {"seconds": 9}}})
        error = ws.receive_json()
        assert error["type"] == "error" and error["error"]["param"] == "session.client_secret"
        assert error["error"]["event_id"] == "u1"
        # refusals name beta's fields, not GA's
        for session, param in [({"modalities": ["video"]}, "session.modalities"),
                               ({"voice": "nobody"}, "session.voice"),
                               ({"max_response_output_tokens": 99_999}, "session.max_response_output_tokens"),
                               ({"turn_detection": {"type": "semantic_vad"}}, "session.turn_detection.type"),
                               # GA's names for the fields beta moves: two names for one field
                               ({"voice": "ethan", "audio": None}, "session.audio"),
                               ({"modalities": ["text"], "output_modalities": ["audio"]}, "session.output_modalities"),
                               ({"max_output_tokens": 5}, "session.max_output_tokens")]:
            ws.send_json({"type": "session.update", "session": session})
            error = ws.receive_json()["error"]
            assert error["param"] == param and error["message"].startswith(param), (session, error)
        ws.send_json({"type": "response.create", "response": {"audio": 1, "voice": "ethan"}})
        assert ws.receive_json()["error"]["param"] == "response.audio"
        ws.send_json({"type": "session.update", "session": {"modalities": ["text"], "turn_detection": {
            "type": "server_vad", "silence_duration_ms": 300}}})  # fmt: skip
        session = _until(ws, "session.updated")[-1]["session"]
        assert session["modalities"] == ["text"] and session["turn_detection"]["silence_duration_ms"] == 300
        ws.send_json({"type": "response.create", "response": {"turn_detection": None}})  # a session's field
        assert ws.receive_json()["type"] == "error"
        # odd values are refused by name, never a crash of the session
        for event, param in [({"type": "session.update", "session": {"modalities": [{"a": 1}]}}, "session.modalities"),
                             ({"type": "response.create", "response": {"modalities": [["x"]]}}, "response.modalities"),
                             ({"type": "transcription_session.update", "session": {"modalities": [{}]}},
                              "session.modalities"),
                             ({"type": "transcription_session.update", "session": "x"}, "session"),
                             ({"type": "response.create", "response": []}, "response")]:
            ws.send_json(event)
            error = ws.receive_json()
            assert error["type"] == "error" and error["error"]["param"] == param, (event, error)
        ws.send_json({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]}})
        assert ws.receive_json()["type"] == "conversation.item.created"
        ws.send_json({"type": "response.create"})
        events = _until(ws, "response.done")
        assert [e["type"] for e in events if "delta" in e or e["type"].endswith("text.done")] == [
            "response.text.delta", "response.text.done"]
        assert events[-1]["response"]["output"][0]["content"] == [{"type": "text", "text": "Hi"}]
    assert not service.requests[0].want_audio


def test_a_browser_sends_its_key_and_dialect_as_subprotocols(connect: Callable[..., Any]) -> None:
    service = ScriptedService(api_key="k")
    offered = ["realtime", "openai-insecure-api-key.k", "openai-beta.realtime-v1"]
    with connect(service, subprotocols=offered) as ws:
        assert ws.accepted_subprotocol == "realtime"
        assert "modalities" in ws.receive_json()["session"]  # beta's session
    with connect(service, subprotocols=offered[:2]) as ws:
        assert ws.accepted_subprotocol == "realtime"
        assert "output_modalities" in ws.receive_json()["session"]  # GA's
    with pytest.raises(WebSocketDenialResponse) as denied, connect(
            service, subprotocols=["realtime", "openai-insecure-api-key.wrong"]):
        pass
    assert denied.value.status_code == 401
    # one a browser would drop (no `realtime` selected): refused with why, not opened
    with pytest.raises(WebSocketDenialResponse) as denied, connect(service, subprotocols=offered[1:]):
        pass
    assert denied.value.status_code == 400 and denied.value.json()["error"]["param"] == "subprotocols"


def test_g711_in_and_out(connect: Callable[..., Any]) -> None:
    """audio/pcmu in (a phone bridge's 8 kHz mu-law): the turn the gateway gets is its samples at
    8 kHz; audio/pcma out: the model's 24 kHz speech as A-law at 8 kHz, as it streams. Beta's
    names (g711_ulaw, g711_alaw) are the same formats."""
    from gateway.g711 import G711Encoder, g711_to_pcm16

    tone = _pcm16(24_000)  # 1 s at 24 kHz, in two pieces
    service = ScriptedService([_text("Hi"), _audio(tone[:30_000]), _audio(tone[30_000:]), _final()])
    mulaw = G711Encoder("audio/pcmu", 24_000)
    spoken = mulaw.push(_pcm16(12_000)) + mulaw.finish()  # 0.5 s at 8 kHz
    with connect(service) as ws:
        ws.receive_json()
        _push_to_talk(ws)
        ws.send_json({"type": "session.update", "session": {"audio": {
            "input": {"format": {"type": "audio/pcmu"}}, "output": {"format": {"type": "audio/pcma"}}}}})  # fmt: skip
        audio = _until(ws, "session.updated")[-1]["session"]["audio"]
        assert (audio["input"]["format"], audio["output"]["format"]) == ({"type": "audio/pcmu"}, {"type": "audio/pcma"})
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(spoken[:1001]).decode()})
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(spoken[1001:]).decode()})
        ws.send_json({"type": "input_audio_buffer.commit"})
        _until(ws, "conversation.item.done")
        ws.send_json({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
            {"type": "input_audio", "audio": base64.b64encode(spoken).decode()}]}})  # fmt: skip
        _until(ws, "conversation.item.done")
        ws.send_json({"type": "response.create"})
        events = _until(ws, "response.done")
    heard = np.frombuffer(g711_to_pcm16(spoken, "audio/pcmu"), "<i2").astype(np.float32) / 32768
    for message in service.requests[0].messages:  # the committed turn, and the item with the same bytes
        raw = message.parts[0].audio.pcm
        assert raw.sample_rate == 8_000 and np.array_equal(np.frombuffer(raw.f32le, "<f4"), heard)
    alaw = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    reference = G711Encoder("audio/pcma", 24_000)
    assert alaw == reference.push(tone) + reference.finish() and len(alaw) == 8_000
    assert sum(e["type"] == "response.output_audio.delta" for e in events) > 1  # as it streams
    assert events[-1]["response"]["audio"]["output"]["format"] == {"type": "audio/pcma"}
    # beta's names for the same formats; back to 16-bit PCM, at OpenAI's 24 kHz
    with connect(ScriptedService(), headers=BETA) as ws:
        _until(ws, "conversation.created")
        ws.send_json({"type": "session.update", "session": {"input_audio_format": "g711_ulaw",
                                                            "output_audio_format": "g711_alaw"}})  # fmt: skip
        session = _until(ws, "session.updated")[-1]["session"]
        assert (session["input_audio_format"], session["output_audio_format"]) == ("g711_ulaw", "g711_alaw")
        ws.send_json({"type": "session.update", "session": {"input_audio_format": "pcm16"}})
        assert _until(ws, "session.updated")[-1]["session"]["input_audio_format"] == "pcm16"


def test_a_reply_truncated_where_playback_stopped_loses_its_words(connect: Callable[..., Any]) -> None:
    """conversation.item.truncate (a client whose user spoke over the reply): the reply's words go
    from the conversation (the next request has no such assistant turn), as OpenAI's API drops
    them; one played to its end keeps them. Bad truncations are refused by name."""
    speech = _audio(_pcm16(2400))  # 100 ms at 24 kHz
    service = ScriptedService([_text("One two"), speech, _final()])
    with connect(service) as ws:
        ws.receive_json()
        user = _say(ws, "Count.")
        ws.send_json({"type": "response.create"})
        first = _until(ws, "response.done")[-1]["response"]["output"][0]["id"]
        ws.send_json({"type": "response.create"})
        second = _until(ws, "response.done")[-1]["response"]["output"][0]["id"]
        for body, param in [({"item_id": first, "content_index": 0, "audio_end_ms": 101}, "audio_end_ms"),
                            ({"item_id": first, "content_index": 0, "audio_end_ms": -1}, "audio_end_ms"),
                            ({"item_id": first, "content_index": 1, "audio_end_ms": 5}, "content_index"),
                            ({"item_id": first, "content_index": 0.0, "audio_end_ms": 5}, "content_index"),
                            ({"item_id": first, "content_index": 0}, "item_id"),
                            ({"item_id": user, "content_index": 0, "audio_end_ms": 0}, "item_id"),
                            ({"item_id": "nope", "content_index": 0, "audio_end_ms": 0}, "item_id")]:
            ws.send_json({"type": "conversation.item.truncate", **body})
            got = ws.receive_json()
            assert got["type"] == "error" and got["error"]["param"] == param, (body, got)
        ws.send_json({"type": "conversation.item.truncate", "item_id": first, "content_index": 0, "audio_end_ms": 40})
        truncated = ws.receive_json()
        assert {k: v for k, v in truncated.items() if k != "event_id"} == {
            "type": "conversation.item.truncated", "item_id": first, "content_index": 0, "audio_end_ms": 40}
        ws.send_json({"type": "conversation.item.truncate", "item_id": second, "content_index": 0,
                      "audio_end_ms": 100})  # played to its end
        assert ws.receive_json()["type"] == "conversation.item.truncated"
        ws.send_json({"type": "conversation.item.retrieve", "item_id": first})
        assert ws.receive_json()["item"]["content"] == [{"type": "output_audio", "transcript": ""}]
        ws.send_json({"type": "response.create"})
        _until(ws, "response.done")
    # the first reply is gone from the turns; the second, heard whole, is there
    assert [(m.role, m.content) for m in service.requests[2].messages] == [("user", ""), ("assistant", "One two")]
    assert service.requests[2].messages[0].parts[0].text == "Count."


def test_a_reply_truncated_while_it_is_made_settles_without_its_words(connect: Callable[..., Any]) -> None:
    service = ScriptedService([_text("One"), _audio(_pcm16(2400)), GATE, _text(" two"), _final()])
    with connect(service) as ws:
        ws.receive_json()
        _say(ws, "Count.")
        ws.send_json({"type": "response.create"})
        first_audio = _until(ws, "response.output_audio.delta")[-1]
        ws.send_json({"type": "conversation.item.truncate", "item_id": first_audio["item_id"], "content_index": 0,
                      "audio_end_ms": 60})  # fmt: skip
        assert ws.receive_json()["type"] == "conversation.item.truncated"
        service.gate.set()
        done = _until(ws, "response.done")
        assert done[-1]["response"]["output"][0]["content"] == [{"type": "output_audio", "transcript": ""}]
        ws.send_json({"type": "response.create"})
        _until(ws, "response.done")
    assert [m.role for m in service.requests[1].messages] == ["user"]


def test_server_vad_hears_a_g711_turn_at_8_khz(connect: Callable[..., Any]) -> None:
    """A phone bridge's mu-law stream: the turn heard at the same times as in 16-bit PCM (the VAD
    runs on the decoded 8 kHz samples), its decoded samples committed."""
    from gateway.g711 import G711Encoder, g711_to_pcm16

    service = ScriptedService()
    encoder = G711Encoder("audio/pcmu", 8_000)
    mulaw = encoder.push(_speech(rate=8_000)) + encoder.finish()
    with connect(service) as ws:
        ws.receive_json()
        ws.send_json({"type": "session.update", "session": {"audio": {"input": {
            "format": {"type": "audio/pcmu"},
            "turn_detection": {"type": "server_vad", "prefix_padding_ms": 100, "silence_duration_ms": 300}}}}})
        _until(ws, "session.updated")
        for i in range(0, len(mulaw), 160):  # 20 ms pieces, as a phone bridge sends them
            ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(mulaw[i:i + 160]).decode()})
        events = _until(ws, "response.done")
    started, stopped = events[0], events[1]
    assert (started["type"], started["audio_start_ms"]) == ("input_audio_buffer.speech_started", 500)
    assert (stopped["type"], stopped["audio_end_ms"]) == ("input_audio_buffer.speech_stopped", 1_300)
    got = service.requests[0].messages[0].parts[0].audio.pcm
    first, end = (500 - 100) * 8, (1_300 + 300) * 8
    want = np.frombuffer(g711_to_pcm16(mulaw, "audio/pcmu"), "<i2")[first:end].astype(np.float32) / 32768
    assert got.sample_rate == 8_000 and np.array_equal(np.frombuffer(got.f32le, "<f4"), want)


def test_a_transcription_session_transcribes_turns_and_makes_no_responses(connect: Callable[..., Any]) -> None:
    """?intent=transcription (or session.type transcription): live captions. Each committed turn
    (by the client, or heard by server_vad) is transcribed; no response is made, and no turn is
    kept (a caption runs for hours); the session can turn into a conversation."""
    service = ScriptedService([_text("I said"), _text(" hi"), _final()])
    with connect(service, "/v1/realtime?intent=transcription") as ws:
        session = ws.receive_json()["session"]
        assert session["type"] == "transcription" and session["object"] == "realtime.transcription_session"
        assert session["audio"]["input"]["transcription"] == {"model": None, "language": None, "prompt": None}
        assert "output_modalities" not in session and "audio" in session and "output" not in session["audio"]
        assert session["audio"]["input"]["turn_detection"] == DEFAULT_VAD
        _push_to_talk(ws)
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(_pcm16(2400)).decode()})
        ws.send_json({"type": "input_audio_buffer.commit"})
        events = _until(ws, "conversation.item.input_audio_transcription.completed")
        assert events[-1]["transcript"] == "I said hi" and events[0]["previous_item_id"] is None
        ws.send_json({"type": "conversation.item.retrieve", "item_id": events[0]["item_id"]})
        assert ws.receive_json()["error"]["code"] == "item_not_found"  # (let go once transcribed)
        ws.send_json({"type": "response.create"})
        assert ws.receive_json()["error"]["code"] == "transcription_session"
        for session, param in [({"type": "transcription", "instructions": "x"}, "session.instructions"),
                               ({"audio": {"output": {"voice": "ethan"}}}, "session.audio.output.voice"),
                               ({"type": "transcription", "audio": {"input": {"transcription": None}}},
                                "session.audio.input.transcription")]:
            ws.send_json({"type": "session.update", "session": session})
            assert ws.receive_json()["error"]["param"] == param, session
        # server_vad: heard, committed, transcribed, never answered
        ws.send_json({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
            "transcription": {"language": "de"},
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 300}}}}})  # fmt: skip
        assert ws.receive_json()["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(_speech()).decode()})
        heard = _until(ws, "conversation.item.input_audio_transcription.completed")
        assert [e["type"] for e in heard][:3] == ["input_audio_buffer.speech_started",
                                                 "input_audio_buffer.speech_stopped", "input_audio_buffer.committed"]
        assert not any(e["type"].startswith("response.") for e in heard)
        # into a conversation: it has no turns yet (none were kept)
        ws.send_json({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
            "turn_detection": None, "transcription": None}}}})  # fmt: skip
        assert ws.receive_json()["session"]["type"] == "realtime"
        ws.send_json({"type": "response.create"})
        assert ws.receive_json()["error"]["code"] == "empty_conversation"
    assert len(service.requests) == 2 and all(not r.want_audio and len(r.messages) == 1 for r in service.requests)
    with pytest.raises(WebSocketDenialResponse) as denied, connect(service, "/v1/realtime?intent=chat"):
        pass
    assert denied.value.status_code == 400 and denied.value.json()["error"]["param"] == "intent"


def test_a_beta_transcription_session(connect: Callable[..., Any]) -> None:
    service = ScriptedService([_text("Hallo"), _final()])
    with connect(service, headers=BETA) as ws:
        _until(ws, "conversation.created")
        ws.send_json({"type": "transcription_session.update", "session": {
            "input_audio_format": "g711_ulaw", "modalities": ["text"],
            "input_audio_transcription": {"model": "gpt-4o-transcribe", "language": "de"}, "turn_detection": None}})
        updated = ws.receive_json()
        assert updated["type"] == "transcription_session.updated", updated
        assert updated["session"]["input_audio_format"] == "g711_ulaw"
        assert updated["session"]["input_audio_transcription"]["language"] == "de"
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(800)).decode()})
        ws.send_json({"type": "input_audio_buffer.commit"})
        done = _until(ws, "conversation.item.input_audio_transcription.completed")
        assert done[-1]["transcript"] == "Hallo" and "conversation.item.created" in [e["type"] for e in done]
        ws.send_json({"type": "transcription_session.update", "session": {"voice": "ethan"}})
        assert ws.receive_json()["error"]["param"] == "session.voice"
    assert service.requests[0].messages[0].parts[0].audio.pcm.sample_rate == 8_000


def _tour(ws: Any, service: ScriptedService, beta: bool) -> list[dict[str, Any]]:
    """A session that makes every kind of server event; all of them, as received."""
    seen: list[dict[str, Any]] = []

    def until(kind: str) -> None:
        seen.extend(_until(ws, kind))

    def send(event: dict[str, Any], reply: str) -> None:
        ws.send_json(event)
        until(reply)

    added = "conversation.item.created" if beta else "conversation.item.done"
    until("conversation.created" if beta else "session.created")
    vad = {"type": "server_vad", "silence_duration_ms": 300}
    send({"type": "session.update", "session": {"turn_detection": vad, "input_audio_transcription": {}} if beta
          else {"audio": {"input": {"turn_detection": vad, "transcription": {}}}}}, "session.updated")  # fmt: skip
    service.script = [_text("Hi"), _audio(_pcm16(2400)), _final()]
    ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(_speech()).decode()})
    wanted = {"response.done", "conversation.item.input_audio_transcription.completed"}  # (in either order)
    while wanted:
        seen.append(ws.receive_json())
        wanted.discard(seen[-1]["type"])
    send({"type": "session.update", "session": {"turn_detection": None, "input_audio_transcription": None} if beta
          else {"audio": {"input": {"turn_detection": None, "transcription": None}}}}, "session.updated")  # fmt: skip
    send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "More."}]}}, added)  # fmt: skip
    send({"type": "response.create", "response": {"modalities": ["text"]} if beta else {"output_modalities": ["text"]}},
         "response.done")  # fmt: skip
    send({"type": "response.create", "response": {"conversation": "none", "metadata": {"k": "v"}, "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Mood?"}]}]}},
        "response.done")  # out of band  # fmt: skip
    service.script = [_text("Par"), HANG, _final()]
    ws.send_json({"type": "response.create"})
    until("response.output_audio_transcript.delta" if not beta else "response.audio_transcript.delta")
    send({"type": "response.cancel"}, "response.done")
    spoken = next(e["item"]["id"] for e in seen if e["type"] == "response.output_item.done")
    send({"type": "conversation.item.truncate", "item_id": spoken, "content_index": 0, "audio_end_ms": 50},
         "conversation.item.truncated")  # fmt: skip
    send({"type": "conversation.item.retrieve", "item_id": spoken}, "conversation.item.retrieved")
    send({"type": "conversation.item.delete", "item_id": spoken}, "conversation.item.deleted")
    ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(_pcm16(240)).decode()})
    send({"type": "input_audio_buffer.clear"}, "input_audio_buffer.cleared")
    send({"type": "no.such.event"}, "error")
    # a tool called, and its output given back
    send({"type": "session.update", "session": {"tools": [WEATHER_TOOL]}}, "session.updated")
    service.script = CALLING
    send({"type": "response.create"}, "response.done")
    call_id = seen[-1]["response"]["output"][-1]["call_id"]
    send({"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": call_id,
                                                      "output": "sunny"}}, added)  # fmt: skip
    service.script = [GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, "thinker: out of memory")]
    send({"type": "response.create"}, "response.done")
    send({"type": "session.update", "session": {"input_audio_transcription": {}} if beta
          else {"audio": {"input": {"transcription": {}}}}}, "session.updated")  # fmt: skip
    ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(_pcm16(2400)).decode()})
    send({"type": "input_audio_buffer.commit"}, "conversation.item.input_audio_transcription.failed")
    return seen


@pytest.mark.parametrize("beta", [False, True], ids=["ga", "beta"])
def test_every_event_sent_is_one_the_sdk_s_types_accept(connect: Callable[..., Any], beta: bool) -> None:
    """Each server event of a session that makes all of them validates against the official
    SDK's types for its dialect (clients generated from OpenAI's spec check them so)."""
    from openai.types.beta.realtime.realtime_server_event import RealtimeServerEvent as BetaEvent
    from openai.types.realtime.realtime_server_event import RealtimeServerEvent as GaEvent
    from pydantic import TypeAdapter, ValidationError

    types = TypeAdapter(BetaEvent if beta else GaEvent)
    service = ScriptedService()
    with connect(service, headers=BETA if beta else {}) as ws:
        events = _tour(ws, service, beta)
    made = {"session.created", "session.updated", "input_audio_buffer.speech_started",
            "input_audio_buffer.speech_stopped", "input_audio_buffer.committed", "input_audio_buffer.cleared",
            "conversation.item.added", "conversation.item.done", "conversation.item.deleted",
            "conversation.item.retrieved", "conversation.item.truncated",
            "conversation.item.input_audio_transcription.delta",
            "conversation.item.input_audio_transcription.completed",
            "conversation.item.input_audio_transcription.failed", "response.created", "response.output_item.added",
            "response.content_part.added", "response.output_audio_transcript.delta", "response.output_audio.delta",
            "response.output_audio.done", "response.output_audio_transcript.done", "response.output_text.delta",
            "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.done",
            "response.function_call_arguments.delta", "response.function_call_arguments.done", "error"}  # fmt: skip
    if beta:
        made = {BETA_NAMES.get(k, k) for k in made - {"conversation.item.done"}} | {"conversation.created"}
    assert {e["type"] for e in events} == made
    calls = [e["item"] for e in events if isinstance(e.get("item"), dict) and e["item"]["type"] == "function_call"]
    assert calls and all("content" not in c and "role" not in c for c in calls)  # (beta's message items have them)
    bad = []
    for event in events:
        try:
            parsed = types.validate_python(event)
        except ValidationError as e:
            bad.append((event["type"], str(e).splitlines()[:3]))
            continue
        if getattr(parsed, "type", None) != event["type"]:
            bad.append((event["type"], f"read as {type(parsed).__name__}"))
    assert not bad, bad


@pytest.mark.parametrize("wait", [True, False], ids=["truncate-after-done", "truncate-at-once"])
def test_a_reply_cancelled_then_truncated_loses_its_words(connect: Callable[..., Any], wait: bool) -> None:
    """A voice client's interruption (OpenAI's agents SDK): response.cancel, then truncate where
    playback stopped, even at all the audio it got. A cut reply's words run ahead of its speech,
    so they go, whether the truncate comes before or after the reply settles."""
    service = ScriptedService([_text("One two three four"), _audio(_pcm16(2400)), HANG, _final()])
    with connect(service) as ws:
        ws.receive_json()
        _say(ws, "Count.")
        ws.send_json({"type": "response.create"})
        delta = _until(ws, "response.output_audio.delta")[-1]
        ws.send_json({"type": "response.cancel"})
        if wait:
            assert _until(ws, "response.done")[-1]["response"]["status"] == "cancelled"
        ws.send_json({"type": "conversation.item.truncate", "item_id": delta["item_id"], "content_index": 0,
                      "audio_end_ms": 100})  # all it got  # fmt: skip
        wanted = {"conversation.item.truncated", "response.done"} - ({"response.done"} if wait else set())
        while wanted:  # (in either order: the reply may settle before or after the truncate is read)
            event = ws.receive_json()
            wanted.discard(event["type"])
            if event["type"] == "response.done" and "conversation.item.truncated" not in wanted:  # settled after
                assert event["response"]["output"][0]["content"] == [{"type": "output_audio", "transcript": ""}]
        service.script = REPLY
        ws.send_json({"type": "response.create"})
        _until(ws, "response.done")
    assert [m.role for m in service.requests[1].messages] == ["user"]


def test_a_transcription_session_captions_in_order_within_its_bound(connect: Callable[..., Any]) -> None:
    """Turns committed faster than they are transcribed: transcribed one after another (captions
    in order), their audio counted towards media.max_request_bytes until done (a client cannot
    run the gateway's every seat); switching kinds resets transcription to the kind's default."""
    service = ScriptedService([GATE, _text("words"), _final()], max_request_bytes=65_536)
    pcm = _pcm16(8000)  # 16 KB, 32 KB as float32: two such turns waiting leave no room for a third
    with connect(service, "/v1/realtime?intent=transcription") as ws:
        ws.receive_json()
        _push_to_talk(ws)
        ids = []
        for _ in range(2):
            ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})
            ws.send_json({"type": "input_audio_buffer.commit"})
            ids.append(_until(ws, "conversation.item.done")[0]["item_id"])
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})
        assert ws.receive_json()["error"]["code"] == "conversation_too_large"  # two turns' audio wait
        service.gate.set()
        done = [e for e in _until(ws, "conversation.item.input_audio_transcription.completed") +
                _until(ws, "conversation.item.input_audio_transcription.completed")
                if e["type"].endswith(".completed")]  # fmt: skip
        assert [e["item_id"] for e in done] == ids
        first, second = (r.request_id for r in service.requests)
        assert service.log == [("start", first), ("end", first), ("start", second), ("end", second)]  # one by one
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})
        ws.send_json({"type": "input_audio_buffer.clear"})
        assert ws.receive_json()["type"] == "input_audio_buffer.cleared"  # (room again: nothing waits)
        ws.send_json({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "x"}]}})  # fmt: skip
        assert ws.receive_json()["error"]["code"] == "transcription_session"
        ws.send_json({"type": "session.update", "session": {"type": "realtime"}})
        assert ws.receive_json()["session"]["audio"]["input"]["transcription"] is None
        ws.send_json({"type": "session.update", "session": {"type": "transcription"}})
        assert ws.receive_json()["session"]["audio"]["input"]["transcription"] is not None


def test_out_of_band_responses_answer_beside_the_conversation(connect: Callable[..., Any]) -> None:
    """response.conversation: none: a response beside the conversation's (a classifier, a
    summary), at the same time as it; its context the conversation or `input` (items given
    whole or by reference); its item joins no conversation. response.cancel names one."""
    service = ScriptedService([_text("Par"), HANG, _final()])
    with connect(service) as ws:
        ws.receive_json()
        hello = _say(ws, "Hello")
        ws.send_json({"type": "response.create"})  # the conversation's, hanging
        in_band = _until(ws, "response.output_audio_transcript.delta")[0]["response"]["id"]
        service.script = [_text("positive"), _final()]
        ws.send_json({"type": "response.create", "response": {
            "conversation": "none", "output_modalities": ["text"], "metadata": {"task": "sentiment"},
            "input": [{"type": "item_reference", "id": hello},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Mood?"}]}]}})
        events = _until(ws, "response.done")
        done = events[-1]["response"]
        assert done["id"] != in_band and done["status"] == "completed" and done["conversation_id"] is None
        assert done["metadata"] == {"task": "sentiment"} and done["output"][0]["content"][0]["text"] == "positive"
        assert not any(e["type"].startswith("conversation.item.") for e in events)  # (no conversation's item)
        oob = service.requests[1]
        assert [(m.role, m.parts[0].text) for m in oob.messages] == [("user", "Hello"), ("user", "Mood?")]
        # one out of band without input reads the conversation; cancelled by its id
        service.script = [_text("x"), HANG, _final()]
        ws.send_json({"type": "response.create", "response": {"conversation": "none"}})
        side = _until(ws, "response.created")[-1]["response"]["id"]
        ws.send_json({"type": "response.cancel", "response_id": side})
        cancelled = _until(ws, "response.done")[-1]["response"]
        assert (cancelled["id"], cancelled["status"]) == (side, "cancelled")  # (the conversation's goes on)
        ws.send_json({"type": "response.cancel"})  # the conversation's own
        cut = _until(ws, "response.done")[-1]["response"]
        assert cut["id"] == in_band and cut["status"] == "cancelled" and cut["conversation_id"] is not None
        service.script = REPLY
        ws.send_json({"type": "response.create"})
        _until(ws, "response.done")
    # the conversation has its own reply alone (the out-of-band ones joined it not)
    assert [m.role for m in service.requests[-1].messages] == ["user", "assistant"]
    assert [m.role for m in service.requests[2].messages] == ["user"]  # the conversation then (its reply: no words yet)
    assert service.requests[-1].messages[1].content == "Par"


def test_a_client_that_only_streams_is_answered(connect: Callable[..., Any]) -> None:
    """server_vad is on by default, as in OpenAI's API: a client written for it streams its
    microphone and waits; its turn is heard, committed and answered."""
    service = ScriptedService()
    with connect(service) as ws:
        assert ws.receive_json()["session"]["audio"]["input"]["turn_detection"] == DEFAULT_VAD
        pcm = _speech()
        for i in range(0, len(pcm), 960):  # 20 ms pieces
            ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i:i + 960]).decode()})
        events = _until(ws, "response.done")
    assert [e["type"] for e in events][:3] == ["input_audio_buffer.speech_started",
                                               "input_audio_buffer.speech_stopped", "input_audio_buffer.committed"]
    assert events[-1]["response"]["status"] == "completed" and len(service.requests) == 1


def test_with_server_vad_on_a_client_that_commits_gets_what_it_sent(connect: Callable[..., Any]) -> None:
    """server_vad is on unless the client says otherwise: a clip too quiet for it, committed by the
    client, is all there (nothing was cut as silence); a clip whose turn it heard end and answered
    leaves silence, whose commit is refused rather than made a turn of its own."""
    service = ScriptedService()
    quiet = _speech(speech_dbfs=-50.0)  # under the default threshold (-40 dBFS)
    with connect(service) as ws:
        ws.receive_json()
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(quiet).decode()})
        ws.send_json({"type": "input_audio_buffer.commit"})
        assert _until(ws, "conversation.item.done")[0]["type"] == "input_audio_buffer.committed"
        loud = _speech()
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(loud).decode()})
        _until(ws, "response.done")  # heard, committed, answered
        ws.send_json({"type": "input_audio_buffer.commit"})
        refused = ws.receive_json()
        assert refused["type"] == "error" and refused["error"]["code"] == "input_audio_buffer_commit_empty"
        # new audio after it: the client's commit takes it, quiet as it is
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(quiet).decode()})
        ws.send_json({"type": "input_audio_buffer.commit"})
        assert _until(ws, "conversation.item.done")[0]["type"] == "input_audio_buffer.committed"
    got = np.frombuffer(service.requests[0].messages[0].parts[0].audio.pcm.f32le, "<f4")
    assert np.array_equal(got, np.frombuffer(quiet, "<i2").astype(np.float32) / 32768)
    assert [m.role for m in service.requests[0].messages] == ["user", "user"] and len(service.requests) == 1


def test_out_of_band_responses_are_bounded_and_end_with_the_session(connect: Callable[..., Any]) -> None:
    """At most MAX_OUT_OF_BAND at once; a server_vad interrupt cuts only the conversation's
    response; a session's type holds while one runs; spoken ones too; a hang-up closes their
    requests; their inputs count towards the session's bound while they run."""
    from gateway.realtime import MAX_OUT_OF_BAND

    service = ScriptedService([_text("Par"), _audio(_pcm16(480)), HANG, _final()], max_request_bytes=1 << 20)
    side = {"conversation": "none", "metadata": {"task": "x"},
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Mood?"}]}]}
    with connect(service) as ws:
        ws.receive_json()
        ws.send_json({"type": "response.create", "response": {"conversation": "none", "input": []}})
        assert ws.receive_json()["error"]["param"] == "response.input"
        ws.send_json({"type": "response.create", "response": {**side, "metadata": {"k": "v" * 513}}})
        assert ws.receive_json()["error"]["param"].startswith("response.metadata")
        big = base64.b64encode(_pcm16(300_000)).decode()  # 1.2 MB as float32: past the bound
        ws.send_json({"type": "response.create", "response": {**side, "input": [{"type": "message", "role": "user",
                      "content": [{"type": "input_audio", "audio": big}]}]}})  # fmt: skip
        assert ws.receive_json()["error"]["code"] == "conversation_too_large"
        ids = []
        for _ in range(MAX_OUT_OF_BAND):  # spoken (the session's default), hanging
            ws.send_json({"type": "response.create", "response": side})
            ids.append(_until(ws, "response.output_audio.delta")[0]["response"]["id"])
        ws.send_json({"type": "response.create", "response": side})
        assert ws.receive_json()["error"]["code"] == "too_many_responses"
        ws.send_json({"type": "session.update", "session": {"type": "transcription"}})
        assert ws.receive_json()["error"]["param"] == "session.type"
        # a turn heard over them: the conversation's own answer only is what it would cut
        turn = _speech(lead_s=0.2, speech_s=0.4, tail_s=0.6)
        for i in range(0, len(turn), 960):  # 20 ms pieces
            ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(turn[i:i + 960]).decode()})
        events = _until(ws, "response.output_audio.delta")
        assert "input_audio_buffer.committed" in [e["type"] for e in events]
        assert not any(e["type"] in ("response.done", "error") for e in events)  # (no out-of-band one cut)
    for _ in range(500):  # (the hang-up's cancels run on the app's loop)
        if len(service.closed) == MAX_OUT_OF_BAND + 1:
            break
        time.sleep(0.01)
    assert set(ids) <= set(service.closed) and len(service.closed) == MAX_OUT_OF_BAND + 1  # the hang-up closed all


def test_server_vad_s_idle_timeout_answers_a_silence(connect: Callable[..., Any]) -> None:
    """idle_timeout_ms (a phone call's "are you still there?"): counted in the audio the client
    streams (here mu-law at 8 kHz, the reply at 24 kHz), from where the reply's speech ends
    playing; that silence becomes a user turn and is answered. Off again, it waits no more."""
    from openai.types.realtime.input_audio_buffer_timeout_triggered import InputAudioBufferTimeoutTriggered

    from gateway.g711 import G711Encoder

    service = ScriptedService([GATE, _text("Hi"), _audio(_pcm16(4800)), _final()])  # its speech: 200 ms

    def mulaw(pcm16: bytes) -> bytes:
        encoder = G711Encoder("audio/pcmu", 8_000)
        return encoder.push(pcm16) + encoder.finish()

    def stream(data: bytes) -> None:
        for i in range(0, len(data), 160):  # 20 ms pieces, as a phone bridge sends them
            ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(data[i:i + 160]).decode()})

    vad = {"type": "server_vad", "silence_duration_ms": 300}
    silence = mulaw(bytes(2 * 16_000))  # 2 s
    with connect(service) as ws:
        ws.receive_json()
        ws.send_json({"type": "session.update", "session": {"audio": {"input": {
            "format": {"type": "audio/pcmu"}, "turn_detection": {**vad, "idle_timeout_ms": 1000}}}}})  # fmt: skip
        assert _until(ws, "session.updated")[-1]["session"]["audio"]["input"]["turn_detection"]["idle_timeout_ms"] \
            == 1000  # fmt: skip
        stream(mulaw(_speech(rate=8_000, lead_s=0.2, speech_s=0.5, tail_s=0.4)))  # 1.1 s: a turn
        _until(ws, "response.created")
        service.gate.set()  # (the reply ends once all 1.1 s are in: its speech plays from there)
        _until(ws, "response.done")
        stream(silence)
        events = _until(ws, "response.done")
        # turned off, a pending one waits no more (a clear's answer ends what was sent)
        ws.send_json({"type": "session.update", "session": {"audio": {"input": {"turn_detection": vad}}}})
        _until(ws, "session.updated")
        stream(silence)
        ws.send_json({"type": "input_audio_buffer.clear"})
        after = _until(ws, "input_audio_buffer.cleared")
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["input_audio_buffer.timeout_triggered", "input_audio_buffer.committed"], kinds
    fired = InputAudioBufferTimeoutTriggered.model_validate(events[0])
    # from 1.1 s (the reply's end) + 0.2 s (its speech played) to 1 s on
    assert (fired.audio_start_ms, fired.audio_end_ms) == (1300, 2300) and fired.item_id == events[1]["item_id"]
    assert events[-1]["response"]["status"] == "completed" and len(service.requests) == 2
    silent_turn = service.requests[1].messages[-1].parts[0].audio.pcm
    assert silent_turn.sample_rate == 8_000 and len(silent_turn.f32le) // 4 == 8_000  # its 1 s
    assert [e["type"] for e in after] == ["input_audio_buffer.cleared"]


def test_truncation_leaves_the_oldest_turns_out_of_later_responses(connect: Callable[..., Any]) -> None:
    """OpenAI's default, "auto": a conversation over the model's length less the output tokens
    leaves out its oldest turns (the gateway's prompt build finds how many: prompt_fit.py); the
    responses after it leave them out too, and the items stay in the conversation. "disabled":
    the response fails instead; `retention_ratio` comes down further, within `post_instructions`."""
    service = ScriptedService()
    service.drop = [2]
    with connect(service) as ws:
        assert ws.receive_json()["session"]["truncation"] == "auto"
        ws.send_json({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        _until(ws, "session.updated")
        first = [_say(ws, f"turn {i}") for i in range(3)]
        ws.send_json({"type": "response.create"})
        _until(ws, "response.done")
        fit = service.fits[0]
        assert fit is not None and (fit.limit, fit.ratio, fit.fixed) == (512, 1.0, 0)  # 1024 less half (inf)
        _say(ws, "turn 3")
        ws.send_json({"type": "response.create", "response": {"max_output_tokens": 100}})
        _until(ws, "response.done")
        texts = [m.parts[0].text if m.parts else m.content for m in service.requests[1].messages]
        assert texts == ["turn 2", "Hello", "turn 3"] and service.fits[1].limit == 924  # type: ignore[union-attr]
        ws.send_json({"type": "conversation.item.retrieve", "item_id": first[0]})  # (still there)
        assert _until(ws, "conversation.item.retrieved")[-1]["item"]["id"] == first[0]
        ratio = {"type": "retention_ratio", "retention_ratio": 0.5, "token_limits": {"post_instructions": 200}}
        ws.send_json({"type": "session.update", "session": {"truncation": ratio, "instructions": "be brief please"}})
        assert _until(ws, "session.updated")[-1]["session"]["truncation"] == ratio
        ws.send_json({"type": "response.create"})
        _until(ws, "response.done")
        fit = service.fits[2]
        assert fit is not None and (fit.limit, fit.ratio, fit.fixed, fit.instructions, fit.post_instructions) == (
            1024 - 512, 0.5, 1, "be brief please", 200)  # (the instructions counted where the prompt is built)
        ws.send_json({"type": "session.update", "session": {"truncation": "disabled"}})
        assert _until(ws, "session.updated")[-1]["session"]["truncation"] == "disabled"
        ws.send_json({"type": "response.create"})
        _until(ws, "response.done")
        assert service.fits[3] is None


def test_truncation_leaves_out_turns_not_wordless_replies_and_not_a_deleted_items_new_namesake(
        connect: Callable[..., Any]) -> None:  # fmt: skip
    """The turns a prompt left out are the request's messages, so a reply with no words (not one)
    is not counted among them; an item deleted while its response ran is not left out once it
    is gone (a new item of its id is a turn of the next prompt, as a review found); what is left
    out no longer counts towards the session's bound; it stays out after truncation is disabled."""
    service = ScriptedService([_text("Par"), GATE, _final()])
    service.drop = [1]

    def item(role: str, text: str, **extra: Any) -> dict[str, Any]:
        kind = "input_text" if role == "user" else "output_text"
        return {"type": "message", "role": role, "content": [{"type": kind, "text": text}], **extra}

    with connect(service) as ws:
        ws.receive_json()
        ws.send_json({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        _until(ws, "session.updated")
        for raw in (item("assistant", ""), item("user", "a", id="a"), item("user", "b", id="b")):
            ws.send_json({"type": "conversation.item.create", "item": raw})
            _until(ws, "conversation.item.done")
        ws.send_json({"type": "response.create"})
        _until(ws, "response.created")
        ws.send_json({"type": "conversation.item.delete", "item_id": "a"})  # (the turn its prompt leaves out)
        _until(ws, "conversation.item.deleted")
        service.gate.set()
        _until(ws, "response.done")
        service.gate.clear()
        ws.send_json({"type": "conversation.item.create", "item": item("user", "a again", id="a")})
        _until(ws, "conversation.item.done")
        service.script = REPLY
        ws.send_json({"type": "response.create"})
        _until(ws, "response.done")
        texts = [m.parts[0].text if m.parts else m.content for m in service.requests[1].messages]
        assert texts == ["b", "Par", "a again"], texts
        ws.send_json({"type": "conversation.item.create", "previous_item_id": "root", "item": item("assistant", "")})
        _until(ws, "conversation.item.done")
        service.drop = [2]  # "b" and the reply "Par" go (not the replies with no words before them)
        ws.send_json({"type": "response.create"})
        _until(ws, "response.done")
        ws.send_json({"type": "session.update", "session": {"truncation": "disabled"}})
        _until(ws, "session.updated")
        ws.send_json({"type": "response.create"})
        _until(ws, "response.done")
        texts = [m.parts[0].text if m.parts else m.content for m in service.requests[3].messages]
        assert texts == ["a again", "Hello", "Hello"], texts
        ws.send_json({"type": "conversation.item.retrieve", "item_id": "b"})  # (still in the conversation)
        assert _until(ws, "conversation.item.retrieved")[-1]["item"]["content"][0]["text"] == "b"


def test_turns_truncation_left_out_no_longer_fill_the_sessions_bound(connect: Callable[..., Any]) -> None:
    """A long spoken session reaches media.max_request_bytes however it is truncated unless what
    is left out stops counting: its media go (the items stay, their words kept, as events show
    them); a reference to one in response.input is its words alone."""
    service = ScriptedService(max_request_bytes=64 * 1024)
    service.drop = [3]
    audio = base64.b64encode(_pcm16(4000)).decode()  # 16 KB as float samples

    def spoken(item_id: str) -> None:
        ws.send_json({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "id": item_id,
                      "content": [{"type": "input_audio", "audio": audio}, {"type": "input_text", "text": "hm"}]}})
        _until(ws, "conversation.item.done")

    with connect(service) as ws:
        ws.receive_json()
        ws.send_json({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}},
                                                            "output_modalities": ["text"]}})  # fmt: skip
        _until(ws, "session.updated")
        for i in range(3):
            spoken(f"a{i}")
        ws.send_json({"type": "response.create"})  # (its prompt leaves the three turns out)
        _until(ws, "response.done")
        for i in range(3):  # 48 KB more: room again (96 KB in all)
            spoken(f"b{i}")
        ws.send_json({"type": "response.create"})
        assert _until(ws, "response.done")[-1]["response"]["status"] == "completed"
        ws.send_json({"type": "response.create", "response": {"conversation": "none", "input": [
            {"type": "item_reference", "id": "a0"}]}})  # fmt: skip
        _until(ws, "response.done")
    kinds = [[p.WhichOneof("kind") for p in m.parts] for m in service.requests[1].messages if m.role == "user"]
    assert kinds == [["audio", "text"]] * 3, kinds
    (left,) = service.requests[2].messages
    assert [p.text for p in left.parts] == ["hm"]


def test_include_asks_for_transcription_logprobs_and_null_clears_it(connect: Callable[..., Any]) -> None:
    logprobs = "item.input_audio_transcription.logprobs"
    with connect(ScriptedService()) as ws:
        ws.receive_json()
        for include, shown in (([logprobs, logprobs], [logprobs]), (None, None), ([logprobs], [logprobs]), ([], None)):
            ws.send_json({"type": "session.update", "session": {"include": include}})
            assert ws.receive_json()["session"]["include"] == shown, include


WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}  # fmt: skip
CALLING = [_text("Let me check. <tool_"), _audio(b"\x01\x02"),
           _text('call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'), _final()]


@pytest.mark.parametrize("modality", ["audio", "text"])
def test_a_response_that_calls_a_tool_makes_function_call_items(connect: Callable[..., Any], modality: str) -> None:
    """Tools in the session: the request renders them; a reply that calls one streams its words
    before the call, then a function_call item (its arguments, done); the client's
    function_call_output and the call go back into the next request as the chat door's turns."""
    import json

    service = ScriptedService(CALLING)
    with connect(service) as ws:
        _until(ws, "session.created")
        ws.send_json({"type": "session.update", "session": {"tools": [WEATHER_TOOL], "output_modalities": [modality]}})
        assert _until(ws, "session.updated")[-1]["session"]["tools"] == [WEATHER_TOOL]
        _say(ws, "Weather in Paris?")
        ws.send_json({"type": "response.create"})
        events = _until(ws, "response.done")
        req = service.requests[-1]
        assert [json.loads(t) for t in req.tools] == [{"type": "function", "function": {
            k: v for k, v in WEATHER_TOOL.items() if k != "type"}}]  # fmt: skip
        words = "".join(e["delta"] for e in events if e["type"].endswith("transcript.delta")
                        or e["type"] == "response.output_text.delta")  # fmt: skip
        assert words == "Let me check."
        calls = [e for e in events if e["type"] == "response.output_item.added" and e["output_index"] == 1]
        assert len(calls) == 1 and calls[0]["item"]["type"] == "function_call" and calls[0]["item"]["arguments"] == ""
        done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
        assert (done["name"], json.loads(done["arguments"])) == ("get_weather", {"city": "Paris"})
        output = events[-1]["response"]["output"]
        assert [i["type"] for i in output] == ["message", "function_call"] and events[-1]["response"]["status"] == (
            "completed")
        call_id = output[1]["call_id"]
        assert call_id == done["call_id"] and call_id.startswith("call_")
        # the client runs it and gives the result; the next response answers with it in view
        ws.send_json({"type": "conversation.item.create", "item": {"type": "function_call_output",
                                                                  "call_id": call_id, "output": "sunny"}})  # fmt: skip
        _until(ws, "conversation.item.done")
        service.script = [_text("It is sunny."), _final()]
        ws.send_json({"type": "response.create"})
        _until(ws, "response.done")
    turns = [(m.role, m.content, [(c.id, c.name, c.arguments) for c in m.tool_calls], m.tool_call_id)
             for m in service.requests[-1].messages]  # fmt: skip
    call = (call_id, "get_weather", '{"city": "Paris"}')
    assert turns == [("user", "", [], ""), ("assistant", "Let me check.", [call], ""), ("tool", "sunny", [], call_id)]
    assert service.requests[-1].messages[0].parts[0].text == "Weather in Paris?"


def test_tool_items_and_choices_the_session_cannot_honour_are_refused(connect: Callable[..., Any]) -> None:
    service = ScriptedService()
    with connect(service) as ws:
        _until(ws, "session.created")
        for event, param in [
            ({"type": "session.update", "session": {"tool_choice": "required"}}, "session.tool_choice"),
            ({"type": "session.update", "session": {"tools": [{"type": "function", "name": "a b"}]}},
             "session.tools[0].name"),
            ({"type": "response.create", "response": {"tool_choice": {"type": "function", "name": "f"}}},
             "response.tool_choice"),
            ({"type": "conversation.item.create", "item": {"type": "mcp_call"}}, "item.type"),
            ({"type": "conversation.item.create", "item": {"type": "function_call_output", "output": "x"}},
             "item.call_id"),
        ]:  # fmt: skip
            ws.send_json(event)
            error = _until(ws, "error")[-1]["error"]
            assert error["param"] == param, (event, error)
        # a call the client replays (as it would from an earlier session) is a turn like any
        ws.send_json({"type": "conversation.item.create", "item": {"type": "function_call", "call_id": "c1",
                                                                  "name": "f", "arguments": "{}"}})  # fmt: skip
        assert _until(ws, "conversation.item.done")[-1]["item"]["name"] == "f"


def test_truncation_leaves_a_call_out_with_its_words(connect: Callable[..., Any]) -> None:
    """A response's words and its call are one turn of the request: a truncation that leaves that
    turn out leaves both items out of the next responses (the call came back alone)."""
    service = ScriptedService(CALLING)
    with connect(service) as ws:
        _until(ws, "session.created")
        ws.send_json({"type": "session.update", "session": {"tools": [WEATHER_TOOL], "output_modalities": ["text"]}})
        _until(ws, "session.updated")
        _say(ws, "Weather in Paris?")
        ws.send_json({"type": "response.create"})
        call_id = _until(ws, "response.done")[-1]["response"]["output"][1]["call_id"]
        ws.send_json({"type": "conversation.item.create", "item": {"type": "function_call_output",
                                                                  "call_id": call_id, "output": "sunny"}})  # fmt: skip
        _until(ws, "conversation.item.done")
        service.script = [_text("It is sunny."), _final()]
        service.drop = [2]  # the first two turns: the question, and the words with the call
        _say(ws, "And tomorrow?")
        ws.send_json({"type": "response.create"})
        _until(ws, "response.done")
        ws.send_json({"type": "response.create"})
        _until(ws, "response.done")
    assert [(m.role, len(m.tool_calls)) for m in service.requests[-1].messages] == [
        ("tool", 0), ("user", 0), ("assistant", 0)]


@pytest.mark.parametrize("fields", [{}, {"parallel_tool_calls": False}, {"tool_choice": "none"}])
def test_a_responses_own_tool_fields(connect: Callable[..., Any], fields: dict[str, Any]) -> None:
    """response.create's tool_choice and parallel_tool_calls: two calls come as two items in
    order (the first alone with parallel_tool_calls false); tool_choice none leaves the tools out
    of the request (its text is then plain words)."""
    second = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    service = ScriptedService([*CALLING[:-1], _text(second), _final()])
    with connect(service) as ws:
        _until(ws, "session.created")
        ws.send_json({"type": "session.update", "session": {"tools": [WEATHER_TOOL], "output_modalities": ["text"]}})
        _until(ws, "session.updated")
        _say(ws, "Weather and time?")
        ws.send_json({"type": "response.create", "response": fields})
        events = _until(ws, "response.done")
    output = events[-1]["response"]["output"]
    if fields.get("tool_choice") == "none":
        assert not service.requests[-1].tools and [i["type"] for i in output] == ["message"]
        return
    names = [i["name"] for i in output[1:]]
    assert names == (["get_weather"] if fields else ["get_weather", "get_time"])
    added = [e["item"]["id"] for e in events if e["type"] == "conversation.item.added" and e["item"]["type"] ==
             "function_call"]  # fmt: skip
    assert added == [i["id"] for i in output[1:]]  # in the conversation in order


def test_a_spoken_reply_says_and_transcribes_only_what_comes_before_a_call(connect: Callable[..., Any]) -> None:
    """Spoken, a reply's speech ends where its first call starts: its transcript is the words
    before it, also when the call is cut short by max_output_tokens (nothing after it is said)."""
    service = ScriptedService([_text("Sure "), _text('<tool_call>\n{"name": "get_wea'), _final("length")])
    with connect(service) as ws:
        _until(ws, "session.created")
        ws.send_json({"type": "session.update", "session": {"tools": [WEATHER_TOOL]}})
        _until(ws, "session.updated")
        _say(ws, "Weather?")
        ws.send_json({"type": "response.create"})
        events = _until(ws, "response.done")
    done = next(e for e in events if e["type"] == "response.output_audio_transcript.done")
    assert done["transcript"] == "Sure" and events[-1]["response"]["status"] == "incomplete"


def test_tools_a_response_could_not_be_made_with_are_refused_where_set(connect: Callable[..., Any]) -> None:
    service = ScriptedService()
    service.call_start = None  # a tokenizer whose calls do not start with one token: no speech with tools
    with connect(service) as ws:
        _until(ws, "session.created")
        ws.send_json({"type": "session.update", "session": {"tools": [WEATHER_TOOL]}})
        error = _until(ws, "error")[-1]["error"]
        assert error["param"] == "session.tools" and "one token" in error["message"]
        ws.send_json({"type": "session.update", "session": {"tools": [WEATHER_TOOL], "output_modalities": ["text"]}})
        assert _until(ws, "session.updated")[-1]["session"]["tools"] == [WEATHER_TOOL]
        service.template_names = frozenset({"messages"})  # (a template that renders no tools)
        ws.send_json({"type": "response.create", "response": {"tools": [WEATHER_TOOL]}})
        error = _until(ws, "error")[-1]["error"]
        assert error["param"] == "response.tools" and "takes no tools" in error["message"]


def test_a_tool_nested_too_deep_or_a_bad_call_name_is_refused_where_given(connect: Callable[..., Any]) -> None:
    deep: Any = 1
    for _ in range(400):
        deep = {"a": deep}
    service = ScriptedService()
    with connect(service) as ws:
        _until(ws, "session.created")
        ws.send_json({"type": "session.update", "session": {"tools": [{**WEATHER_TOOL, "parameters": deep}]}})
        assert _until(ws, "error")[-1]["error"]["param"] == "session.tools[0]"
        bad = {"type": "function_call", "call_id": "c", "name": 'a"}<|im_end|>', "arguments": "{}"}
        ws.send_json({"type": "conversation.item.create", "item": bad})
        assert _until(ws, "error")[-1]["error"]["param"] == "item.name"


@pytest.mark.parametrize("modality", ["audio", "text"])
def test_a_reply_that_only_calls_has_no_message_item(connect: Callable[..., Any], modality: str) -> None:
    """As OpenAI's API gives it: a reply that only calls a tool is its function_call item alone
    (output_index 0, no message item, no content part); a reply with words has its message item
    first, as always; one with neither (an empty reply) still has its message item."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    service = ScriptedService([_text(call), _final()])
    with connect(service) as ws:
        _until(ws, "session.created")
        ws.send_json({"type": "session.update", "session": {"tools": [WEATHER_TOOL], "output_modalities": [modality]}})
        _until(ws, "session.updated")
        asked = _say(ws, "Weather?")
        ws.send_json({"type": "response.create"})
        events = _until(ws, "response.done")
        added = [e for e in events if e["type"] == "response.output_item.added"]
        assert [(e["output_index"], e["item"]["type"]) for e in added] == [(0, "function_call")]
        assert not [e for e in events if e["type"].startswith("response.content_part")]
        output = events[-1]["response"]["output"]
        assert [i["type"] for i in output] == ["function_call"] and events[-1]["response"]["status"] == "completed"
        joined = next(e for e in events if e["type"] == "conversation.item.added")
        assert joined["previous_item_id"] == asked and joined["item"]["id"] == output[0]["id"]
        for script, kinds in (([_text("Sunny."), _final()], ["message"]), ([_final()], ["message"])):
            service.script = script
            ws.send_json({"type": "response.create"})
            assert [i["type"] for i in _until(ws, "response.done")[-1]["response"]["output"]] == kinds
    first_answer = service.requests[1].messages
    assert [(m.role, m.content, len(m.tool_calls)) for m in first_answer] == [("user", "", 0), ("assistant", "", 1)]


def _consistency(events: list[dict[str, Any]]) -> list[str]:
    """What is wrong with one response's events (from a review): every content event of an item
    after its output_item.added and content part, each item added once and done once, and
    response.done's output the items done, at output indexes 0, 1, ..."""
    bad: list[str] = []
    added: dict[str, int] = {}
    parts: set[str] = set()
    done: list[str] = []
    for n, e in enumerate(events):
        kind, item_id = e["type"], e.get("item_id")
        if kind == "response.output_item.added":
            bad += [f"{n}: {item_id} added twice"] if e["item"]["id"] in added else []
            added[e["item"]["id"]] = e["output_index"]
        elif kind == "response.content_part.added":
            bad += [] if item_id in added else [f"{n}: a content part of an item not added"]
            parts.add(item_id)
        elif kind.startswith(("response.output_text", "response.output_audio", "response.content_part.done")):
            bad += [] if item_id in parts else [f"{n}: {kind} of an item with no content part"]
        elif kind == "response.output_item.done":
            bad += [] if e["item"]["id"] in added else [f"{n}: done for an item not added"]
            done.append(e["item"]["id"])
        elif kind == "response.done":
            output = [i["id"] for i in e["response"]["output"]]
            bad += [] if output == done else [f"output {output}, done {done}"]
            bad += [] if [added.get(i) for i in output] == list(range(len(output))) else ["output indexes"]
    return bad


_FAILED = GatewayError(grpc.StatusCode.INTERNAL, "boom")
_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
_PATHS = {
    "cancel before words": [HANG, _final()],
    "cancel after words": [_text("Hi"), _audio(b"\x01\x02" * 50), HANG, _final()],
    "failed before words": [_FAILED],
    "failed after words": [_text("Hi"), _audio(b"\x01\x02"), _FAILED],
    "call cut by length": [_text(_CALL), _text('<tool_call>\n{"name"'), _final("length")],
    "words cut by length": [_text("Hi <tool"), _final("length")],
    "out of band": [_text(_CALL), _final()],
    "words then call": [_text("Sure. "), _audio(b"\x01\x02" * 10), _text(_CALL), _final()],
    "call only": [_text(_CALL), _final()],
    "malformed call": [_text("<tool_call>\n{bad}\n</tool_call>"), _final()],
    "empty": [_final()],
    "two calls": [_text(_CALL + _CALL), _final()],
}


@pytest.mark.parametrize("path", list(_PATHS))
@pytest.mark.parametrize("modality", ["audio", "text"])
def test_every_way_a_reply_with_tools_ends_announces_its_items_in_order(connect: Callable[..., Any], path: str,
                                                                       modality: str) -> None:  # fmt: skip
    service = ScriptedService(_PATHS[path])
    with connect(service) as ws:
        _until(ws, "session.created")
        ws.send_json({"type": "session.update", "session": {"tools": [WEATHER_TOOL], "output_modalities": [modality],
                                                            "audio": {"input": {"turn_detection": None}}}})  # fmt: skip
        _until(ws, "session.updated")
        _say(ws, "Weather?")
        ws.send_json({"type": "response.create", "response": {"conversation": "none"} if path == "out of band" else {}})
        events = _until(ws, "response.created")
        if path.startswith("cancel"):
            if path == "cancel after words":
                events += _until(ws, "response.output_audio.delta" if modality == "audio"
                                 else "response.output_text.delta")  # fmt: skip
            ws.send_json({"type": "response.cancel"})
        events += _until(ws, "response.done")
    assert not _consistency(events), (_consistency(events), [e["type"] for e in events])


def test_a_cancel_while_a_reply_is_announced_still_announces_it(connect: Callable[..., Any],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A slow socket holds the message item's announcement while response.cancel comes: the rest
    of it still goes out before the item's done events (a review's case)."""
    from gateway import realtime

    send = realtime.RealtimeSession.send

    async def slow(self: Any, event: dict[str, Any]) -> None:
        if event.get("type") == "conversation.item.added" and event["item"].get("role") == "assistant":
            await asyncio.sleep(0.5)  # (the socket's buffer full for a moment)
        await send(self, event)

    monkeypatch.setattr(realtime.RealtimeSession, "send", slow)
    service = ScriptedService([_text("Hi"), HANG, _final()])
    with connect(service) as ws:
        _until(ws, "session.created")
        ws.send_json({"type": "session.update", "session": {"tools": [WEATHER_TOOL], "output_modalities": ["text"],
                                                            "audio": {"input": {"turn_detection": None}}}})  # fmt: skip
        _until(ws, "session.updated")
        _say(ws, "Weather?")
        ws.send_json({"type": "response.create"})
        events = _until(ws, "response.output_item.added")
        ws.send_json({"type": "response.cancel"})
        events += _until(ws, "response.done")
    kinds = [e["type"] for e in events]
    assert not _consistency(events) and "conversation.item.added" in kinds, kinds


@pytest.mark.parametrize("reply", ["words", "call"])
def test_a_reply_joins_the_conversation_where_it_started(connect: Callable[..., Any], reply: str) -> None:
    """A turn added while a reply is made comes after it, as it did when the reply's item joined at
    once: with tools the item joins at its first words, or its calls at the end (a review's case)."""
    service = ScriptedService([GATE, _text("Sunny." if reply == "words" else _CALL), _final()])
    with connect(service) as ws:
        _until(ws, "session.created")
        ws.send_json({"type": "session.update", "session": {"tools": [WEATHER_TOOL], "output_modalities": ["text"],
                                                            "audio": {"input": {"turn_detection": None}}}})  # fmt: skip
        _until(ws, "session.updated")
        asked = _say(ws, "Weather?")
        ws.send_json({"type": "response.create"})
        _until(ws, "response.created")
        later = _say(ws, "And a joke?")
        service.gate.set()
        events = _until(ws, "response.done")
        joined = next(e for e in events if e["type"] == "conversation.item.added")
        service.script = [_final()]
        ws.send_json({"type": "response.create"})
        _until(ws, "response.done")
    assert joined["previous_item_id"] == asked and later
    assert [m.role for m in service.requests[-1].messages] == ["user", "assistant", "user"]


def test_g711_s_tail_goes_with_an_announced_item(connect: Callable[..., Any]) -> None:
    """The resampler's tail of a reply with no words but a little audio before its call: its
    item is announced before the tail (a review's case)."""
    service = ScriptedService([_text("\n"), _audio(b"\x10\x00" * 100), _text(_CALL), _final()])
    with connect(service) as ws:
        _until(ws, "session.created")
        ws.send_json({"type": "session.update", "session": {"tools": [WEATHER_TOOL], "audio": {
            "input": {"turn_detection": None}, "output": {"format": {"type": "audio/pcmu"}}}}})  # fmt: skip
        _until(ws, "session.updated")
        _say(ws, "Weather?")
        ws.send_json({"type": "response.create"})
        events = _until(ws, "response.done")
    assert not _consistency(events), [e["type"] for e in events]
