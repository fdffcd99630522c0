"""Gateway: client requests in (`Gateway.Generate`), one thinker call per request, text and
audio streamed back as soon as the stages produce them.

The gateway holds the tokenizer and the checkpoint's processor: it decodes the audio, images and
video of a request (gateway/media.py, off the event loop), renders the chat prompt and builds the
model inputs, detokenizes the thinker's token ids incrementally (with stop texts), and encodes
code2wav's float32 chunks in the requested audio format.

One request path (`GatewayService.serve`) serves both front doors: `Gateway.Generate` here and
the OpenAI-compatible HTTP API (gateway/http_api.py), which the same process serves next to it.
Each request's id goes back to the client (`x-request-id`) and into one access-log line when it
ends. Its gRPC health is NOT_SERVING while the thinker does not answer; it knows the health of
every stage below it from the thinker's `Info` (`chain`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from jinja2 import TemplateError

from gateway.audio_out import MAX_SPEED, MIN_SPEED, AudioEncoder, Tempo
from gateway.chat_template import FIELD as CHAT_TEMPLATE_KWARGS
from gateway.chat_template import template_kwargs, template_names
from gateway.logprobs import TokenPieces
from gateway.media import decode_messages
from gateway.media_cache import DecodedCache
from gateway.metrics import GatewayMetrics, Outcome
from gateway.prompt_fit import PromptFit, fitted, text_chars, without
from gateway.tool_calls import call_start_id, read_tools, takes_tools, tools_refusal
from omnistage.config import DeployConfig
from omnistage.engine import OutChunk
from omnistage.models import Checkpoint, PartRefused, load_tokenizer, media_inputs
from omnistage.models.sampling import TokenLogprobs
from omnistage.models.text_stream import TextStream, check_stop_texts
from omnistage.quoting import quoted
from omnistage.server.grpc_common import (
    REPLAY_BACKOFF_S,
    CancellableInput,
    ChainWatcher,
    HealthState,
    failure_status,
    lost_peer,
    stage_stream,
)
from omnistage.server.routing import Router, replica_addresses, unserved
from omnistage.server.tls import name_override, stage_channel_credentials
from omnistage.topology import STAGES, stage_def
from omnistage.v1 import gateway_pb2, gateway_pb2_grpc, stage_pb2
from omnistage.wire import DEADLINE_PASSED, ChunkAssembler, DecodedChunk, StageError, TensorBlobError, encode_chunks
from omnistage.wire.resume import Resume, Seen
from services import edges

log = logging.getLogger(__name__)
access_log = logging.getLogger("omnistage.access")
# outcomes that are the service's fault, whatever the request: their access lines are warnings
SERVER_FAULTS = frozenset({"INTERNAL", "UNAVAILABLE", "UNKNOWN", "DATA_LOSS", "UNIMPLEMENTED", "ERROR"})
DEADLINE_SLACK_S = 0.05  # a call cancelled this close to its deadline ended by it (clocks and wake-ups differ)
ACCESS_ERROR_CHARS = 500  # of a failed request's status message, in its access-log line

REQUEST_ID_KEY = "x-request-id"  # initial metadata of every Generate call
AUDIO_PIECE_BYTES = 1 << 20  # at most this much audio in one AudioChunk (4-byte aligned: whole float samples)
MAX_REQUEST_ID_CHARS = 200  # a client's request_id (the stages' id adds a suffix; they take 256)
_BAD_ID = (f"gateway: request_id must be at most {MAX_REQUEST_ID_CHARS} printable ASCII characters (it is "
           "echoed in x-request-id metadata and logged)")
_NO_KEY = "gateway: missing or wrong API key (metadata authorization: Bearer <key>)"
HEALTH_POLL_S = 1.0
ABORT_WAIT_S = 5.0  # the longest a failed call's status may take to go out before its handler ends


def _logprob_messages(ids: list[int], logprobs: list[TokenLogprobs]) -> list[gateway_pb2.TokenLogprob]:
    return [gateway_pb2.TokenLogprob(token_id=i, logprob=lp.logprob,
                                     top=[gateway_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
            for i, lp in zip(ids, logprobs, strict=True)]  # fmt: skip


def client_ids(detail: str, stage_id: str, request_id: str) -> str:
    """A stage's error text naming the request by the client's `request_id`, not the stages'
    `stage_id` for it, as written plain or quoted (`!r`: a backslash or quote in the id is escaped)."""
    return detail.replace(repr(stage_id), repr(request_id)).replace(stage_id, request_id)


class GatewayError(Exception):
    """A request the gateway ends with this status (both front doors map it)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s  # a refusal a later try may pass (a full gateway): when to try

    @property
    def deadline_passed(self) -> bool:
        """The request ran out its own deadline (the gateway's or a stage's word): a retry would
        too, where a hop that waited too long on its peer might not."""
        return self.code == grpc.StatusCode.DEADLINE_EXCEEDED and DEADLINE_PASSED in self.message


async def fail_replies(replies: AsyncGenerator[Any, None], error: GatewayError) -> None:
    """End `serve`'s generator, paused at a reply it yielded, with `error`: its access line and
    metrics say so (closed, it would count the request CANCELLED)."""
    with contextlib.suppress(GatewayError, StopAsyncIteration):
        await replies.athrow(error)


