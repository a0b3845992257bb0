"""An adapter a request names is made an `AdapterRef` and checked once, where the request is
parsed, and its file is located once, by routing, which hands the file on to the lease: no
second check nor second look-up on the way to the weights. An admin keep or evict the same."""

import sys

import pytest
from fastapi.testclient import TestClient
from support.servers import wait_ready

from loraswap.adapters import reference
from loraswap.adapters.sources.choose import AdapterSources
from loraswap.engine.config.engine import EngineConfig
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig


@pytest.fixture
def served(adapter_factory):
    folder = adapter_factory.root / "once"
    adapter_factory("style", "tiny-sd", rank=4, seed=51, folder=folder)
    adapter_factory("styles/second", "tiny-sd", rank=4, seed=52, folder=folder)
    app = create_app(ServerConfig(engines=[EngineConfig(model="tiny-sd", adapters=folder, compile=False)]))
    with TestClient(app) as client:
        wait_ready(client, 120)
        yield client, app


def _counted(monkeypatch, owner, name: str) -> list:
    """Calls of `owner.name`, wherever it is called from: every loraswap module that imported
    the same function by name is patched too, so a check added in another module is counted."""
    calls, real = [], getattr(owner, name)

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    holders = [owner] + [module for module_name, module in list(sys.modules.items())
                         if module_name.startswith("loraswap.") and getattr(module, name, None) is real]
    for holder in holders:
        monkeypatch.setattr(holder, name, counting)
    return calls


@pytest.mark.parametrize("cached", [False, True])
def test_each_adapter_is_checked_once_and_located_once_from_the_route_to_the_weights(served, monkeypatch, cached):
    client, app = served
    request = {"inputs": "a red fox", "parameters": {"num_inference_steps": 1, "width": 64, "height": 64}}
    if cached:  # read once before: the request finds them in the cache
        assert client.post("/", json=request, headers={"lora": "style:0.7, styles/second"}).status_code == 200
    checked_names = _counted(monkeypatch, reference, "check_adapter_id")
    checked_ids = _counted(monkeypatch, reference, "check_id")
    engine = app.state.deployment.hosted[0].engine
    located = _counted(monkeypatch, AdapterSources, "locate")
    response = client.post("/", json=request, headers={"lora": "style:0.7, styles/second"})
    assert response.status_code == 200, response.text
    assert engine.applied_ids == (("style", 0.7), ("styles/second", 1.0))
    assert checked_names == [("style",), ("styles/second",)] and checked_ids == [], \
        "each name checked once, where the request is parsed"
    assert [ref.adapter_id for _, ref in located] == ["style", "styles/second"], "each file located once"


def test_an_admin_keep_or_evict_locates_the_adapter_once(served, monkeypatch):
    """Keeping and evicting go by routing as a request does: the file routing found is the one
    the store keeps or evicts, not located again (a cached adapter is evicted without a look)."""
    client, app = served
    engine = app.state.deployment.hosted[0].engine
    located = _counted(monkeypatch, AdapterSources, "locate")
    assert client.post("/adapters/style/load").status_code == 200
    assert [ref.adapter_id for _, ref in located] == ["style"], "a keep locates its file once"
    assert engine.adapters.cache.get("style").kept
    located.clear()
    assert client.delete("/adapters/styles/second").status_code == 200
    assert [ref.adapter_id for _, ref in located] == ["styles/second"], "an evict locates its file once"
    located.clear()
    assert client.delete("/adapters/style").status_code == 200
    assert located == [] and engine.adapters.cache.get("style") is None, "a cached adapter: evicted, not located"
