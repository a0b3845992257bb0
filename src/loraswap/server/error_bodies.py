"""The one place an error's JSON body is shaped: OpenAI's on `/v1/*`, `{"error": "..."}` elsewhere.

OpenAI's clients read `error.message` (openai-python shows it in the exception's text and as
`.message`), so every `/v1/*` route answers as OpenAI's API does:

    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": null}}

`type` is OpenAI's: `invalid_request_error` for a 4xx (a missing or wrong key too; a wrong
one with the code `invalid_api_key`, a missing one with none, as OpenAI answers them),
`server_error` for a 5xx. `code` is a known error's own (`LoraswapError.code`:
`AdapterNotFound` -> `adapter_not_found`), else its class's name in the same spelling (as a
failed video job's `error.code`); `param` is the field a validation error (or a limit) names. The Hugging Face routes
and the server's own answer `{"error": "..."}`. The status and headers (Retry-After,
WWW-Authenticate) are the same either way.
"""

import re

from fastapi.responses import JSONResponse

from loraswap.errors import LoraswapError

OPENAI_PREFIX = "/v1/"
INVALID_API_KEY = "invalid_api_key"  # OpenAI's code for the 401 of a wrong key (a missing one has none)


def is_openai_path(path: str) -> bool:
    """Whether a request's path (its root path taken off) is one of OpenAI's routes."""
    return path == OPENAI_PREFIX.rstrip("/") or path.startswith(OPENAI_PREFIX)


def route_path(scope) -> str:
    """The path the routes match: the request's, without the app's root path (behind a proxy)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def error_code(error: LoraswapError) -> str:
    """The error's `code`, as its class names it (`LoraswapError.code`); a class that names
    none (a subclass inherits no code), its name as a code: AdapterNotFound -> adapter_not_found."""
    return type(error).__dict__.get("code") or re.sub(r"(?<!^)(?=[A-Z])", "_", type(error).__name__).lower()


def openai_type(status: int) -> str:
    return "server_error" if status >= 500 else "invalid_request_error"


def invalid_param(errors) -> str | None:
    """The field the first of pydantic's errors names (`variant`, `parameters.seed`), if any."""
    where = errors[0].get("loc", ()) if errors else ()
    return ".".join(str(part) for part in where if part not in ("body", "query", "path", "header")) or None


def error_body(path: str, status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    """The body of an error answered on `path`: OpenAI's shape on `/v1/*`, else `{"error": message}`."""
    if not is_openai_path(path):
        return {"error": message}
    return {"error": {"message": message, "type": openai_type(status), "param": param, "code": code}}


def error_response(scope, status: int, message: str, headers: dict | None = None, code: str | None = None,
                   param: str | None = None) -> JSONResponse:
    """The JSON answer of an error to the request of `scope` (a `Request` or an ASGI scope)."""
    return JSONResponse(error_body(route_path(scope), status, message, code, param), status_code=status,
                        headers=headers)


# the two bodies as JSON Schema, for the OpenAPI document
ERROR_SCHEMA = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}
OPENAI_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
