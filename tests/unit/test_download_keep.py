"""On a server hosting two models over one download folder, a download one model refuses
but the other takes stays on disk, listed and served from there; only a file's own defect
deletes it. In-process (tiny-sd and tiny-sdxl), the files from a server on 127.0.0.1."""

import re

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save
from support.servers import wait_ready
from support.web import Web, body

from loraswap.engine.config.engine import EngineConfig
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig

PARAMETERS = {"width": 64, "height": 64, "seed": 7, "num_inference_steps": 1}


@pytest.fixture(scope="module")
def web(adapter_factory, tmp_path_factory):
    folder = tmp_path_factory.mktemp("upstream")
    # SDXL adapters that declare no base model: tiny-sd refuses the first for its UNet layers
    # (AdapterIncompatible), the second for its second text encoder (AdapterInvalid)
    sdxl = adapter_factory("sdxl", "tiny-sdxl", rank=4, seed=5, folder=folder)
    sdxl_te = adapter_factory("sdxl-te", "tiny-sdxl", rank=4, text_encoder=True, seed=6, folder=folder)
    server = Web({"/sdxl.safetensors": body(sdxl.read_bytes()), "/sdxl-te.safetensors": body(sdxl_te.read_bytes()),
                  "/junk.safetensors": body(save({"junk.key.weight": torch.ones(4, 4)}))})
    yield server
    server.close()


@pytest.fixture(scope="module")
def served(web, tmp_path_factory):
    downloads = tmp_path_factory.mktemp("downloads")
    engines = [EngineConfig(model=model, download_dir=downloads, url_allow=[f"127.0.0.1:{web.port}"],
                            compile=False, warmup=False) for model in ("tiny-sd", "tiny-sdxl")]
    with TestClient(create_app(ServerConfig(engines=engines)), raise_server_exceptions=False) as client:
        wait_ready(client, 120)
        yield client, downloads


def _post(client, path: str, url: str):
    return client.post(path, json={"inputs": "a lighthouse", "parameters": {**PARAMETERS, "loras": [{"path": url}]}})


def _files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix == ".safetensors")


def _listed(client) -> list[str]:
    return [row["id"] for row in client.get("/adapters").json()["adapters"] if row["id"].startswith("url:")]


@pytest.mark.parametrize(("name", "status", "phrase"), [
    ("sdxl", 422, "does not exist in this model's text_encoder, unet"),
    ("sdxl-te", 400, "belong to no component of StableDiffusionPipeline (they name a text_encoder_2)"),
], ids=["incompatible", "model-specific-invalid"])
def test_a_download_one_model_refuses_stays_for_the_model_that_takes_it(served, web, name, status, phrase):
    """`POST /models/tiny-sd` naming an SDXL adapter: refused, and its download kept for tiny-sdxl."""
    client, downloads = served
    url, before = web.url(f"/{name}.safetensors"), _files(downloads)
    refused = _post(client, "/models/tiny-sd", url)
    assert refused.status_code == status and phrase in refused.json()["error"], refused.text
    adapter_id = re.search(r"adapter '(url:[0-9a-f]{32})'", refused.json()["error"]).group(1)
    assert len(_files(downloads)) == len(before) + 1, "made for the other hosted model: its download stays"
    assert adapter_id in _listed(client)
    served_by_sdxl = _post(client, "/models/tiny-sdxl", url)
    routed = _post(client, "/", url)
    assert served_by_sdxl.status_code == 200 and routed.status_code == 200, routed.text
    assert routed.content == served_by_sdxl.content, "routed to tiny-sdxl, whose layers it fits"
    assert web.paths().count(f"/{name}.safetensors") == 1, "fetched once: nothing was deleted"


def test_a_files_own_defect_deletes_it_on_a_two_model_server(served, web):
    client, downloads = served
    before = _files(downloads)
    for path in ("/models/tiny-sd", "/models/tiny-sdxl"):
        refused = _post(client, path, web.url("/junk.safetensors"))
        assert refused.status_code == 400 and "is not a weight of any adapter kind" in refused.json()["error"]
        assert _files(downloads) == before, "its file is gone; the others stay"
    assert client.post("/", json={"inputs": "a lighthouse", "parameters": PARAMETERS}).status_code == 200
