"""Every HTTP request's id and span: the outermost layer of the app.

The id is the client's `x-request-id` when it is a plain token (at most `MAX_ID_CHARS` of
letters, digits and `-_.:=+/@`), else a new one (32 hex digits); it is answered in the
response's `x-request-id` and set in `logs.request_id` while the request runs, so every log
line it causes carries it: the app's, uvicorn's access line, and those of the threads that
work for it (they run in its `tracing.RequestContext`). The request is one span (kind
SERVER, named by method and route), the parent of its parse, read, swap, generate and
encode spans; a client's `traceparent` makes it the child of the client's span.
"""

import re
import uuid

from opentelemetry.trace import SpanKind, Status, StatusCode

from loraswap import tracing
from loraswap.logs import request_id
from loraswap.server.access_log import loggable_path

HEADER = b"x-request-id"
MAX_ID_CHARS = 128
VALID_ID = re.compile(rf"[A-Za-z0-9._:=+/@-]{{1,{MAX_ID_CHARS}}}")


def request_id_of(headers: dict[str, str]) -> str:
    """The client's id when it is a plain token, else a new one."""
    given = headers.get(HEADER.decode(), "")
    return given if VALID_ID.fullmatch(given) else uuid.uuid4().hex


class RequestIds:
    """ASGI middleware: the request's id (taken or made, answered, on its log lines) and its span."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = request_id_of(headers)
        answered: dict[str, int] = {}

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                answered["status"] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (HEADER, rid.encode())]}
            await send(message)

        token = request_id.set(rid)
        try:
            with tracing.span(scope["method"], {"http.request.method": scope["method"],
                                                "url.path": loggable_path(scope["path"]), "loraswap.request_id": rid},
                              kind=SpanKind.SERVER, context=tracing.incoming_context(headers)) as span:
                try:
                    await self.app(scope, receive, send_with_id)
                finally:
                    _describe_answer(span, scope, answered.get("status"))
        finally:
            request_id.reset(token)


def _describe_answer(span, scope, status: int | None) -> None:
    """The span named by its route (`POST /models/{model_id:path}`), with its status."""
    if span is None or not span.is_recording():
        return
    route = getattr(scope.get("route"), "path", None)
    if route:
        span.update_name(f"{scope['method']} {route}")
        span.set_attribute("http.route", route)
    if status is not None:
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
