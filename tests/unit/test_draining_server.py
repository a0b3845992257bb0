"""The HTTP server's stop (`server/shutdown.py`): it drains the backend at once, halts it after
the drain time, and a request still open past the grace that follows is answered a JSON 503,
never uvicorn's traceback and plain-text 500."""

import asyncio
import logging
import threading
import time

import httpx
import pytest
from support.fakes import FakeBackend, start_on_thread
from support.servers import free_port

from loraswap.server import shutdown
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig


class HangingBackend(FakeBackend):
    """Generates nothing, ever; counts the drains and halts the server asks for, and when."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, float]] = []
        self.generating = threading.Event()

    def drain(self) -> None:
        self.calls.append(("drain", time.monotonic()))

    def halt(self) -> None:
        self.calls.append(("halt", time.monotonic()))

    async def generate(self, request, model, is_disconnected, on_step=None):
        self.generating.set()
        await asyncio.Event().wait()


def test_a_request_open_past_the_drain_and_its_grace_is_a_json_503(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(shutdown, "ANSWER_GRACE_S", 0.5)
    backend = HangingBackend()
    config = ServerConfig(port=free_port(), drain_s=0.3, state_dir=tmp_path)
    app = create_app(config, backend=backend)
    server = shutdown.draining_server(app, config, log_level="info")
    serving = start_on_thread(server)
    answers = []
    client = threading.Thread(target=lambda: answers.append(
        httpx.post(f"http://127.0.0.1:{config.port}/", json={"inputs": "x"}, timeout=30)))
    with caplog.at_level(logging.INFO):
        client.start()
        assert backend.generating.wait(30)
        stopping = time.monotonic()
        server.should_exit = True  # what SIGTERM does
        client.join(30)
        serving.join(30)
    assert not serving.is_alive()
    (answer,) = answers
    assert answer.status_code == 503 and answer.json() == {"error": "the server is shutting down; retry"}
    assert answer.headers["retry-after"] == str(config.retry_after_s)
    assert [name for name, _ in backend.calls] == ["drain", "halt"]
    drained, halted = (at - stopping for _, at in backend.calls)
    assert drained < 0.5 and halted == pytest.approx(drained + 0.3, abs=0.25), "drained at once, halted 0.3 s later"
    assert "Exception in ASGI application" not in caplog.text and "Traceback" not in caplog.text
    assert not any(record.exc_info for record in caplog.records)
