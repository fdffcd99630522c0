"""The gateway's HTTP app: the OpenAI-compatible endpoints (gateway/http_api.py), the Realtime
WebSocket (gateway/realtime.py), the model card, health, metrics and the playground page."""

from __future__ import annotations

import asyncio
import time
from importlib import resources
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from gateway.completions_api import Completions
from gateway.http_api import ChatCompletions, unknown_model
from gateway.http_error import HttpError, unauthorized
from gateway.realtime import realtime_route
from gateway.responses_api import Responses
from gateway.server import REQUEST_ID_KEY, GatewayService

__all__ = ["build_app"]


def build_app(service: GatewayService) -> Starlette:
    chat = ChatCompletions(service)
    responses = Responses(chat)
    completions = Completions(chat)
    page = resources.files("gateway").joinpath("static/playground.html").read_text()
    started = int(time.time())  # the model card's `created`

    def model_card() -> dict[str, Any]:
        return {"id": service.model_name, "object": "model", "created": started, "owned_by": "omnistage",
                "voices": chat.voices,
                "default_voice": service.ckpt.spec.default_speaker if chat.voices else None,
                "sample_rate": service.sample_rate, "audio_output": service.cfg.audio_output}  # fmt: skip

    async def models(request: Request) -> Response:
        if not service.check_api_key(request.headers.get("authorization")):
            return unauthorized().response()
        name = request.path_params.get("model")
        if name is None:
            return JSONResponse({"object": "list", "data": [model_card()]})
        if name != service.model_name:
            return unknown_model(name, service.model_name).response()
        return JSONResponse(model_card())

    async def health(request: Request) -> Response:
        ok, chain = service.chain_serving()
        # open for probes; the stages' addresses (and errors, which may name them) take the key, as Info does
        inside = service.check_api_key(request.headers.get("authorization"))
        stages = [{"stage": h.stage, "serving": h.serving}
                  | ({"target": h.target, "detail": h.detail} if inside else {}) for h in chain]  # fmt: skip
        body = {"status": "ok" if ok else "unavailable", "draining": service.draining, "stages": stages}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(request: Request) -> Response:
        # off the event loop: a scrape reads every thread's /proc files (metrics' thread_cpu.py)
        body = await asyncio.to_thread(generate_latest, service.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def playground(request: Request) -> Response:
        return HTMLResponse(page)

    async def http_error(request: Request, exc: Exception) -> Response:
        """Starlette's own 404 and 405 as OpenAI error objects, like every other error here."""
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        response = HttpError(exc.status_code, message, kind).response()
        response.headers.update(exc.headers or {})  # 405's Allow
        return response

    async def internal_error(request: Request, exc: Exception) -> Response:
        """A failure nothing above answered (a bug): an OpenAI error object, not Starlette's
        text, told not to retry (the OpenAI SDK retries a 500 twice otherwise). Starlette raises
        it on to the server, which logs it."""
        response = HttpError(500, f"internal error: {type(exc).__name__}", "server_error").response()
        response.headers["x-should-retry"] = "false"
        return response

    origins = service.cfg.gateway.cors_allow_origins
    middleware = [Middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "DELETE"],
                             allow_headers=["*"], expose_headers=[REQUEST_ID_KEY])] if origins else []  # fmt: skip
    app = Starlette(routes=[
        Route("/v1/chat/completions", chat.handle, methods=["POST"]),
        Route("/v1/completions", completions.create, methods=["POST"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.get, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
        Route("/v1/audio/speech", chat.speech, methods=["POST"]),
        Route("/v1/audio/transcriptions", chat.transcriptions, methods=["POST"]),
        Route("/v1/audio/translations", chat.translations, methods=["POST"]),
        realtime_route(service),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        *([Route("/metrics", metrics, methods=["GET"])] if service.cfg.metrics.enabled else []),  # (off: none)
        Route("/", playground, methods=["GET"]),
    ], middleware=middleware, exception_handlers={HTTPException: http_error, Exception: internal_error})  # fmt: skip
    # a path with a trailing slash is an unknown one (404, an OpenAI error): Starlette's own answer
    # was a bare redirect for a POST
    app.router.redirect_slashes = False
    return app