def internal_failure(request_id: str) -> GatewayError:
    """A bug, not the request: INTERNAL naming the request (grpc would say UNKNOWN)."""
    return GatewayError(grpc.StatusCode.INTERNAL, f"gateway: internal error on request {request_id} (the gateway's "
                        "log has it)")  # fmt: skip


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, request_id: str,
                 retry_after_s: float | None = None) -> None:  # fmt: skip
    """context.abort, bounded: a status queues behind the reply's unsent pieces, so for a client
    that takes none of them it would hold this handler (and the call's memory here) until the
    client went away. Past ABORT_WAIT_S the handler ends; gRPC keeps the status queued for it.
    The request's id goes in the trailing metadata too: a call that fails before its first
    message has no initial metadata at its client (gRPC sends the status alone). `retry_after_s`
    is gRPC's retry pushback, which a client with a retry policy for the status waits (HTTP's 429
    says retry-after)."""
    trailing = [(REQUEST_ID_KEY, request_id)]
    if retry_after_s is not None:
        trailing.append(("grpc-retry-pushback-ms", str(round(1000 * retry_after_s))))
    try:
        async with asyncio.timeout(ABORT_WAIT_S):
            await context.abort(code, message, trailing_metadata=tuple(trailing))
    except TimeoutError:
        raise asyncio.CancelledError from None


# the thinker's stop detail -> the reason a client sees (OpenAI's names)
FINISH_REASONS = {"stop_id": "stop", "stop_text": "stop", "max_tokens": "length"}
MAX_CHARS_PER_TOKEN = 64  # text longer than this many characters per allowed token is refused untokenized


def bad_request_id(request_id: str) -> bool:
    return len(request_id) > MAX_REQUEST_ID_CHARS or not all(" " <= c <= "~" for c in request_id)


