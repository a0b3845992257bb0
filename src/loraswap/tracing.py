"""OpenTelemetry traces of the requests: an optional extra (`pip install 'loraswap[tracing]'`),
off unless configured.

Each HTTP request is one span (`server/request_ids.py`), with a child for each part of its
path: `parse`, `read` (its adapters, on the store's threads), `swap` and `generate` (on the
GPU worker's thread) and `encode`. Without a configured SDK every span is the API's
non-recording one, so the code never asks whether tracing is on.

On with `loraswap serve --otel`, or with any of the standard variables that name where spans
go: OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
(OTEL_SDK_DISABLED=true keeps it off). The exporter is OTLP over HTTP unless
OTEL_TRACES_EXPORTER names others (`console`, `otlp_proto_grpc`, ...: any installed); the
service is `loraswap` unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES name it; a
`traceparent` header makes the request's span a child of the caller's.

Work a request hands to another thread runs there in its `RequestContext`: its request id
(`logs.request_id`) and its current span, so the thread's log lines and spans are the
request's.
"""

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from loraswap.errors import LoraswapError
from loraswap.logs import request_id

TRACER_NAME = "loraswap"
# the variables that name where spans go: any of them set turns tracing on
EXPORT_VARIABLES = ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


class TracingUnavailable(LoraswapError):
    """Tracing was asked for, but OpenTelemetry's SDK or the exporter named is not installed."""


def wanted(flag: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether tracing is asked for: `--otel`, or a variable naming where spans go (and
    neither OTEL_SDK_DISABLED=true nor OTEL_TRACES_EXPORTER=none)."""
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip()
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or exporter == "none":
        return False
    return flag or bool(exporter) or any(environ.get(name) for name in EXPORT_VARIABLES[1:])


def configure_tracing(flag: bool) -> bool:
    """Send the spans out, when `--otel` or the OTEL_* variables ask; True if tracing is on."""
    if not wanted(flag):
        return False
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise TracingUnavailable("tracing needs OpenTelemetry's SDK: pip install 'loraswap[tracing]'") from None
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return True  # one is set up already (opentelemetry-instrument): the spans go to it
    resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: TRACER_NAME}))
    provider = TracerProvider(resource=resource)
    for exporter in span_exporters(os.environ):
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return True


def span_exporters(environ: Mapping[str, str]) -> Iterator:
    """The span exporters OTEL_TRACES_EXPORTER names (default `otlp`, over HTTP unless
    OTEL_EXPORTER_OTLP_PROTOCOL says grpc), found as the SDK finds them: by entry point."""
    for name in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(","):
        name = name.strip()
        if name in ("", "none"):
            continue
        if name == "otlp":
            protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            name = "otlp_proto_grpc" if protocol == "grpc" else "otlp_proto_http"
        found = entry_points(group="opentelemetry_traces_exporter", name=name)
        if not found:
            raise TracingUnavailable(f"no OpenTelemetry span exporter {name!r} is installed (OTEL_TRACES_EXPORTER); "
                                     "pip install 'loraswap[tracing]' gives otlp (over HTTP) and console")
        yield next(iter(found)).load()()


_tracer = trace.get_tracer(TRACER_NAME)  # a proxy: it follows the provider set later


def use_tracer_provider(provider=None) -> None:
    """Make loraswap's spans with `provider` (a test's), or with the global one again (None)."""
    global _tracer
    _tracer = provider.get_tracer(TRACER_NAME) if provider is not None else trace.get_tracer(TRACER_NAME)


def _attributes(attributes: Mapping[str, object] | None) -> dict:
    """Attributes as OpenTelemetry takes them: no None, sequences as lists of strings."""
    clean = {}
    for key, value in (attributes or {}).items():
        if isinstance(value, list | tuple):
            value = [str(v) for v in value]
        if value is not None:
            clean[key] = value
    return clean


@contextlib.contextmanager
def span(name: str, attributes: Mapping[str, object] | None = None, **options) -> Iterator:
    """A span `name` around the block, child of the current one; `options`: OpenTelemetry's
    (`kind`, `context`). An exception is recorded on it and raised on."""
    with _tracer.start_as_current_span(name, attributes=_attributes(attributes), **options) as current:
        yield current


def traced(name: str, describe: Callable[..., Mapping[str, object]] | None = None):
    """A span `name` around each call of the decorated function (or coroutine function), its
    attributes `describe(*args, **kwargs)`."""
    def decorate(function):
        if inspect.iscoroutinefunction(function):
            @functools.wraps(function)
            async def run_async(*args, **kwargs):
                with span(name, describe(*args, **kwargs) if describe else None):
                    return await function(*args, **kwargs)
            return run_async

        @functools.wraps(function)
        def run(*args, **kwargs):
            with span(name, describe(*args, **kwargs) if describe else None):
                return function(*args, **kwargs)
        return run

    return decorate


def incoming_context(headers: Mapping[str, str]):
    """The caller's trace from its `traceparent` header (W3C Trace Context), if it sent one."""
    return propagate.extract(headers)


def adapter_attributes(loras: Iterable[tuple[str, float]]) -> dict:
    return {"loraswap.adapters": [adapter_id for adapter_id, _ in loras]}


def generation_attributes(model: str, requests: list, call: Mapping[str, object]) -> dict:
    """A batch's attributes: model, adapters, steps, size, how many images, whose requests.
    A request's missing steps or size are the pipeline call's (`call`, the model's defaults)."""
    first = requests[0]
    return {"loraswap.model": model, **adapter_attributes((ref.adapter_id, ref.scale) for ref in first.loras),
            "loraswap.steps": first.steps or call.get("num_inference_steps"),
            "loraswap.width": first.width or call.get("width"), "loraswap.height": first.height or call.get("height"),
            "loraswap.images": len(requests), "loraswap.request_id": request_id.get()}


@dataclass(frozen=True)
class RequestContext:
    """What a thread working for a request needs so that its log lines carry the request's id
    and its spans are the request's children: taken where the request is (`capture`), entered
    on the thread (`entered`, `run`)."""

    request_id: str | None = None
    trace_context: object | None = None  # OpenTelemetry's Context

    @classmethod
    def capture(cls) -> "RequestContext":
        return cls(request_id.get(), otel_context.get_current())

    @classmethod
    def joined(cls, contexts: list["RequestContext"]) -> "RequestContext":
        """A batch's: the requests' ids joined by commas; the spans go under the first request's."""
        ids = dict.fromkeys(c.request_id for c in contexts if c.request_id)
        return cls(",".join(ids) or None, contexts[0].trace_context if contexts else None)

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        token = request_id.set(self.request_id)
        attached = otel_context.attach(self.trace_context) if self.trace_context is not None else None
        try:
            yield
        finally:
            if attached is not None:
                otel_context.detach(attached)
            request_id.reset(token)

    def run(self, function: Callable, *args, **kwargs):
        """`function(*args, **kwargs)` in this context."""
        with self.entered():
            return function(*args, **kwargs)
