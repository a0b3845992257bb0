"""Errors that reach users: each names the adapter, the problem and the fix.

The HTTP edge maps them to status codes (`status`); anything else is a bug, logged
with its traceback and answered with a plain 500.
"""

from typing import ClassVar


class LoraswapError(Exception):
    status = 500
    # the error body's `code` (OpenAI's `error.code`, a failed job's): part of the API, so named
    # here for good, never derived from a class name that may change (None: named by its class)
    code: ClassVar[str | None] = None

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequest(LoraswapError):
    status = 400
    code: ClassVar[str | None] = "bad_request"


class AdapterError(LoraswapError):
    """An adapter that cannot be served; the message says which, why, and what to do."""

    status = 400
    code: ClassVar[str | None] = "adapter_error"

    def __init__(self, adapter_id: str, problem: str, fix: str):
        super().__init__(f"adapter '{adapter_id}': {problem}. {fix}")
        self.adapter_id = adapter_id
        self.problem = problem
        self.fix = fix

    def __reduce__(self):  # rebuilt from its parts when it crosses a process (Ray replicas)
        return type(self), (self.adapter_id, self.problem, self.fix)


class AdapterNotFound(AdapterError):
    status = 404
    code: ClassVar[str | None] = "adapter_not_found"


class AdapterInvalid(AdapterError):
    """The file itself is unusable: not safetensors, truncated, unknown keys, NaN..."""

    status = 400
    code: ClassVar[str | None] = "adapter_invalid"


class AdapterForbidden(AdapterError):
    """An id this server refuses to serve (hub allow/deny patterns)."""

    status = 403
    code: ClassVar[str | None] = "adapter_forbidden"


class AdapterUnavailable(AdapterError):
    """The adapter's upstream failed: a 5xx, no connection, a timeout, too many redirects."""

    status = 502
    code: ClassVar[str | None] = "adapter_unavailable"


class AdapterIncompatible(AdapterError):
    """A valid adapter that does not fit the hosted model (layers, shapes, base model)."""

    status = 422
    code: ClassVar[str | None] = "adapter_incompatible"


class AdapterChanged(AdapterError):
    """The processes of one image read an adapter's file at different moments and got
    different versions (it was replaced between their reads): nothing was generated."""

    status = 503
    code: ClassVar[str | None] = "adapter_changed"


class Overloaded(LoraswapError):
    status = 503
    code: ClassVar[str | None] = "overloaded"


class UnsupportedInput(LoraswapError):
    """A well-formed request the hosted model cannot take: an image for a text-only model,
    a mask for a model without inpainting, frames for an image model."""

    status = 422
    code: ClassVar[str | None] = "unsupported_input"