class GatewayService(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, cfg: DeployConfig, ckpt: Checkpoint, thinker_target: str, api_key: str = "") -> None:
        ckpt.check_serves(cfg.audio_output)
        self.cfg = cfg
        self.ckpt = ckpt
        self.tokenizer = load_tokenizer(ckpt)
        self.template_names = template_names(ckpt.chat_template)  # what a request's chat_template_kwargs may set
        self.call_start = call_start_id(self.tokenizer)  # the token a tool call starts with, if one
        # the family's input builder (the checkpoint's processor); without one, text still works and
        # media requests get the reason
        self.inputs, self.no_media_reason = media_inputs(ckpt, self.tokenizer)
        if self.no_media_reason:
            log.warning("%s", self.no_media_reason)
        self.media_limits = cfg.media
        self.keeps_prefixes = bool(cfg.thinker.prefix_cache_tokens)  # the thinker's prefix cache
        if self.inputs is not None:  # never more audio than the feature extractor takes whole
            seconds = min(cfg.media.max_audio_seconds, self.inputs.max_audio_seconds)
            self.media_limits = cfg.media.model_copy(update={"max_audio_seconds": seconds})
        self.sample_rate = ckpt.sample_rate
        self.model_name = cfg.served_model_name or ckpt.name
        spec = ckpt.spec
        self.max_prompt_tokens = min(spec.max_positions, cfg.max_model_len or spec.max_positions) - 1
        self.thinker_defaults = ckpt.family.thinker_defaults(ckpt)
        self.talker_defaults = ckpt.family.talker_defaults()
        self.thinker_target = thinker_target
        self.router = Router(thinker_target, cfg.routing, cfg.max_message_bytes,
                             stage_channel_credentials(cfg.tls), name_override(cfg.tls),
                             cfg.timeouts.keepalive_s)  # fmt: skip
        self.channel = self.router.shared
        self.metrics = GatewayMetrics()
        self.media_cache: DecodedCache | None = None  # decoded media parts reused across requests
        if cfg.media.decoded_cache_bytes:
            cache = self.media_cache = DecodedCache(cfg.media.decoded_cache_bytes, self.metrics.media_lookup)
            self.metrics.media_cache_bytes.set_function(lambda: cache.bytes)
        self.active = 0
        self.draining = False
        self.api_key = api_key.strip()  # (the CLI's options.api_key refuses one that is not a token)
        self.stages = cfg.stage_names()  # the chain's processes; the first is this gateway's downstream
        # what the gRPC health follows: the thinker, or both roles of a split one
        self.thinker_roles = frozenset(s for s in self.stages if stage_def(s).stream == "thinker")
        self.watcher = ChainWatcher(self.router.health_channels(), self.stages[0], thinker_target, HEALTH_POLL_S,
                                    again=replica_addresses(thinker_target) is None,
                                    on_answer=self.router.heard)  # fmt: skip
        self.metrics.thinker_replicas_out.set_function(lambda: float(len(self.router.unanswering)))

    def _prompt(self, request: gateway_pb2.GenerateRequest, cancelled: threading.Event | None = None,
                fit: PromptFit | None = None) -> edges.Prompt:  # fmt: skip
        """The request as the thinker's prompt: ids, and the model inputs of its media (run in a
        worker thread: decoding and the processor take a while; `cancelled` stops the decoding).
        `fit`: its oldest turns left out as far as it takes to fit (prompt_fit.py). ValueError
        names the field."""
        if fit is None:
            given = sum(text_chars(m) for m in request.messages) + sum(len(t) for t in request.tools)
            chars = given if request.messages else len(request.prompt)  # `prompt` is ignored with messages
            if chars > MAX_CHARS_PER_TOKEN * self.max_prompt_tokens:  # before tokenizing: it could never fit
                raise ValueError(f"prompt: {chars} characters of text cannot fit in {self.max_prompt_tokens} tokens")
            if len(request.prompt_ids) > self.max_prompt_tokens:  # (before each id is read)
                raise ValueError(f"prompt: {len(request.prompt_ids)} tokens exceeds the model maximum of "
                                 f"{self.max_prompt_tokens}")  # fmt: skip
            prompt = self._built(request, cancelled)
        else:  # a conversation (the realtime socket's): its oldest turns left out as far as it takes
            prompt = fitted(request, fit, lambda r: self._built(r, cancelled), lambda p: len(p.ids),
                            lambda text: len(self.tokenizer.encode(text, add_special_tokens=False,
                                                                   split_special_tokens=True)),  # (as it reads)
                            MAX_CHARS_PER_TOKEN * self.max_prompt_tokens)  # fmt: skip
            if fit.dropped:
                log.info("request %s: truncation left out its %d oldest messages (%d prompt tokens; %d builds)",
                         request.request_id, fit.dropped, len(prompt.ids), fit.builds)  # fmt: skip
        if self.keeps_prefixes and prompt.multimodal:  # (only the prompt kept: not every build `fit` tried)
            # the thinker tells a cached prefix's media apart by these (made here, off its engine thread)
            prompt.digests = self.inputs.digests(prompt.multimodal, prompt.use_audio_in_video)  # type: ignore[union-attr]
        limit = self.max_prompt_tokens
        if len(prompt.ids) > limit:
            if fit is not None:  # (refused: it left nothing out of the conversation)
                fit.dropped = 0
            raise ValueError(f"prompt: {len(prompt.ids)} tokens exceeds the model maximum of {limit} (the model "
                             f"length, {limit + 1}, keeps one for the reply)")
        return prompt

    def _built(self, request: gateway_pb2.GenerateRequest, cancelled: threading.Event | None) -> edges.Prompt:
        """`_prompt`'s build, whatever its length."""
        if request.raw_prompt:
            return self._raw(request.prompt, request.prompt_ids)
        kwargs = template_kwargs(request.chat_template_kwargs, self.template_names)
        if request.tools:
            kwargs["tools"] = self._tools(request)
        elif not takes_tools(self.template_names):  # an earlier turn's calls or their results
            used = next((f"messages[{i}]" + (".tool_calls" if m.tool_calls else "")
                         for i, m in enumerate(request.messages) if m.tool_calls or m.role == "tool"),
                        None)  # fmt: skip
            if used is not None:
                raise ValueError(f"{used}: this checkpoint's chat template takes no tools")
        if request.messages:
            # A conversation with no user text is served as OpenAI serves it (a system prompt alone, a
            # user turn left empty): the template renders it and the model answers it.
            messages, has_media = decode_messages(request, self.media_limits, self._audio_rate(), cancelled,
                                                  self.media_cache)
        else:
            if not request.prompt.strip():
                raise ValueError("prompt: empty prompt")
            messages, has_media = [{"role": "user", "content": request.prompt}], False
        if has_media:
            if self.inputs is None:
                raise ValueError(f"messages: {self.no_media_reason}")
            try:
                ids, tensors = self.inputs.build(messages, request.use_audio_in_video, kwargs)
            except PartRefused:  # named already
                raise
            except (ValueError, TypeError, KeyError, IndexError, RuntimeError, TemplateError) as e:  # the processor's
                field = CHAT_TEMPLATE_KWARGS if kwargs and isinstance(e, TemplateError) else "messages"
                raise ValueError(f"{field}: cannot build the model inputs: {type(e).__name__}: {e}") from None
            prompt = edges.Prompt(ids, tensors, request.use_audio_in_video)
        else:
            try:
                prompt = edges.Prompt(self.ckpt.family.prompt_ids(self.tokenizer, messages, kwargs))
            except (ValueError, TypeError, KeyError, IndexError, TemplateError) as e:  # the template's refusals
                field = CHAT_TEMPLATE_KWARGS if kwargs else "messages"  # (rendering is all it does)
                raise ValueError(f"{field}: cannot render the chat template: {type(e).__name__}: {e}") from None
        return prompt

    def _raw(self, prompt: str, given: Sequence[int] = ()) -> edges.Prompt:
        """A raw prompt's ids: `given`, else its text as the tokenizer reads it (special-token text
        is those tokens, as vLLM's completions read a prompt), with none that stands for media."""
        if not prompt and not given:
            raise ValueError("prompt: empty prompt")
        ids = [int(i) for i in given] if given else [int(i) for i in self.tokenizer.encode(prompt)]
        vocab = self.ckpt.spec.thinker_vocab
        if bad := [i for i in ids if not 0 <= i < vocab][:8]:
            raise ValueError(f"prompt: ids outside the vocabulary (0 to {vocab - 1}): {bad}")
        # (the pads, and an audio's opening token, which the thinker counts as an audio item)
        media = {*self.ckpt.spec.multimodal_ids, self.ckpt.spec.audio_start_id}
        if (stand_in := next((i for i in ids if i in media), None)) is not None:
            token = self.tokenizer.convert_ids_to_tokens(stand_in)
            raise ValueError(f"prompt: {quoted(token)} stands for audio, an image or a video, which a raw prompt "
                             "cannot carry (send them as chat messages)")  # fmt: skip
        return edges.Prompt(ids)

    def _tools(self, request: gateway_pb2.GenerateRequest) -> list[dict[str, Any]]:
        """The request's tools, as its template renders them (ValueError naming the field)."""
        if why := tools_refusal(self.template_names, self.call_start, request.want_audio, "ask for text alone"):
            raise ValueError(f"tools: {why}")
        if not request.messages:
            raise ValueError("tools: they go with messages (a plain prompt renders no template)")
        return read_tools(request.tools)

    def _audio_rate(self) -> int:
        # without a processor media are refused after decoding (any rate will do until then)
        return int(self.inputs.sampling_rate) if self.inputs is not None else 16_000

    async def Info(self, request: stage_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> stage_pb2.InfoResponse:
        """The stack's model and health (it names the stages' internal addresses: with an API key
        configured it takes the key, as Generate does; grpc.health.v1 stays open for probes)."""
        await self._require_key(context)
        return stage_pb2.InfoResponse(
            model=self.model_name,
            arch=(self.ckpt.config.architectures or [""])[0],
            role="gateway",
            load=stage_pb2.Load(running=self.active, open_streams=self.active),
            serving=self.serving,
            chain=self.watcher.chain,
        )

    # ---- health -------------------------------------------------------------------------------

    @property
    def serving(self) -> bool:
        """Takes requests: not draining and the thinker serves (a split one's roles both: the
        decode role is seen through the prefill role's Info, which lists it)."""
        return not self.draining and self.thinker_serving

    @property
    def thinker_serving(self) -> bool:
        """Every thinker role the chain lists serves, and it lists them all (the first is the
        watcher's own head)."""
        roles = [h for h in self.watcher.chain if h.stage in self.thinker_roles]
        return len(roles) == len(self.thinker_roles) and all(h.serving for h in roles)

    def chain_serving(self) -> tuple[bool, list[stage_pb2.StageHealth]]:
        """Whether every stage below serves (what the HTTP /health says), and each one's health."""
        chain = list(self.watcher.chain)
        return (not self.draining and all(h.serving for h in chain)), chain

    async def watch_thinker(self, health_state: HealthState) -> None:
        """Keep the gateway's gRPC health in step with the thinker's: NOT_SERVING while it (or
        a split one's either role) does not serve, or while the gateway drains. Its Info also
        brings the stages below."""
        was = False

        async def update() -> None:
            nonlocal was
            now = self.thinker_serving
            if now:  # a thinker replica serves again, seen by no request: a failover window is over
                self.router.served()
            if now != was:
                chain = self.watcher.chain
                down = [f"{h.stage}: {h.detail or 'not serving'}" for h in chain
                        if h.stage in self.thinker_roles and not h.serving]  # fmt: skip
                unseen = sorted(self.thinker_roles - {h.stage for h in chain})  # a role its Info does not list
                down += [f"{role}: not reported by {chain[0].stage}" for role in unseen]
                state = "serving" if now else f"not serving ({'; '.join(down)})"
                log.log(logging.INFO if now else logging.WARNING, "thinker at %s is %s", self.thinker_target, state)
            was = now
            await health_state.set(self.serving)

        await self.watcher.run(update)

    # ---- the request path (both front doors) --------------------------------------------------

    def check_api_key(self, authorization: str | None) -> bool:
        """With an API key configured, `authorization` must be `Bearer <key>`."""
        if not self.api_key:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        # (an auth scheme is case-insensitive, RFC 9110; the key is compared in constant time)
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def serve(self, request: gateway_pb2.GenerateRequest, timeout: float | None, api: str,
                    fit: PromptFit | None = None) -> AsyncIterator[gateway_pb2.GenerateResponse]:  # fmt: skip
        """One request, front-door independent: its responses, or GatewayError. Counts it,
        observes its metrics and writes its access-log line whatever happens. `fit`: a
        conversation's oldest turns are left out as far as it takes to fit (the Realtime API's
        truncation; `fit.dropped` says how many, once its prompt is built)."""
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        outcome = Outcome(request.request_id, time.perf_counter(), api=api)
        self.active += 1
        self.metrics.in_flight.inc()
        replies = self._generate(request, outcome, timeout, fit)
        try:
            if self.active > self.cfg.gateway.max_in_flight:  # shed at once: queued, it would wait to its deadline
                outcome.shed = True
                raise GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"gateway: {self.active - 1} requests in "
                                   "flight, its limit (gateway.max_in_flight); retry later",
                                   retry_after_s=1.0)  # fmt: skip
            async for resp in replies:
                yield resp
        except GatewayError as e:
            outcome.status = e.code.name
            outcome.error = e.message
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # gRPC cancels the handler of a call past the client's deadline too: count that as such
            past_deadline = time.perf_counter() - outcome.t0 >= self._timeout(timeout) - DEADLINE_SLACK_S
            outcome.status = "DEADLINE_EXCEEDED" if past_deadline else "CANCELLED"
            raise
        except Exception:
            outcome.status = "ERROR"
            raise
        finally:
            try:
                # closed here, not left to the event loop's finalizer: a caller that stops reading
                # (its client hung up mid-stream) cancels the stage calls before the request is over
                await replies.aclose()
            finally:
                self.active -= 1
                self.metrics.in_flight.dec()
                e2e = time.perf_counter() - outcome.t0
                self.metrics.observe(outcome, e2e, self.sample_rate)
                self._access_log(outcome, e2e)

    def _timeout(self, remaining: float | None) -> float:
        """The request's deadline: the client's, at most request_timeout_s (a far one would let a
        slow reader hold its cache reservation as long as it liked)."""
        cap = self.cfg.timeouts.request_timeout_s
        return cap if remaining is None else min(remaining, cap)

    def _start(self, request: gateway_pb2.GenerateRequest, timeout: float) -> stage_pb2.Start:
        """The thinker's Start, every field checked (GatewayError INVALID_ARGUMENT)."""
        def bad(message: str) -> GatewayError:
            return GatewayError(grpc.StatusCode.INVALID_ARGUMENT, f"gateway: {message}")

        if request.want_audio and not self.cfg.audio_output:
            raise bad("want_audio: this stack serves text only (deploy config audio_output: false)")
        if request.raw_prompt and (given := next((f for f in ("messages", "tools", "want_audio")
                                                  if getattr(request, f)), None)):  # fmt: skip
            raise bad(f"{given}: a raw prompt goes alone: no messages or tools, and it is answered in text "
                      "(the talker reads chat turns)")  # fmt: skip
        if request.prompt_ids and not request.raw_prompt:
            raise bad("prompt_ids: a prompt of ids is a raw one (raw_prompt)")
        if request.prompt_ids and request.prompt:
            raise bad("prompt_ids: the prompt is its text or its ids, not both")
        if request.want_audio and request.speaker:
            try:
                self.ckpt.spec.speaker_id(request.speaker)
            except ValueError as e:
                raise bad(f"speaker: {e}") from None
        if request.audio_format not in gateway_pb2.AudioFormat.values():
            raise bad(f"audio_format: unknown value {request.audio_format}")
        if request.speed and not MIN_SPEED <= request.speed <= MAX_SPEED:  # (NaN too)
            raise bad(f"speed: {request.speed:g} is outside {MIN_SPEED:g} to {MAX_SPEED:g} (0: 1)")
        try:
            check_stop_texts(request.stop)
        except ValueError as e:
            raise bad(str(e)) from None
        # The stages know the request by an id no other request shares: clients may reuse theirs
        # (a retry while the first attempt still runs below the thinker, two clients alike).
        stage_id = f"{request.request_id}.{secrets.token_hex(4)}"
        # The reply needs the talker's frame count, not its codes: its finished chunk says it,
        # and the codes stay off the three hops up.
        start = stage_pb2.Start(request_id=stage_id, want_audio=request.want_audio, mode=request.mode,
                                speaker=request.speaker, deadline_unix_s=time.time() + timeout,
                                omit_codes=True)  # fmt: skip
        for name, params in request.sampling.items():
            if name not in STAGES:
                raise bad(f"sampling: unknown stage {quoted(name)}")  # (a name past 16 KiB would pass gRPC's limit)
            if name == "code2wav" and (unused := [f.name for f, _ in params.ListFields() if f.name != "seed"]):
                raise bad(f"sampling: code2wav samples nothing; it takes only a seed, not {', '.join(unused)}")
            start.sampling[name].CopyFrom(params)
        if request.tools and request.want_audio and self.call_start is not None:  # the speech ends at a call
            ends = start.sampling["thinker"].speech_end_ids
            ends.extend([self.call_start] if self.call_start not in ends else [])
        if request.stop:  # the thinker ends the reply there, and every stage below with it
            texts = start.sampling["thinker"].stop_texts
            texts.extend(dict.fromkeys(s for s in request.stop if s not in texts))
        for name in STAGES:  # a replay on another replica then samples the same stream
            if not start.sampling[name].HasField("seed"):
                start.sampling[name].seed = secrets.randbits(62)
        # every stage's sampling, checked as that stage will, before anything streams
        try:
            edges.check_start("gateway", start)
            spec = self.ckpt.spec
            edges.sampling("thinker", start, self.thinker_defaults, self.max_prompt_tokens + 1,
                           vocab=spec.thinker_vocab)  # fmt: skip
            speaks = self.cfg.audio_output  # (a text-only checkpoint may have no talker ids)
            edges.sampling("talker", start, self.talker_defaults, int(spec.max_positions), "the model's positions",
                           vocab=spec.talker_vocab if speaks else None,
                           required_stop_ids=spec.talker_stop_ids() if speaks else ())  # fmt: skip
        except StageError as e:
            raise bad(e.message.removeprefix("gateway: ")) from None
        return start

    async def _generate(self, request: gateway_pb2.GenerateRequest, outcome: Outcome, timeout: float | None,
                        fit: PromptFit | None = None) -> AsyncIterator[gateway_pb2.GenerateResponse]:  # fmt: skip
        if self.draining:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, "gateway: draining, not accepting new requests")
        timeout = self._timeout(timeout)
        start = self._start(request, timeout)
        outcome.stage_request_id = start.request_id
        cancelled = threading.Event()
        try:
            prompt = await asyncio.to_thread(self._prompt, request, cancelled, fit)
        except ValueError as e:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, f"gateway: {e}") from None
        except asyncio.CancelledError:  # the client hung up: its worker thread stops at its next frame
            cancelled.set()
            raise
        outcome.prompt_tokens = len(prompt.ids)
        given = len(start.sampling["thinker"].forced_ids) if "thinker" in start.sampling else 0
        if given and len(prompt.ids) + given + 1 > self.max_prompt_tokens + 1:  # the reply, then its stop id
            most = self.max_prompt_tokens + 1
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, f"gateway: prompt: {len(prompt.ids)} tokens and a "
                               f"given reply of {given} exceed the model maximum of {most}")  # fmt: skip
        chunk = edges.prompt_chunk(prompt.ids, prompt.multimodal, prompt.use_audio_in_video, prompt.digests)
        del prompt  # the media tensors are in `chunk` now

        async def messages() -> AsyncIterator[stage_pb2.StageRequest]:
            yield stage_pb2.StageRequest(start=start)
            for piece in _encode(chunk, self.cfg.max_message_bytes - 1024):  # large prompts span messages
                yield stage_pb2.StageRequest(chunk=piece)

        t0 = outcome.t0
        text = TextStream(self.tokenizer, list(start.sampling["thinker"].stop_texts))  # (`stop`, and a client's own)
        encoder = AudioEncoder(request.audio_format, self.sample_rate) if request.want_audio else None
        speed = request.speed or 1.0
        tempo = Tempo(speed, self.sample_rate) if encoder is not None and speed != 1.0 else None
        timings: dict[str, gateway_pb2.StageTiming] = {}
        frames = 0
        # (hashed off the event loop: its first user message may hold megabytes of media)
        key = await asyncio.to_thread(self._conversation, request, fit) if self.keeps_prefixes else None
        outputs = self._outputs(messages, time.monotonic() + timeout, request.request_id, start.request_id, key)
        speech_cut = False  # the talker reached its max_tokens before the reply's end
        try:
            async for stage, got in outputs:
                now = time.perf_counter() - t0
                timing = timings.setdefault(stage, gateway_pb2.StageTiming(first_output_s=now))
                timing.total_s = now
                if stage == "talker" and edges.meta_str(got.meta, edges.FINISH_REASON) == "max_tokens":
                    speech_cut = True
                if edges.IDS in got.tensors:
                    ids = [int(i) for i in got.tensors[edges.IDS].tolist()]
                    outcome.completion_tokens += len(ids)
                    outcome.ttft = now if outcome.ttft is None else outcome.ttft
                    reason = edges.meta_str(got.meta, edges.FINISH_REASON)
                    if reason:
                        outcome.finish_reason = FINISH_REASONS.get(reason, reason)
                    # a stop id's own text is no part of the reply (as vLLM leaves it out): an ordinary
                    # token a client named in stop_token_ids showed in the text
                    shown = ids[:-1] if reason == "stop_id" else ids
                    delta = gateway_pb2.TextDelta(text=text.push(shown), token_ids=ids)
                    if logprobs := edges.read_logprobs("thinker", got):
                        delta.logprobs.extend(_logprob_messages(ids, logprobs))
                    yield gateway_pb2.GenerateResponse(text=delta)
                    if text.stopped:  # a stop text: the thinker ended there too; its speech comes on to its end
                        outcome.finish_reason = "stop"
                        if not reason:  # a thinker that reads on (stop_texts unknown to it): end it here
                            log.warning("request %s: the thinker did not end its reply at the stop text; ended here "
                                        "(its speech stops where the talker was)", request.request_id)  # fmt: skip
                            break
                elif stage == "talker":  # its frames (codes), or its finished chunk at the count
                    frames = max(frames, got.offset + got.length)
                elif edges.AUDIO in got.tensors and encoder is not None:
                    pcm = got.tensors[edges.AUDIO].float().contiguous().numpy()
                    if tempo is not None:  # (what the client hears is counted: the stretched audio)
                        pcm = tempo.push(pcm)
                    outcome.audio_samples += int(pcm.shape[0])
                    data = encoder.push(pcm)
                    if data:
                        for piece in self._audio(encoder, data, outcome, now):
                            yield piece
        finally:
            await outputs.aclose()  # ends the thinker call when this ends early (a client gone, an error)
        if speech_cut:  # the audio stops short of the text: as OpenAI says of a reply cut by its limit
            outcome.finish_reason = "length"
        tail = text.flush()
        if tail:
            yield gateway_pb2.GenerateResponse(text=gateway_pb2.TextDelta(text=tail))
        if encoder is not None:
            data = b""
            if tempo is not None:  # the samples the filter held back, then the encoder's rest
                pcm = tempo.finish()
                outcome.audio_samples += int(pcm.shape[0])
                data = encoder.push(pcm)
            data += encoder.finish()
            if data:
                for piece in self._audio(encoder, data, outcome, time.perf_counter() - t0):
                    yield piece
        usage = gateway_pb2.Usage(
            prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens,
            audio_frames=frames,
            audio_seconds=outcome.audio_samples / self.sample_rate,
        )
        final = gateway_pb2.Final(usage=usage, finish_reason=outcome.finish_reason)
        for name, timing in timings.items():
            final.timings[name].CopyFrom(timing)
        # the gateway's first output: the reply's first piece to the client
        first = min((t for t in (outcome.ttft, outcome.ttfa) if t is not None), default=0.0)
        final.timings["gateway"].CopyFrom(gateway_pb2.StageTiming(first_output_s=first,
                                                                  total_s=time.perf_counter() - t0))  # fmt: skip
        yield gateway_pb2.GenerateResponse(final=final)

    @functools.cached_property
    def pieces(self) -> TokenPieces:
        """Each token's text and bytes, for `logprobs` (HTTP and Realtime; built at first use)."""
        return TokenPieces(self.tokenizer)

    def reply_ends(self, request: gateway_pb2.GenerateRequest) -> frozenset[int]:
        """The ids that end a request's reply (its own stop ids, else the thinker's): the one token
        `logprobs` has no entry for."""
        return frozenset(request.sampling["thinker"].stop_ids or self.thinker_defaults.stop_ids)

    def _conversation(self, request: gateway_pb2.GenerateRequest, fit: PromptFit | None = None) -> bytes | None:
        """Where the thinker keeps prefixes: the key its replica is chosen by (routing.py), the
        same for every turn of a conversation: its messages up to its first user message (of
        those `fit` kept: where its next turns go)."""
        if not self.keeps_prefixes:
            return None
        if fit is not None and fit.dropped:
            request = without(request, fit.fixed, fit.dropped)
        first = next((i for i, m in enumerate(request.messages) if m.role == "user"), None)
        if first is None:
            return None
        # (the tools too: the template renders them at the prompt's start)
        opening = gateway_pb2.GenerateRequest(messages=request.messages[: first + 1], tools=request.tools)
        return hashlib.blake2b(opening.SerializeToString(deterministic=True), digest_size=16).digest()

    async def _outputs(self, messages: Callable[[], AsyncIterator[stage_pb2.StageRequest]], deadline: float,
                       request_id: str, stage_id: str, key: bytes | None = None
                       ) -> AsyncIterator[tuple[str, DecodedChunk]]:  # fmt: skip
        """(producing stage, chunk) of the thinker call, in order. When the thinker replica is
        lost mid-request the call is made again (another replica) and only what this reply
        does not have yet comes through (wire/resume.py); GatewayError when it cannot. A stage's
        error names the request by `stage_id`; the client gets its own `request_id` there (the
        access log pairs the two). `key`: the request's conversation (`_conversation`)."""
        resume = Resume()
        attempt = 0
        wait_ended = ""  # how a replay's last wait for a thinker replica ended (Router.wait_after_loss)
        ever_served = False  # a thinker replica served one of its calls when opened
        while True:
            channel, done = self.router.pick(key)
            was_serving = self.router.serving(channel)  # (a loss then starts the wait)
            ever_served |= was_serving
            # Stage.Stream; responses parsed without copying tensors
            sent = CancellableInput(messages(), "gateway: its client ended the request")
            call = sent.call(stage_stream(channel), timeout=max(deadline - time.monotonic(), 0.001))
            call.add_done_callback(done)
            assemblers: dict[str, ChunkAssembler] = {}
            failure: stage_pb2.Failure | None = None  # the call's status as the thinker said it, in band
            try:
                async for received in sent.responses(call):
                    resp = received.message
                    if resp.HasField("failure"):  # its status follows, unless grpc replaced it (a write under way)
                        failure = resp.failure
                        continue
                    got = assemblers.setdefault(resp.stage, ChunkAssembler()).push(resp.chunk, received.views)
                    if got is None:
                        continue
                    seen = resume.classify(resp.stage, got.offset, got.length, got.finished)
                    if seen is Seen.OLD:
                        continue
                    if seen is Seen.OVERLAP:
                        got = resume.tail(resp.stage, got)
                    resume.delivered(resp.stage, got.offset, got.length, got.finished)
                    yield resp.stage, got
                if failure is not None:  # (a Failure is always followed by its status: no thinker of ours)
                    code, detail = failure_status(failure)
                    raise GatewayError(code, client_ids(detail, stage_id, request_id))
                return
            except grpc.aio.AioRpcError as e:
                code, detail = e.code(), e.details() or ""
                if failure is not None:  # as the thinker said it (see stage_server's `_failure`)
                    code, detail = failure_status(failure)
                lost = lost_peer(code, detail) and not detail.startswith(self.stages[1:])
                if lost and attempt < self.cfg.failover.attempts and deadline - time.monotonic() > 0.5:
                    attempt += 1
                    log.warning("gateway: request %s lost its %s call (%s); replaying it (attempt %d)",
                                request_id, self.stages[0], detail, attempt)  # fmt: skip
                    await asyncio.sleep(REPLAY_BACKOFF_S * 2 ** (attempt - 1))  # the channel sees the loss
                    # a thinker replica serves, or one comes back (restarted) within failover.replica_wait_s
                    # of the loss and the deadline; the replay follows either way (as each stage's caller does)
                    wait_ended = await self.router.wait_after_loss(
                        was_serving, self.cfg.failover.replica_wait_s, deadline - time.monotonic() - 0.5,
                        stop=lambda: self.draining)
                    self.metrics.replays.inc()
                    continue
                if lost_peer(code, detail) and not detail.startswith(self.stages):
                    code = grpc.StatusCode.UNAVAILABLE
                    detail = f"{self.stages[0]} unavailable at {self.thinker_target}: {detail}"
                    if attempt:  # (as each stage says it)
                        why = (f"{attempt} replays failed (failover.attempts)" if attempt >= self.cfg.failover.attempts
                               else "the deadline is too close")  # fmt: skip
                        said = unserved(wait_ended, self.cfg.failover.replica_wait_s, ever_served)
                        detail += f" (not replayed again: {why}{'; ' + said if said else ''})"
                elif code == grpc.StatusCode.DEADLINE_EXCEEDED and not detail.startswith(self.stages):
                    # this gateway's own call ran out before a stage said so ("Deadline Exceeded")
                    detail = f"gateway: request {stage_id} {DEADLINE_PASSED}"
                # a stage's RESOURCE_EXHAUSTED is its out of memory: the same request may fit later (as
                # HTTP's 429 says retry-after: 1); not gRPC's own (a message over a limit, named by no
                # stage), which no retry passes
                retry = code == grpc.StatusCode.RESOURCE_EXHAUSTED and detail.startswith(self.stages)
                raise GatewayError(code, client_ids(detail, stage_id, request_id),
                                   retry_after_s=1.0 if retry else None) from None
            except TensorBlobError as e:
                raise GatewayError(grpc.StatusCode.INTERNAL, f"gateway: bad chunk from a stage: {e}") from None
            finally:
                sent.end_early(call)  # (a no-op once it has ended)

    def _audio(self, encoder: AudioEncoder, data: bytes, outcome: Outcome, now: float
               ) -> list[gateway_pb2.GenerateResponse]:  # fmt: skip
        """AudioChunks of `data`, covering the samples given to the encoder since the last ones:
        pieces of at most AUDIO_PIECE_BYTES (a WAV or FLAC file comes whole at the end, and gRPC
        clients refuse messages over 4 MiB by default: 87 s of 16-bit 24 kHz audio); the first
        piece counts the samples, the others add none."""
        sent = outcome.audio_sent
        outcome.audio_sent = outcome.audio_samples
        outcome.ttfa = now if outcome.ttfa is None else outcome.ttfa
        outcome.audio_times.append(now)
        out = []
        for at in range(0, len(data), AUDIO_PIECE_BYTES):
            chunk = gateway_pb2.AudioChunk(sample_rate=self.sample_rate, first_sample=sent,
                                           samples=(outcome.audio_samples - sent) if at == 0 else 0,
                                           format=encoder.format)  # type: ignore[arg-type]  # fmt: skip
            piece = data[at : at + AUDIO_PIECE_BYTES]
            if encoder.format == gateway_pb2.PCM_F32LE:
                chunk.pcm_f32le = piece
            else:
                chunk.data = piece
            out.append(gateway_pb2.GenerateResponse(audio=chunk))
        return out

    # ---- gRPC front door ----------------------------------------------------------------------

    def _has_key(self, context: grpc.aio.ServicerContext) -> bool:
        return self.check_api_key(dict(context.invocation_metadata() or ()).get("authorization"))

    async def _require_key(self, context: grpc.aio.ServicerContext) -> None:
        if not self._has_key(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _NO_KEY)

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        bad_id = bool(request.request_id) and bad_request_id(request.request_id)  # never echoed nor logged
        if bad_id or not request.request_id:
            request.request_id = uuid.uuid4().hex  # (a refusal names the request by it, as HTTP's do)
        refusal = None
        if not self._has_key(context):
            refusal = (grpc.StatusCode.UNAUTHENTICATED, _NO_KEY)
        elif bad_id:
            refusal = (grpc.StatusCode.INVALID_ARGUMENT, _BAD_ID)
        if refusal is not None:
            self.refused("grpc", refusal[0].name, refusal[1], request_id=request.request_id)
            await _abort(context, *refusal, request.request_id)
        await context.send_initial_metadata(((REQUEST_ID_KEY, request.request_id),))
        # written, not yielded: a write the client does not take times out (`deliver`)
        replies = self.serve(request, context.time_remaining(), "grpc")
        try:
            async for resp in replies:
                await self.deliver(context.write(resp), replies, request.request_id)
        except GatewayError as e:
            await _abort(context, e.code, e.message, request.request_id, e.retry_after_s)
        except Exception:
            if context.cancelled():  # a write failed as the client hung up (or its deadline passed): no one to tell
                return
            # a bug, not the request: INTERNAL naming the request (grpc would say UNKNOWN)
            log.exception("gateway: request %s failed", request.request_id)
            error = internal_failure(request.request_id)
            await fail_replies(replies, error)
            await _abort(context, error.code, error.message, request.request_id)
        finally:
            await replies.aclose()  # (a cancelled call leaves it at a yield)

    async def deliver(self, write: Awaitable[None], replies: AsyncGenerator[Any, None], request_id: str) -> None:
        """Send one piece of a reply (`write`, a front door's send). A client that takes nothing
        more of it for output_stall_timeout_s fails the request (`replies`, `serve`'s generator)
        with DEADLINE_EXCEEDED, as a stage fails a caller that stops reading: the stages may be
        done with it, but its slot and its unsent pieces would be held to its deadline."""
        limit = self.cfg.timeouts.output_stall_timeout_s
        try:
            async with asyncio.timeout(limit or None):  # (0: none; no task per write, as wait_for would make)
                await write
        except TimeoutError:
            error = GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, f"gateway: the client took nothing more of "
                                 f"request {request_id}'s reply for {limit:g} s (output_stall_timeout_s={limit:g})")
            await fail_replies(replies, error)
            raise error from None

    def refused(self, api: str, outcome: str, message: str, seconds: float = 0.0, request_id: str = "") -> None:
        """A request refused before it started (its key, its body): counted, and given its access
        line with the reason, the `seconds` it took and its id (the client's, or one made for it:
        the refusal's x-request-id), as any other request is."""
        o = Outcome(request_id or "-", time.perf_counter(), api=api, status=outcome, error=message, shed=True)
        self.metrics.observe(o, seconds, self.sample_rate)  # (shed: counted, no latency observed)
        self._access_log(o, seconds)

    def _access_log(self, o: Outcome, e2e: float) -> None:
        def ms(x: float | None) -> int | None:
            return None if x is None else round(1000 * x)

        fields = {
            "request_id": o.request_id,
            "stage_request_id": o.stage_request_id or None,
            "api": o.api,
            "outcome": o.status,
            "ttft_ms": ms(o.ttft),
            "ttfa_ms": ms(o.ttfa),
            "e2e_ms": ms(e2e),
            "prompt_tokens": o.prompt_tokens,
            "completion_tokens": o.completion_tokens,
            "audio_s": round(o.audio_samples / self.sample_rate, 3),
            "error": o.error[:ACCESS_ERROR_CHARS] or None,  # why it failed: the stages log no request's error
        }
        # the error is quoted (JSON) so that a line still splits on spaces into key=value pairs
        text = " ".join(f"{k}={'-' if v is None else json.dumps(v) if k == 'error' else v}" for k, v in fields.items())
        # a fault of the service's (not the client's): at WARNING, for alerts on log levels
        level = logging.WARNING if o.status in SERVER_FAULTS else logging.INFO
        access_log.log(level, "request %s", text, extra={"fields": fields})


def _encode(chunk: OutChunk, max_bytes: int) -> list[stage_pb2.Chunk]:
    pieces = encode_chunks(chunk.tensors, max_bytes=max_bytes, offset=chunk.offset, length=chunk.length,
                           finished=chunk.finished, meta=chunk.meta)  # fmt: skip
    return [p.message() for p in pieces]
