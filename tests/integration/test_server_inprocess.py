"""Server behaviour that needs a hand inside the process: unexpected errors, OOM, loading."""

import logging
import time

import pytest
import torch
from fastapi.testclient import TestClient

from loraswap.engine.config import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig


@pytest.fixture
def client(served_adapters):
    app = create_app(ServerConfig(engines=[EngineConfig(model="tiny-sd", adapters=served_adapters)]))
    with TestClient(app, raise_server_exceptions=False) as client:
        deadline = time.monotonic() + 60
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield client, app


def test_unexpected_error_is_a_plain_500_logged_with_its_traceback(client, monkeypatch, caplog):
    client, app = client

    def boom(requests, acquired=None):
        raise RuntimeError("boom in the pipeline")

    monkeypatch.setattr(app.state.engine, "generate_batch", boom)
    with caplog.at_level(logging.ERROR, logger="loraswap.server"):
        response = client.post("/", json={"inputs": "x"})
    assert response.status_code == 500
    assert response.json() == {"error": "internal server error"}
    assert "boom" not in response.text
    logged = "\n".join(r.getMessage() + str(r.exc_info) for r in caplog.records)
    assert "boom in the pipeline" in logged and "Traceback" in caplog.text
    monkeypatch.undo()
    assert client.post("/", json={"inputs": "x"}).status_code == 200, "the server keeps serving"


def test_out_of_memory_answers_503_and_keeps_serving(client, monkeypatch):
    client, app = client

    def oom(requests, acquired=None):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(app.state.engine, "generate_batch", oom)
    response = client.post("/", json={"inputs": "x"})
    assert response.status_code == 503 and "out of memory" in response.json()["error"]
    assert "retry-after" in response.headers
    monkeypatch.undo()
    assert client.post("/", json={"inputs": "x"}).status_code == 200


def test_not_ready_while_loading(served_adapters):
    release = __import__("threading").Event()

    def slow_engine(config):
        release.wait(10)
        return Engine(config)

    app = create_app(ServerConfig(engines=[EngineConfig(model="tiny-sd", adapters=served_adapters)]),
                     engine_factory=slow_engine)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/ready").status_code == 503
        loading = client.post("/", json={"inputs": "x"})
        assert loading.status_code == 503 and "loading" in loading.json()["error"]
        release.set()
        deadline = time.monotonic() + 60
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
