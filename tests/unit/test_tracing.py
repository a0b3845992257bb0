"""OpenTelemetry traces: one request through the in-process app is one span with a child for
each part of its path, the worker's and the store's threads' included, with their attributes;
tracing is off unless asked for, and asking for an exporter that is not installed says so."""

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from support.fakes import fake_app
from support.servers import wait_ready

from loraswap import tracing
from loraswap.engine.config.engine import EngineConfig
from loraswap.errors import Overloaded
from loraswap.models.families import demo
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig

ONE_IMAGE = {"inputs": "a red circle", "parameters": {"num_inference_steps": 2, "seed": 1, "width": 32,
                                                      "height": 32}}
PARTS = ["parse", "read", "swap", "generate", "encode"]  # in the order they start


@pytest.fixture(scope="module")
def traced_app():
    app = create_app(ServerConfig(engines=[EngineConfig(model="demo", adapters=demo.ADAPTERS, compile=False)]))
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    with TestClient(app) as client:
        wait_ready(client, 60)
        tracing.use_tracer_provider(provider)  # after the warm-up: only the requests' spans
        try:
            yield client, spans
        finally:
            tracing.use_tracer_provider(None)


def _tree(spans) -> dict[str, list[str]]:
    """span name -> the names of its children, over the spans of one trace."""
    names = {s.context.span_id: s.name for s in spans}
    tree: dict[str, list[str]] = {}
    for s in sorted(spans, key=lambda s: s.start_time):
        parent = names.get(s.parent.span_id) if s.parent else None
        tree.setdefault(str(parent), []).append(s.name)
    return tree


def test_one_request_is_one_span_with_a_child_for_each_part(traced_app):
    client, spans = traced_app
    spans.clear()
    response = client.post("/", json=ONE_IMAGE, headers={"lora": "striped", "accept": "image/png",
                                                         "x-request-id": "traced-1"})
    assert response.status_code == 200, response.text
    finished = spans.get_finished_spans()
    (request,) = [s for s in finished if s.kind == SpanKind.SERVER]
    assert request.name == "POST /" and request.parent is None
    assert {s.context.trace_id for s in finished} == {request.context.trace_id}, "one trace"
    assert _tree(finished) == {"None": ["POST /"], "POST /": PARTS}
    by_name = {s.name: s for s in finished}
    assert dict(request.attributes) == {
        "http.request.method": "POST", "url.path": "/", "loraswap.request_id": "traced-1", "http.route": "/",
        "http.response.status_code": 200}
    generate = by_name["generate"].attributes
    assert (generate["loraswap.model"], tuple(generate["loraswap.adapters"]), generate["loraswap.steps"],
            generate["loraswap.width"], generate["loraswap.height"], generate["loraswap.images"],
            generate["loraswap.request_id"]) == ("demo", ("striped",), 2, 32, 32, 1, "traced-1")
    assert tuple(by_name["read"].attributes["loraswap.adapters"]) == ("striped",)
    assert tuple(by_name["swap"].attributes["loraswap.adapters"]) == ("striped",)
    assert (by_name["encode"].attributes["loraswap.width"], by_name["encode"].attributes["loraswap.height"]) == (32, 32)
    for part in PARTS:  # each within the request, in order
        assert request.start_time <= by_name[part].start_time <= by_name[part].end_time <= request.end_time
    ends = [by_name[p] for p in PARTS]
    assert all(a.end_time <= b.start_time for a, b in zip(ends, ends[1:])), "parse, read, swap, generate, encode"


def test_a_callers_traceparent_makes_the_request_its_child(traced_app):
    client, spans = traced_app
    spans.clear()
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    assert client.get("/health", headers={"traceparent": f"00-{trace_id}-{parent_id}-01"}).status_code == 200
    (request,) = spans.get_finished_spans()
    assert request.name == "GET /health" and request.parent.span_id == int(parent_id, 16)
    assert request.context.trace_id == int(trace_id, 16)


def test_a_failed_request_is_an_error_span(monkeypatch):
    app, backend = fake_app()

    async def busy(*args, **kwargs):
        raise Overloaded("the queue is full")

    monkeypatch.setattr(backend, "generate", busy)
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracing.use_tracer_provider(provider)
    try:
        with TestClient(app) as client:
            assert client.post("/", json=ONE_IMAGE).status_code == 503
    finally:
        tracing.use_tracer_provider(None)
    (request,) = [s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert request.attributes["http.response.status_code"] == 503 and not request.status.is_ok


def test_a_batchs_context_joins_the_ids_and_keeps_the_first_requests_spans():
    first = tracing.RequestContext("a", object())
    joined = tracing.RequestContext.joined([first, tracing.RequestContext("b", None), tracing.RequestContext("a")])
    assert joined.request_id == "a,b" and joined.trace_context is first.trace_context
    assert tracing.RequestContext.joined([tracing.RequestContext()]).request_id is None


@pytest.mark.parametrize("flag,environ,on", [
    (False, {}, False),
    (True, {}, True),
    (False, {"OTEL_TRACES_EXPORTER": "console"}, True),
    (False, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
    (False, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
    (True, {"OTEL_SDK_DISABLED": "true"}, False),
    (True, {"OTEL_TRACES_EXPORTER": "none"}, False),
    (False, {"OTEL_SERVICE_NAME": "x"}, False),
])
def test_tracing_is_off_unless_asked_for(flag, environ, on):
    assert tracing.wanted(flag, environ) is on


def test_the_exporters_are_found_by_name_and_a_missing_one_is_named():
    assert [type(e) for e in tracing.span_exporters({"OTEL_TRACES_EXPORTER": "console"})] == [ConsoleSpanExporter]
    with pytest.raises(tracing.TracingUnavailable, match="'zipkin_json'.*pip install 'loraswap\\[tracing\\]'"):
        list(tracing.span_exporters({"OTEL_TRACES_EXPORTER": "console,zipkin_json"}))
