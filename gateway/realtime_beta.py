"""The Realtime API's beta dialect: what `client.beta.realtime.connect()` and the clients written
before the API's GA release speak (`OpenAI-Beta: realtime=v1`, or a browser's
`openai-beta.realtime-v1` subprotocol). It is the same session with other names: a flat session
(`modalities`, `voice`, `input_audio_format`, `turn_detection`, ...), `response.audio.delta`
for `response.output_audio.delta`, `conversation.item.created` for `.added`, content parts
`audio` / `text` for `output_audio` / `output_text`. gateway/realtime.py serves the GA API alone;
a beta client's events are translated at the socket's edge: `to_ga` on the way in, `to_beta` on
the way out. What the GA form refuses a beta client is refused too, named as beta names it
(`beta_error`)."""

from __future__ import annotations

from typing import Any

from gateway.realtime_turns import RealtimeError

__all__ = ["BETA_SUBPROTOCOL", "GaFieldError", "beta_error", "is_beta", "to_beta", "to_ga"]

BETA_SUBPROTOCOL = "openai-beta.realtime-v1"

# beta audio format names <-> GA's (beta's pcm16 is 24 kHz, as GA's audio/pcm by default)
_FORMATS = {"pcm16": {"type": "audio/pcm", "rate": 24_000}, "g711_ulaw": {"type": "audio/pcmu"},
            "g711_alaw": {"type": "audio/pcma"}}  # fmt: skip
_FORMAT_NAMES = {fmt["type"]: name for name, fmt in _FORMATS.items()}

# a beta session's (or response's) field -> where GA has it
_MOVES: dict[str, tuple[str, ...]] = {
    "modalities": ("output_modalities",),
    "max_response_output_tokens": ("max_output_tokens",),
    "voice": ("audio", "output", "voice"),
    "speed": ("audio", "output", "speed"),
    "output_audio_format": ("audio", "output", "format"),
    "input_audio_format": ("audio", "input", "format"),
    "input_audio_transcription": ("audio", "input", "transcription"),
    "turn_detection": ("audio", "input", "turn_detection"),
    "input_audio_noise_reduction": ("audio", "input", "noise_reduction"),
}

_GA_FIELDS = frozenset(path[0] for path in _MOVES.values())  # (GA's names for the fields beta moves)

_EVENT_NAMES = {
    "conversation.item.added": "conversation.item.created",
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
}
# (beta's `created` carries the item whole; beta has no idle timeout: its response comes unannounced)
_GA_ONLY = frozenset({"conversation.item.done", "input_audio_buffer.timeout_triggered"})
_PART_NAMES = {"output_audio": "audio", "output_text": "text"}


class GaFieldError(RealtimeError):
    """A GA field sent in the beta dialect: its refusal names it as sent (beta_error leaves it)."""


def is_beta(header: str | None, subprotocols: list[str]) -> bool:
    """The client speaks the beta dialect: its `OpenAI-Beta` header names realtime=v1 (among
    others, comma-separated), or it offered the browser's beta subprotocol."""
    named = {part.strip().lower() for part in (header or "").split(",")}
    return "realtime=v1" in named or BETA_SUBPROTOCOL in subprotocols


# ---- client events in ---------------------------------------------------------------------------


def to_ga(event: dict[str, Any]) -> dict[str, Any]:
    """A beta client event as the GA API has it (its other events are the same in both)."""
    kind = event.get("type")
    if kind == "session.update" and isinstance(event.get("session"), dict):
        return {**event, "session": _config(event["session"], input_side=True)}
    if kind == "transcription_session.update":
        session = event.get("session")
        if not isinstance(session, dict):
            return {**event, "type": "session.update"}  # (GA's checks refuse it by name)
        session = {k: v for k, v in session.items() if k != "modalities" or v != ["text"]}  # (all it gives)
        return {**event, "type": "session.update", "session": {**_config(session, True), "type": "transcription"}}
    if kind == "response.create" and isinstance(event.get("response"), dict):
        return {**event, "response": _config(event["response"], input_side=False)}
    return event


def _config(body: dict[str, Any], input_side: bool) -> dict[str, Any]:
    """A beta session's (or response's) fields where GA has them; a value GA would not read the
    same is kept as it came, for GA's checks to refuse by name. GA's own names for the fields
    beta moves are refused: two names for one field could only disagree."""
    where = "session" if input_side else "response"
    out: dict[str, Any] = {}
    for name in _GA_FIELDS & set(body):
        beta = ", ".join(k for k, v in _MOVES.items() if v[0] == name)
        raise GaFieldError(f"{where}.{name}: the GA API's; this beta session names it {beta}", f"{where}.{name}")
    for name, value in body.items():
        path = _MOVES.get(name)
        if path is None or (not input_side and path[:2] == ("audio", "input")):
            out[name] = value  # (a response has no input: GA refuses it there, as beta does)
            continue
        if name == "modalities" and isinstance(value, list) and value and all(isinstance(v, str) for v in value) \
                and set(value) <= {"audio", "text"}:  # fmt: skip
            value = ["audio"] if "audio" in value else ["text"]  # (beta's ["text", "audio"]: speech and its transcript)
        elif name.endswith("_audio_format") and isinstance(value, str) and value in _FORMATS:
            value = dict(_FORMATS[value])
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


