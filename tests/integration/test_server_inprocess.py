"""Server behaviour that needs a hand inside the process: unexpected errors, faults injected
halfway through a swap, OOM during generation, loading."""

import copy
import logging

import pytest
import torch
from fastapi.testclient import TestClient
from support.errors import error_message
from support.numerics import assert_bitwise_equal, weights_snapshot
from support.servers import wait_ready
from torch.overrides import TorchFunctionMode

from loraswap.adapters.reference import AdapterRef
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.swap.fused import FusedSwapper
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig


@pytest.fixture
def client(served_adapters):
    app = create_app(ServerConfig(engines=[EngineConfig(model="tiny-sd", adapters=served_adapters)]))
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_ready(client, 60)
        yield client, app


def test_unexpected_error_is_a_plain_500_logged_with_its_traceback(client, monkeypatch, caplog):
    client, app = client

    def boom(requests, lease, on_step=None, on_latents=None):
        raise RuntimeError("boom in the pipeline")

    monkeypatch.setattr(app.state.deployment.hosted[0].engine, "generate_batch", boom)
    with caplog.at_level(logging.ERROR, logger="loraswap.server"):
        response = client.post("/", json={"inputs": "x"})
    assert response.status_code == 500
    assert response.json() == {"error": "internal server error"}
    assert "boom" not in response.text
    logged = "\n".join(r.getMessage() + str(r.exc_info) for r in caplog.records)
    assert "boom in the pipeline" in logged and "Traceback" in caplog.text
    monkeypatch.undo()
    assert client.post("/", json={"inputs": "x"}).status_code == 200, "the server keeps serving"


class FailHalfway(TorchFunctionMode):
    """Counts torch calls; raises `error` at call number `at` (None: only count). Whatever ops
    the swap uses, this fails it halfway."""

    def __init__(self, at: int | None, error: BaseException):
        super().__init__()
        self.at, self.error, self.calls = at, error, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return func(*args, **(kwargs or {}))


def _swap_failing_halfway(monkeypatch, engine, error: BaseException):
    """Make the next swap (from "style" to "styles/second") fail halfway through its torch calls.

    The calls are counted on a scratch copy of the model making the same swap; the real one
    runs on the GPU worker thread, where the patched `apply` enters the failing mode."""
    scratch = FusedSwapper({name: copy.deepcopy(module) for name, module in engine.components.items()})
    scratch.apply([(engine.adapters.read(AdapterRef("style")), 1.0)])
    count = FailHalfway(None, error)
    with count:
        scratch.apply([(engine.adapters.read(AdapterRef("styles/second")), 1.0)])
    assert count.calls > 10, count.calls
    original = engine.swapper.apply

    def failing(adapters):
        monkeypatch.setattr(engine.swapper, "apply", original)  # once
        with FailHalfway(count.calls // 2, error):
            return original(adapters)

    monkeypatch.setattr(engine.swapper, "apply", failing)


REQUEST = {"inputs": "a red fox", "parameters": {"seed": 5, "num_inference_steps": 2, "width": 32, "height": 32}}


@pytest.mark.parametrize("error,status", [(RuntimeError("injected failure in the swap"), 500),
                                          (torch.OutOfMemoryError("CUDA out of memory (injected)"), 503)])
def test_failure_halfway_through_a_swap_leaves_the_base_and_the_next_request_succeeds(client, monkeypatch,
                                                                                       error, status):
    client, app = client
    engine = app.state.deployment.hosted[0].engine
    base = weights_snapshot(engine.components)
    reference = client.post("/", json=REQUEST, headers={"lora": "styles/second", "accept": "image/png"})
    assert reference.status_code == 200
    assert client.post("/", json=REQUEST, headers={"lora": "style"}).status_code == 200  # "style" is fused now
    _swap_failing_halfway(monkeypatch, engine, error)
    failed = client.post("/", json=REQUEST, headers={"lora": "styles/second"})
    assert failed.status_code == status, failed.text
    assert "injected" not in failed.text and "Traceback" not in failed.text
    if status == 503:
        assert "out of memory" in failed.json()["error"] and "retry-after" in failed.headers
    assert_bitwise_equal(base, engine.components)  # every touched weight restored: the base model
    assert engine.applied_ids == ()
    again = client.post("/", json=REQUEST, headers={"lora": "styles/second", "accept": "image/png"})
    assert again.status_code == 200 and again.content == reference.content


def test_out_of_memory_during_generation_answers_503_and_keeps_serving(client, monkeypatch):
    client, app = client
    engine = app.state.deployment.hosted[0].engine
    reference = client.post("/", json=REQUEST, headers={"lora": "style", "accept": "image/png"})
    calls = {"n": 0}

    def oom_on_second_step(module, args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    hook = engine.pipeline.unet.register_forward_pre_hook(oom_on_second_step)  # inside the pipeline call
    try:
        response = client.post("/", json=REQUEST, headers={"lora": "styles/second"})
    finally:
        hook.remove()
    assert calls["n"] == 2, "the OOM was raised mid-generation"
    assert response.status_code == 503 and "out of memory" in response.json()["error"]
    assert "retry-after" in response.headers and "injected" not in response.text
    assert client.post("/", json=REQUEST, headers={"lora": "styles/second"}).status_code == 200
    again = client.post("/", json=REQUEST, headers={"lora": "style", "accept": "image/png"})
    assert again.status_code == 200 and again.content == reference.content


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
        wait_ready(client, 60)


def test_an_unknown_adapter_is_a_404_that_names_no_server_path(client, served_adapters):
    client, _ = client
    folders = {str(served_adapters), str(served_adapters.resolve()), served_adapters.name}
    answers = [client.post("/", json={"inputs": "x"}, headers={"lora": "nope"}),
               client.post("/models/styles/nope", json={"inputs": "x"}),
               client.post("/v1/images/generations", json={"prompt": "x", "model": "nope"}),
               client.post("/adapters/nope/load"), client.delete("/adapters/nope")]
    for answer in answers:
        assert answer.status_code == 404, answer.text
        error = error_message(answer)
        assert "no such adapter" in error and not any(folder in error for folder in folders), error


def test_a_ready_server_freezes_what_it_loaded_and_gives_it_back_when_stopped(served_adapters):
    """Once loaded, the server takes what it loaded (its model's parameters among it) out of
    the garbage collector's full collections, which otherwise walk every module and
    parameter in the middle of a request, and hands it back when it stops, so a process that
    goes on can free it."""
    import gc

    def collectable(obj) -> bool:
        return any(o is obj for o in gc.get_objects())

    app = create_app(ServerConfig(engines=[EngineConfig(model="tiny-sd", adapters=served_adapters)]))
    with TestClient(app) as client:
        wait_ready(client, 60)
        weight = app.state.deployment.hosted[0].engine.pipeline.unet.conv_in.weight
        assert gc.is_tracked(weight) and not collectable(weight), "frozen by the time the server is ready"
        assert client.post("/", json={"inputs": "x"}).status_code == 200
    assert collectable(weight) and gc.get_freeze_count() == 0
