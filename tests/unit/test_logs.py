"""Log lines an operator can search: one JSON object a line, every line a request causes
carrying its id (on the worker's and the store's threads too), the id taken from the client
or made and answered, uvicorn's access line in the same form, and the libraries' start-up
noise kept out at the default level."""

import asyncio
import json
import logging
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from support.fakes import fake_app, start_on_thread
from support.servers import free_port, wait_ready

from loraswap.adapters.reference import AdapterRef
from loraswap.engine.config.engine import EngineConfig
from loraswap.logs import (
    JsonAccessFormatter,
    JsonFormatter,
    LibraryNoise,
    StderrHandler,
    TextFormatter,
    configure_logging,
    request_id,
)
from loraswap.models.families import demo
from loraswap.server.access_log import HideQuery, log_config
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig
from loraswap.server.fetch_pool import FetchPool

ONE_IMAGE = {"inputs": "a red circle", "parameters": {"num_inference_steps": 2, "seed": 1}}


class Lines(logging.Handler):
    """Each line as its formatter writes it, formatted on the thread that logs it (as a stream
    handler does), with that thread's name."""

    def __init__(self, formatter: logging.Formatter, *filters):
        super().__init__()
        self.setFormatter(formatter)
        for f in filters:
            self.addFilter(f)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record):
        self.lines.append((record.threadName, self.format(record)))


@contextmanager
def logged(logger_name: str, formatter: logging.Formatter, *filters, level=logging.DEBUG):
    handler = Lines(formatter, *filters)
    logger = logging.getLogger(logger_name)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def _record(message="m %s", args=("x",), **extra) -> logging.LogRecord:
    record = logging.LogRecord("loraswap.server", logging.WARNING, __file__, 1, message, args, None)
    record.__dict__.update(extra)
    return record


def test_a_json_line_has_time_level_logger_message_request_id_and_extra_fields():
    token = request_id.set("req-7")
    try:
        line = json.loads(JsonFormatter().format(_record(adapter="styles/anime", status=404)))
    finally:
        request_id.reset(token)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", line.pop("time"))
    assert line == {"level": "WARNING", "logger": "loraswap.server", "message": "m x", "thread": "MainThread",
                    "request_id": "req-7", "adapter": "styles/anime", "status": 404}


def test_a_line_outside_a_request_has_no_id_and_a_traceback_is_one_field():
    try:
        raise ValueError("bad value")
    except ValueError:
        record = logging.LogRecord("loraswap.server", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    text = JsonFormatter().format(record)
    assert "\n" not in text, "one line"
    line = json.loads(text)
    assert "request_id" not in line and line["exception"].startswith("Traceback") and "bad value" in line["exception"]
    assert TextFormatter().format(_record()).endswith("WARNING loraswap.server: m x")


def test_configure_logging_sets_the_level_and_format_and_replaces_only_its_own_handler():
    root = logging.getLogger()
    # others': a test's capture (one of ours an earlier CLI test left is replaced, as it should be)
    level, others = root.level, [h for h in root.handlers if not isinstance(h, StderrHandler)]
    try:
        configure_logging("warning", "text")
        configure_logging("error", "json")
        ours = [h for h in root.handlers if h not in others]
        assert len(ours) == 1 and isinstance(ours[0].formatter, JsonFormatter), "called again: one handler of ours"
        assert root.level == logging.ERROR and all(h in root.handlers for h in others), "a test's capture stays"
    finally:
        for handler in [h for h in root.handlers if h not in others]:
            root.removeHandler(handler)
        root.setLevel(level)


def test_uvicorns_general_lines_are_not_named_error():
    record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, "Started server process [%d]", (7,), None)
    assert json.loads(JsonFormatter().format(record))["logger"] == "uvicorn"
    assert TextFormatter().format(record).endswith("INFO uvicorn: Started server process [7]")


def test_the_access_line_in_json_has_its_parts_and_no_query():
    config = log_config("json")
    assert config["handlers"]["access"]["filters"] == ["hide_query"]
    access = config["formatters"]["access"]
    formatter = access["()"](**{k: v for k, v in access.items() if k != "()"})
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", "/v1/videos/x?api_key=SECRET", "1.1", 401), None)
    assert HideQuery().filter(record)
    line = json.loads(formatter.format(record))
    assert "SECRET" not in json.dumps(line)
    assert {k: line[k] for k in ("client", "method", "path", "http_version", "status")} == {
        "client": "127.0.0.1:5", "method": "GET", "path": "/v1/videos/x?(query hidden)", "http_version": "1.1",
        "status": 401}
    assert all(logger.get("level") is None for logger in config["loggers"].values()), "the server's level rules"


@pytest.fixture(scope="module")
def demo_app():
    app = create_app(ServerConfig(engines=[EngineConfig(model="demo", adapters=demo.ADAPTERS, compile=False)]))
    with TestClient(app) as client:
        wait_ready(client, 60)
        yield client, app


def test_every_line_a_request_causes_carries_its_id_on_every_thread(demo_app, monkeypatch):
    client, app = demo_app
    store = app.state.deployment.hosted[0].engine.adapters
    lease_now = store.lease_now

    def lease_logging(refs, located=None):  # a line from the thread that reads the adapters
        logging.getLogger("loraswap.adapters.store").info("reading %s", ", ".join(ref.adapter_id for ref in refs))
        return lease_now(refs, located)

    monkeypatch.setattr(store, "lease_now", lease_logging)
    with logged("loraswap", JsonFormatter()) as lines:
        response = client.post("/", json=ONE_IMAGE, headers={"x-request-id": "trace-me-1", "lora": "outline"})
        assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == "trace-me-1"
    by_thread: dict[str, list[str]] = {}
    for thread, text in lines:
        line = json.loads(text)
        assert line.get("request_id") == "trace-me-1", line
        by_thread.setdefault(thread.rsplit("_", 1)[0], []).append(line["message"])
    assert by_thread["loraswap-prefetch"] == ["reading outline"]
    assert any(m.startswith("swap to (('outline', 1.0),)") for m in by_thread["loraswap-gpu-worker"])
    assert any(m.startswith("/ adapters=outline:1 ") for m in sum(by_thread.values(), [])), by_thread
    after = client.post("/", json=ONE_IMAGE)
    made = after.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made) and made != "trace-me-1", "each request its own"


