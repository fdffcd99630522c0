"""OpenAI's legacy Completions API, `POST /v1/completions`, as vLLM serves it (what vLLM's
`bench serve` sends by default): a raw prompt continued in text. The prompt is the model's
input as written (no chat template; special-token text such as `<|im_start|>` is those tokens:
GenerateRequest.raw_prompt), on the chat door's path (ChatCompletions.admit and serve): only
the shapes differ.

* `prompt`: a string, token ids (lm-eval's default), or a list holding one of either. Several
  prompts, `n` or `best_of` above 1, a `suffix` and a non-text `response_format` are refused
  (400), as is a token that stands for audio, an image or a video, as text or id (a raw prompt
  carries no media: send those as chat messages), and an id outside the vocabulary.
* `max_tokens` is 16 when left out, as OpenAI's and vLLM's (null: the checkpoint's default, as
  chat's).
* `echo`: the prompt's text before the completion (not with `logprobs`, nor `max_tokens` 0:
  there are no prompt log-probabilities here).
* `logprobs` (0 to 20): each token's `tokens`, `token_logprobs`, `top_logprobs` (the most likely
  at its position and the token itself, as OpenAI gives them) and `text_offset`.
* Sampling as chat's: `temperature`, `top_p`, `top_k`, `seed`, `stop`, `stop_token_ids`,
  `repetition_penalty`, the penalties and `logit_bias`; vLLM's fields with no counterpart that
  would change the reply are refused.
* Streamed: `text_completion` events with each piece of text as it exists, the finish, usage with
  `stream_options.include_usage`, and `[DONE]`; an error once the stream began is its last event.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from typing import Annotated, Any, TypeVar

from pydantic import ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.http_api import (
    Body,
    ChatCompletions,
    Replies,
    StreamOptions,
    chain,
    chat_usage,
    ended_well,
    from_gateway_error,
    refuse_unhonoured,
    sse_event,
    thinker_sampling,
    whole_of,
)
from gateway.http_error import HttpError
from gateway.logprobs import Held
from omnistage.quoting import quoted
from omnistage.v1 import gateway_pb2

__all__ = ["CompletionRequest", "Completions", "to_completion_request"]

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's, for a completion that names none
ResultT = TypeVar("ResultT")


class CompletionRequest(Body):
    # other fields are kept (`model_extra`): vLLM's that would change the reply are refused
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    model: str | None = None
    prompt: Any = Field()  # a string, token ids, or a list of one of either (`_one_prompt` says what is wrong)
    max_tokens: int | None = Field(DEFAULT_MAX_TOKENS, ge=0, le=1 << 20)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=1 << 20)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=1 << 62)]] | None = Field(None, max_length=1024)
    n: int | None = Field(1, ge=1, le=1)
    best_of: int | None = Field(None, ge=1, le=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    suffix: str | None = None
    response_format: dict[str, Any] | None = None  # (vLLM's: only text here)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    user: str | None = None


def _token_ids(value: list[Any], where: str) -> list[int]:
    for i, t in enumerate(value):
        if type(t) is not int or not 0 <= t < 1 << 62:  # (a JSON true is no id)
            raise HttpError(400, f"{where}[{i}]: expected a token id (an integer from 0), got {quoted(repr(t))}",
                            param="prompt")  # fmt: skip
    return value


def _one_prompt(prompt: Any) -> str | list[int]:
    """The request's one prompt: its text, or its token ids."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise HttpError(400, "prompt: expected a string, token ids, or a list of one of either", param="prompt")
    if not isinstance(prompt[0], str | list):
        return _token_ids(prompt, "prompt")
    if len(prompt) > 1:
        raise HttpError(400, f"prompt: {len(prompt)} prompts; this server completes one a request (send each "
                             "alone)", param="prompt")  # fmt: skip
    if isinstance(prompt[0], str):
        return prompt[0]
    return _token_ids(prompt[0], "prompt[0]")


def to_completion_request(body: CompletionRequest, stop_ids: Iterable[int]) -> gateway_pb2.GenerateRequest:
    """The completion request as the gateway's own (HttpError naming the field); `stop_ids`: the
    thinker's own, which `stop_token_ids` add to."""
    prompt = _one_prompt(body.prompt)
    if body.suffix:
        raise HttpError(400, "suffix: not supported by this server (the model completes a prompt's end only)",
                        param="suffix")  # fmt: skip
    if body.echo and body.logprobs is not None:
        raise HttpError(400, "echo: not with logprobs (this server gives no prompt log-probabilities)", param="echo")
    if body.max_tokens == 0:  # (lm-eval's loglikelihood: the prompt scored, nothing generated)
        raise HttpError(400, "max_tokens: 0 asks for the prompt's log-probabilities alone, which this server does "
                             "not give; at least 1", param="max_tokens")  # fmt: skip
    refuse_unhonoured(body)
    req = gateway_pb2.GenerateRequest(raw_prompt=True)
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_ids.extend(prompt)
    if body.stop is not None:
        req.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    thinker = thinker_sampling(req, body, list(stop_ids))
    if body.max_tokens is not None:
        thinker.max_tokens = body.max_tokens
    if body.logprobs is not None:
        thinker.logprobs = body.logprobs
    req.sampling["thinker"].CopyFrom(thinker)
    return req