# ---- server events out --------------------------------------------------------------------------


def to_beta(event: dict[str, Any]) -> list[dict[str, Any]]:
    """A server event as a beta client knows it: none (GA's alone), one, or, after
    `session.created`, beta's `conversation.created` too."""
    kind = event["type"]
    if kind in _GA_ONLY:
        return []
    out = {**event, "type": _EVENT_NAMES.get(kind, kind)}
    if isinstance(out.get("item"), dict):
        out["item"] = _item(out["item"])
    if isinstance(out.get("part"), dict):
        out["part"] = _part(out["part"])
    if kind in ("session.created", "session.updated") and event["session"]["type"] == "transcription":
        out["session"] = _transcription_session(event["session"])
        if kind == "session.updated":
            out["type"] = "transcription_session.updated"
    elif kind in ("session.created", "session.updated"):
        out["session"] = _session(event["session"])
    if kind in ("response.created", "response.done"):
        out["response"] = _response(event["response"])
    if kind == "session.created":
        conversation = {"type": "conversation.created",
                        "conversation": {"id": event["session"]["id"], "object": "realtime.conversation"}}
        return [out, conversation]
    return [out]


def beta_error(param: str | None, message: str) -> tuple[str | None, str]:
    """A refusal's field path (and the message it begins) as beta names the field:
    `session.audio.output.voice` is `session.voice`; a format's parts are its name's."""
    if param is None:
        return param, message
    for where in ("session", "response"):
        for name, path in _MOVES.items():
            ga = ".".join((where, *path))
            if param == ga or (param[len(ga):][:1] in (".", "[") and param.startswith(ga)):
                # (a part of a value beta spells otherwise: the field as a whole)
                rest = "" if name.endswith("_format") or name == "modalities" else param[len(ga):]
                beta = f"{where}.{name}{rest}"
                return beta, beta + message[len(param):] if message.startswith(param) else message
    return param, message


def _part(part: dict[str, Any]) -> dict[str, Any]:
    return {**part, "type": _PART_NAMES.get(part.get("type"), part.get("type"))}  # type: ignore[arg-type]


def _item(item: dict[str, Any]) -> dict[str, Any]:
    if "content" not in item:  # (a function call or its output)
        return item
    return {**item, "content": [_part(p) for p in item["content"] or []]}


def _modalities(ga: list[str]) -> list[str]:
    return ["text", "audio"] if "audio" in ga else ["text"]


def _format(fmt: dict[str, Any] | None) -> str | None:
    return None if fmt is None else _FORMAT_NAMES.get(fmt.get("type", ""), fmt.get("type"))


def _session(s: dict[str, Any]) -> dict[str, Any]:
    audio_in, audio_out = s["audio"]["input"], s["audio"]["output"]
    # (no `model`: beta's schema allows only OpenAI's names there, so a client that checks it
    # would refuse the served model's; /v1/models has it)
    out = {"id": s["id"], "object": "realtime.session",
           "modalities": _modalities(s["output_modalities"]), "instructions": s["instructions"],
           "voice": audio_out["voice"], "speed": audio_out["speed"],
           "input_audio_format": _format(audio_in["format"]), "output_audio_format": _format(audio_out["format"]),
           "input_audio_transcription": audio_in["transcription"], "turn_detection": audio_in["turn_detection"],
           "input_audio_noise_reduction": audio_in["noise_reduction"], "tools": s["tools"],
           "tool_choice": s["tool_choice"], "max_response_output_tokens": s["max_output_tokens"],
           "tracing": s["tracing"], "include": s["include"]}  # fmt: skip
    if "temperature" in s:
        out["temperature"] = s["temperature"]
    return out


def _transcription_session(s: dict[str, Any]) -> dict[str, Any]:
    audio_in = s["audio"]["input"]
    return {"id": s["id"], "object": "realtime.transcription_session", "modalities": ["text"],
            "input_audio_format": _format(audio_in["format"]), "input_audio_transcription": audio_in["transcription"],
            "turn_detection": audio_in["turn_detection"], "input_audio_noise_reduction": audio_in["noise_reduction"],
            "include": s["include"]}  # fmt: skip


def _response(r: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in r.items() if k not in ("output_modalities", "audio")}
    audio_out = r["audio"]["output"]
    out.update(modalities=_modalities(r["output_modalities"]), voice=audio_out["voice"],
               output_audio_format=_format(audio_out["format"]), output=[_item(i) for i in r["output"]])  # fmt: skip
    return out
