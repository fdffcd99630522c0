"""An HTTP request's error as an OpenAI error object (`{"error": {message, type, param,
code}}`) with its status, for every endpoint of the HTTP front door."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

__all__ = ["UNREAD_BODY", "HttpError", "unauthorized"]

# answered before the body was read: the connection closes after (a client still sending it would
# keep it open with no keep-alive timer: uvicorn restarts that timer only when a response ends)
UNREAD_BODY = (401, 408, 413, 415, 499)


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry: bool = True) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.retry = retry  # False: says x-should-retry: false (the OpenAI SDK retries 408, 409, 429 and 5xx)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"retry-after": "1"} if self.status == 429 else {}  # what the OpenAI SDK waits on
        if not self.retry:
            headers["x-should-retry"] = "false"
        if self.status in UNREAD_BODY:
            headers["connection"] = "close"
        if self.status == 401:  # (RFC 9110: a 401 names the scheme it takes)
            headers["www-authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def unauthorized() -> HttpError:
    """A request without the server's API key, at every door."""
    return HttpError(401, "missing or wrong API key (header Authorization: Bearer <key>)", "authentication_error",
                     code="invalid_api_key")  # fmt: skip
