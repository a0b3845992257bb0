"""Errors that reach users: each names the adapter, the problem and the fix.

The HTTP edge maps them to status codes (`status`); anything else is a bug, logged
with its traceback and answered with a plain 500.
"""


class LoraswapError(Exception):
    status = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequest(LoraswapError):
    status = 400


class AdapterError(LoraswapError):
    """An adapter that cannot be served; the message says which, why, and what to do."""

    status = 400

    def __init__(self, adapter_id: str, problem: str, fix: str):
        super().__init__(f"adapter '{adapter_id}': {problem}. {fix}")
        self.adapter_id = adapter_id
        self.problem = problem
        self.fix = fix

    def __reduce__(self):  # rebuilt from its parts when it crosses a process (Ray replicas)
        return type(self), (self.adapter_id, self.problem, self.fix)


class AdapterNotFound(AdapterError):
    status = 404


class AdapterInvalid(AdapterError):
    """The file itself is unusable: not safetensors, truncated, unknown keys, NaN..."""

    status = 400


class AdapterForbidden(AdapterError):
    """An id this server refuses to serve (hub allow/deny patterns)."""

    status = 403


class AdapterUnavailable(AdapterError):
    """The adapter's upstream failed: a 5xx, no connection, a timeout, too many redirects."""

    status = 502


class AdapterIncompatible(AdapterError):
    """A valid adapter that does not fit the hosted model (layers, shapes, base model)."""

    status = 422


class AdapterChanged(AdapterError):
    """The processes of one image read an adapter's file at different moments and got
    different versions (it was replaced between their reads): nothing was generated."""

    status = 503


class Overloaded(LoraswapError):
    status = 503


class UnsupportedInput(LoraswapError):
    """A well-formed request the hosted model cannot take: an image for a text-only model,
    a mask for a model without inpainting, frames for an image model."""

    status = 422
