"""Several base models in one server: adapters routed by their declared base model, else by
the family their metadata names, else by the model whose layers they fit."""

import io
import json
import struct

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file
from support.servers import wait_ready

from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig

BODY = {"inputs": "a fox", "parameters": {"seed": 4, "num_inference_steps": 2}}


@pytest.fixture(scope="module")
def two_models(adapter_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("multi")
    adapter_factory("for-sd", "tiny-sd", rank=4, base_model="tiny-sd", seed=400, folder=root)
    adapter_factory("for-sdxl", "tiny-sdxl", rank=4, alpha=8.0, base_model="tiny-sdxl", seed=401, folder=root)
    adapter_factory("undeclared", "tiny-sd", rank=4, seed=402, folder=root)
    adapter_factory("for-flux", "tiny-flux", rank=4, base_model="tiny-flux", seed=403, folder=root)
    adapter_factory("sdxl-undeclared", "tiny-sdxl", rank=4, seed=404, folder=root)
    _with_metadata(adapter_factory("sdxl-kohya-says", "tiny-sdxl", rank=4, fmt="kohya", seed=405, folder=root),
                   {"ss_base_model_version": "sdxl_base_v1-0"})
    adapter_factory("flux-undeclared", "tiny-flux", rank=4, seed=406, folder=root)
    configs = [EngineConfig(model=m, adapters=root) for m in ("tiny-sd", "tiny-sdxl")]
    app = create_app(ServerConfig(engines=configs))
    with TestClient(app) as client:
        wait_ready(client, 60)
        yield client, app, root


def _with_metadata(path, extra: dict) -> None:
    """The file again, its metadata with `extra` added (what a trainer writes beside the weights)."""
    with safe_open(str(path), "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    save_file(tensors, str(path), metadata={**metadata, **extra})


def png(response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.asarray(Image.open(io.BytesIO(response.content)).convert("RGB"))


def test_routing_by_declared_base_model(two_models):
    client, app, root = two_models
    assert client.get("/ready").json()["models"] == ["tiny-sd", "tiny-sdxl"]
    sdxl = png(client.post("/", json=BODY, headers={"lora": "for-sdxl", "accept": "image/png"}))
    reference = Engine(EngineConfig(model="tiny-sdxl", adapters=root, warmup=False))
    expected = reference.generate(GenerateRequest(prompt="a fox", seed=4, steps=2, loras=[("for-sdxl", 1.0)]))
    assert np.array_equal(sdxl, np.asarray(expected.image))
    sd = app.state.deployment.hosted[0]
    png(client.post("/", json=BODY, headers={"lora": "for-sd", "accept": "image/png"}))
    assert sd.engine.applied_ids == (("for-sd", 1.0),)
    png(client.post("/", json=BODY, headers={"lora": "undeclared", "accept": "image/png"}))
    assert sd.engine.applied_ids == (("undeclared", 1.0),), "an adapter that declares nothing goes to the default"
    assert app.state.deployment.hosted[1].engine.applied_ids == (("for-sdxl", 1.0),)


def test_base_model_by_name_and_refusals(two_models):
    client, _, _ = two_models
    by_name = png(client.post("/models/tiny-sdxl", json=BODY, headers={"accept": "image/png"}))
    reference = Engine(EngineConfig(model="tiny-sdxl", warmup=False))
    assert np.array_equal(by_name, np.asarray(reference.generate(GenerateRequest(prompt="a fox", seed=4,
                                                                                  steps=2)).image))
    refused = client.post("/", json=BODY, headers={"lora": "for-flux"})
    assert refused.status_code == 422
    assert "made for tiny-flux" in refused.json()["error"] and "tiny-sd, tiny-sdxl" in refused.json()["error"]
    mixed = client.post("/", json=BODY, headers={"lora": "for-sd, for-sdxl"})
    assert mixed.status_code == 422 and "one base model" in mixed.json()["error"]
    wrong = client.post("/models/tiny-sd", json=BODY, headers={"lora": "for-sdxl"})
    assert wrong.status_code == 422
    openai = client.post("/v1/images/generations", json={"model": "tiny-sdxl", "prompt": "x", "size": "64x64"})
    assert openai.status_code == 200


def test_keep_evict_and_list_go_to_the_adapters_base_model(two_models):
    client, app, _ = two_models
    sd, sdxl = (h.engine for h in app.state.deployment.hosted)
    # 1. keep: each adapter read and kept by the engine of its declared base model
    for adapter_id, model in (("for-sdxl", "tiny-sdxl"), ("for-sd", "tiny-sd"), ("undeclared", "tiny-sd")):
        kept = client.post(f"/adapters/{adapter_id}/load")
        assert kept.status_code == 200, kept.text
        assert kept.json()["kept"] and kept.json()["model"] == model and kept.json()["layers"] > 0
    assert {r["id"] for r in sdxl.adapters.rows() if r["kept"]} == {"for-sdxl"}
    assert {r["id"] for r in sd.adapters.rows() if r["kept"]} == {"for-sd", "undeclared"}
    refused = client.post("/adapters/for-flux/load")
    assert refused.status_code == 422 and "tiny-sd, tiny-sdxl" in refused.json()["error"]
    # 2. list: one row per adapter over both models, naming the model that holds it
    listed = client.get("/adapters").json()
    assert listed["models"] == ["tiny-sd", "tiny-sdxl"]
    rows = {row["id"]: row for row in listed["adapters"]}
    assert set(rows) == {"for-sd", "for-sdxl", "undeclared", "for-flux", "sdxl-undeclared", "sdxl-kohya-says",
                         "flux-undeclared"}
    assert (rows["for-sdxl"]["model"], rows["for-sdxl"]["kept"], rows["for-sdxl"]["base_model"]) == (
        "tiny-sdxl", True, "tiny-sdxl")
    assert (rows["for-sd"]["model"], rows["for-sd"]["kept"]) == ("tiny-sd", True)
    assert (rows["for-flux"]["model"], rows["for-flux"]["cached"], rows["for-flux"]["kept"]) == (None, "disk", False)
    # 3. evict: dropped from the engine that kept it
    evicted = client.delete("/adapters/for-sdxl")
    assert evicted.status_code == 200 and evicted.json() == {"id": "for-sdxl", "cached": "disk", "kept": False}
    assert sdxl.adapters.cache.get("for-sdxl") is None
    rows = {row["id"]: row for row in client.get("/adapters").json()["adapters"]}
    assert (rows["for-sdxl"]["cached"], rows["for-sdxl"]["kept"]) == ("disk", False)
    for adapter_id in ("for-sd", "undeclared"):
        assert client.delete(f"/adapters/{adapter_id}").status_code == 200
    assert not any(r["kept"] for engine in (sd, sdxl) for r in engine.adapters.rows())


def test_an_adapter_naming_no_base_model_goes_to_the_model_it_is_for(two_models):
    client, app, _ = two_models
    sdxl = app.state.deployment.hosted[1].engine
    png(client.post("/", json=BODY, headers={"lora": "sdxl-undeclared", "accept": "image/png"}))
    assert sdxl.applied_ids == (("sdxl-undeclared", 1.0),), "its layers fit tiny-sdxl alone"
    png(client.post("/", json=BODY, headers={"lora": "sdxl-kohya-says", "accept": "image/png"}))
    assert sdxl.applied_ids == (("sdxl-kohya-says", 1.0),), "kohya's ss_base_model_version names SDXL"
    refused = client.post("/", json=BODY, headers={"lora": "flux-undeclared"})
    assert refused.status_code == 422, refused.text
    assert "fit none of the hosted models (tiny-sd, tiny-sdxl)" in refused.json()["error"]
    rows = {row["id"]: row for row in client.get("/adapters").json()["adapters"]}
    assert rows["sdxl-undeclared"]["model"] == "tiny-sdxl"


def test_a_files_own_defect_is_named_as_a_one_model_server_names_it(two_models):
    """A truncated file, or one whose header claims a 2^60-element tensor: 400 naming the
    defect (as on one model, test_hostile_adapters), never 422 "fits none of the hosted models"."""
    client, _, root = two_models
    whole = (root / "undeclared.safetensors").read_bytes()
    header = json.dumps({"a": {"dtype": "F16", "shape": [2**30, 2**30], "data_offsets": [0, 2**61]}}).encode()
    broken = {"truncated": whole[: len(whole) // 2], "claims-2-60": struct.pack("<Q", len(header)) + header + bytes(16)}
    try:
        for adapter_id, data in broken.items():
            (root / f"{adapter_id}.safetensors").write_bytes(data)
            for response in (client.post("/", json=BODY, headers={"lora": adapter_id}),
                             client.post(f"/adapters/{adapter_id}/load")):
                assert response.status_code == 400, response.text
                assert "lies outside the file (truncated download?)" in response.json()["error"]
        png(client.post("/", json=BODY, headers={"lora": "undeclared", "accept": "image/png"}))
    finally:
        for adapter_id in broken:
            (root / f"{adapter_id}.safetensors").unlink(missing_ok=True)