def completion_logprobs(entries: Iterable[dict[str, Any]], offset: int) -> tuple[dict[str, Any], int]:
    """Chat's logprob entries (gateway/logprobs.py) in the Completions shape, and where the text
    after their tokens starts; `offset`: where the first token's text starts in the choice's text
    (each token's text counts as long as it is: vLLM's offsets)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        top: dict[str, float] = {}
        for t in e["top_logprobs"]:  # (two ids with one text, parts of a character: the likelier)
            top.setdefault(t["token"], t["logprob"])
        top.setdefault(e["token"], e["logprob"])  # the token itself, always (OpenAI's up to logprobs + 1)
        out["tokens"].append(e["token"])
        out["token_logprobs"].append(e["logprob"])
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(e["token"])
    return out, offset


class Completions:
    """POST /v1/completions, on the chat door's admission and serving."""

    def __init__(self, chat: ChatCompletions) -> None:
        self.chat = chat
        self.service = chat.service

    async def create(self, request: Request) -> Response:
        async def make(headers_checked: Callable[[], object]) -> tuple[CompletionRequest, gateway_pb2.GenerateRequest]:
            body = await self.chat.parse(request, CompletionRequest)
            headers_checked()
            return body, to_completion_request(body, self.chat.stop_ids["thinker"])

        admitted = await self.chat.admit(request, make)
        if isinstance(admitted, Response):
            return admitted
        body, req, timeout = admitted
        if not body.stream:
            return await self.chat.serve(request, req, timeout, lambda replies: _named(self._whole(req, body, replies)))
        return await self.chat.serve(request, req, timeout, lambda replies: _named(self.chat.first(replies)),
                                     lambda first, replies: self._stream(req, body, first, replies))  # fmt: skip

    def _head(self, req: gateway_pb2.GenerateRequest, created: int) -> dict[str, Any]:
        return {"id": f"cmpl-{req.request_id}", "object": "text_completion", "created": created,
                "model": self.service.model_name}  # fmt: skip

    def _echoed(self, req: gateway_pb2.GenerateRequest) -> str:
        """The prompt's text, as `echo` gives it (a prompt of ids: decoded, special tokens too)."""
        return req.prompt or self.service.tokenizer.decode(list(req.prompt_ids))

    def _entries(self, req: gateway_pb2.GenerateRequest, scored: Iterable[gateway_pb2.TokenLogprob]
                 ) -> list[dict[str, Any]]:  # fmt: skip
        return self.service.pieces.entries(scored, self.service.reply_ends(req))

    async def _whole(self, req: gateway_pb2.GenerateRequest, body: CompletionRequest, replies: Replies) -> Response:
        scored: list[gateway_pb2.TokenLogprob] = []
        echoed = self._echoed(req) if body.echo else ""

        def reply(text: str, _audio: list[bytes], final: gateway_pb2.Final) -> Response:
            logprobs = completion_logprobs(self._entries(req, scored), 0)[0] if body.logprobs is not None else None
            choice = {"index": 0, "text": echoed + text, "logprobs": logprobs,
                      "finish_reason": final.finish_reason or "stop"}  # fmt: skip
            return JSONResponse({**self._head(req, int(time.time())), "choices": [choice],
                                 "usage": chat_usage(final.usage)})  # fmt: skip

        return await whole_of(replies, reply, scored)

    def _stream(self, req: gateway_pb2.GenerateRequest, body: CompletionRequest,
                first: list[gateway_pb2.GenerateResponse], replies: Replies) -> AsyncIterator[str]:  # fmt: skip
        head = self._head(req, int(time.time()))
        scores = body.logprobs is not None

        def event(text: str, finish: str | None = None, logprobs: Any = None) -> str:
            return sse_event({**head, "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                                                   "finish_reason": finish}]})  # fmt: skip

        async def pieces() -> AsyncGenerator[str, None]:
            scored = Held()
            offset = 0

            def shown() -> Any:  # the entries of the tokens whose text goes out now (None: none)
                nonlocal offset
                entries = scored.take() if scores else []
                if not entries:
                    return None
                out, offset = completion_logprobs(entries, offset)
                return out

            if body.echo:
                yield event(self._echoed(req))
            async for resp in chain(first, replies):
                kind = resp.WhichOneof("kind")
                if kind == "text":
                    if scores:
                        scored.add(self._entries(req, resp.text.logprobs))
                    if resp.text.text:
                        yield event(resp.text.text, logprobs=shown())
                elif kind == "final":
                    # (tokens whose text never showed: the part of a stop text held back, say)
                    yield event("", resp.final.finish_reason or "stop", shown())
                    if body.stream_options is not None and body.stream_options.include_usage:
                        yield sse_event({**head, "choices": [], "usage": chat_usage(resp.final.usage)})
            yield "data: [DONE]\n\n"

        return ended_well(pieces(), replies, req.request_id,
                          lambda e: sse_event(_prompt_named(from_gateway_error(e)).body()))


def _prompt_named(error: HttpError) -> HttpError:
    """A refusal in this body's terms: what chat's names `messages` (the gateway's refusals of the
    prompt) is `prompt` here."""
    if error.param == "messages":
        error.param = "prompt"
    return error


async def _named(call: Awaitable[ResultT]) -> ResultT:
    """A refusal before the reply began, in this body's terms (`_prompt_named`)."""
    try:
        return await call
    except HttpError as e:
        raise _prompt_named(e) from None