def test_the_fetch_pool_and_anyios_threads_run_in_the_requests_context():
    remote = SimpleNamespace(settings=SimpleNamespace(total_timeout=60))
    sources = SimpleNamespace(remote=remote, may_wait=lambda ref: ref.adapter_id == "url:slow")
    pool = FetchPool(threads=1)

    def where() -> tuple[str, str | None]:
        return threading.current_thread().name, request_id.get()

    async def main():
        request_id.set("fetch-1")
        return [await pool.run(sources, [AdapterRef(adapter_id)], where) for adapter_id in ("url:slow", "url:here")]

    try:
        (fetch_thread, on_fetch), (anyio_thread, on_anyio) = asyncio.run(main())
    finally:
        pool.close()
    assert fetch_thread.startswith("loraswap-fetch") and on_fetch == "fetch-1"
    assert anyio_thread != fetch_thread and on_anyio == "fetch-1"


@pytest.mark.parametrize("given,kept", [
    ("abc-123", True), ("Root=1-5759e988-bd862e3fe1be46a994272793", True), ("a" * 128, True),
    ("a" * 129, False), ("two words", False), ("line\nbreak", False), ("", False), ('{"json": 1}', False),
])
def test_a_clients_id_is_kept_only_when_it_is_a_plain_token(given, kept):
    app, _ = fake_app()
    with TestClient(app) as client:
        answered = client.get("/health", headers={"x-request-id": given} if given else {}).headers["x-request-id"]
    assert (answered == given) is kept
    if not kept:
        assert re.fullmatch(r"[0-9a-f]{32}", answered)


def test_errors_answer_the_id_too():
    app, _ = fake_app(api_keys=["k"])
    with TestClient(app) as client:
        refused = client.post("/", json=ONE_IMAGE, headers={"x-request-id": "refused-1"})
        missing = client.get("/no/such/route", headers={"x-request-id": "missing-1"})
    assert (refused.status_code, refused.headers["x-request-id"]) == (401, "refused-1")
    assert (missing.status_code, missing.headers["x-request-id"]) == (404, "missing-1")


def test_uvicorns_access_line_carries_the_request_id():
    app, _ = fake_app()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="info",
                                           log_config=None, access_log=True))
    with logged("uvicorn.access", JsonAccessFormatter(), HideQuery(), level=logging.INFO) as lines:
        thread = start_on_thread(server)
        try:
            url = f"http://127.0.0.1:{server.config.port}"
            assert httpx.get(url + "/health?api_key=SECRET", headers={"x-request-id": "access-1"}).status_code == 200
            time.sleep(0.3)  # the access line is written as the response starts
        finally:
            server.should_exit = True
            thread.join(10)
    (line,) = [json.loads(text) for _, text in lines]
    assert line["request_id"] == "access-1" and line["message"].endswith('"GET /health?(query hidden) HTTP/1.1" 200')
    assert (line["method"], line["path"], line["status"]) == ("GET", "/health?(query hidden)", 200)


def test_library_noise_is_held_until_the_level_is_known_then_shown_at_debug_only():
    def noisy(name, message):
        record = logging.LogRecord(name, logging.WARNING, __file__, 1, message, (), None)
        return record

    lines = []

    class Sink(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    torchao = logging.getLogger("torchao")
    earlier, torchao.filters = torchao.filters, []  # the filters an earlier CLI test left on it
    for show in (False, True):
        noise, lines[:] = LibraryNoise(), []
        torchao.addFilter(noise)
        sink = Sink()
        torchao.addHandler(sink)
        try:
            failed = "Failed to load /x/_C_mxfp8.so: Could not load this library"
            torchao.handle(noisy("torchao", failed))
            torchao.handle(noisy("torchao", "a warning of its own"))  # not known noise: written at once
            assert lines == ["a warning of its own"]
            noise.settle(show)
            assert lines == ["a warning of its own", *([failed] if show else [])]
            torchao.handle(noisy("torchao", failed))  # once settled: shown at debug, dropped otherwise
            assert lines.count(failed) == (2 if show else 0)
        finally:
            torchao.removeFilter(noise)
            torchao.removeHandler(sink)
    torchao.filters = earlier


NOISE = ("Failed to load", "register_constant()", "Unable to import `torchao` Tensor objects",
         "requires torchvision (not installed)")


def _noise_lines(*argv: str) -> list[str]:
    result = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [line for line in result.stderr.splitlines() if any(n in line for n in NOISE)]


@pytest.mark.slow
def test_the_cli_writes_none_of_the_libraries_start_up_noise():
    # the modules `serve` imports, imported without the CLI: the noise this machine's libraries write
    written = _noise_lines("-c", "import loraswap.server.app, loraswap.engine.engine")
    if not written:
        pytest.skip("this machine's torch, torchao and transformers write none of the known noise")
    # --print-config imports the same and exits before logging is set up: the noise held is never written
    assert _noise_lines("-m", "loraswap", "serve", "--model", "demo", "--print-config") == []
