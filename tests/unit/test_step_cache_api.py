"""Step caching through the HTTP app (in process): a request's `step_cache` in the HF
parameters and the OpenAI body, the steps skipped in `x-steps-skipped`, `Server-Timing` and
/metrics; bad settings, methods the server does not allow and UNet models refused with a
JSON error, the server serving on; no header without a cache."""

import base64
import io

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from support.servers import wait_ready

from loraswap.engine.config.engine import EngineConfig
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig

STEPS = 4
PARAMETERS = {"seed": 3, "num_inference_steps": STEPS, "width": 64, "height": 64}
FIRST_BLOCK = "first-block:threshold=0.5"  # skips some of tiny-flux's 4 steps, never all


@pytest.fixture(scope="module")
def client(adapter_factory, tmp_path_factory):
    """tiny-flux (the default, serving first-block beside off) and tiny-sd (a UNet)."""
    folder = tmp_path_factory.mktemp("step-cache-api-adapters")
    adapter_factory("a", "tiny-flux", rank=4, targets="all", fmt="kohya", seed=41, dtype=torch.float32, folder=folder)
    app = create_app(ServerConfig(engines=[
        EngineConfig(model="tiny-flux", adapters=folder, warmup=False, step_cache_allow=["first-block"]),
        EngineConfig(model="tiny-sd", warmup=False)]))
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_ready(client, 120)
        yield client


def _hf(client, step_cache=None, path="/", **headers):
    parameters = PARAMETERS | ({} if step_cache is None else {"step_cache": step_cache})
    return client.post(path, json={"inputs": "a red circle", "parameters": parameters},
                       headers={"accept": "image/png", **headers})


def _steps_counted(client) -> dict[str, float]:
    """loraswap_step_cache_steps_total of first-block, by outcome."""
    text = client.get("/metrics").text
    return {sample.labels["outcome"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "loraswap_step_cache_steps_total" and sample.labels["method"] == "first-block"}


def _message(response) -> str:
    """The error's message: `{"error": "..."}`, or OpenAI's `{"error": {"message": "..."}}`."""
    error = response.json()["error"]
    return error["message"] if isinstance(error, dict) else error


def _pixels(content: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(content)).convert("RGB")).astype(int)


def test_a_hf_request_with_a_step_cache_says_what_it_skipped_and_metrics_count_it(client):
    before = _steps_counted(client)
    cached = _hf(client, FIRST_BLOCK, lora="a")
    assert cached.status_code == 200, cached.text
    skipped = int(cached.headers["x-steps-skipped"])
    assert 0 < skipped < STEPS
    assert f'step-cache;desc="{skipped} of {STEPS} steps skipped, {FIRST_BLOCK}"' in cached.headers["server-timing"]
    after = _steps_counted(client)
    assert after["skipped"] - before.get("skipped", 0) == skipped
    assert after["computed"] - before.get("computed", 0) == STEPS - skipped
    for off in (None, "off", "OFF"):  # the server's default is off
        uncached = _hf(client, off, lora="a")
        assert uncached.status_code == 200 and "x-steps-skipped" not in uncached.headers
        assert "step-cache" not in uncached.headers["server-timing"]
        assert np.abs(_pixels(uncached.content) - _pixels(cached.content)).max() > 0, "the cache changed the image"
    assert _steps_counted(client) == after, "nothing counted without a cache"


def test_an_openai_request_of_two_images_says_what_each_skipped(client):
    body = {"prompt": "a red circle", "model": "tiny-flux", "n": 2, "size": "64x64", "seed": 5,
            "num_inference_steps": STEPS, "response_format": "b64_json", "step_cache": "First-Block: threshold=0.5"}
    before = _steps_counted(client)
    response = client.post("/v1/images/generations", json=body)
    assert response.status_code == 200, response.text
    skipped = [int(n) for n in response.headers["x-steps-skipped"].split(",")]
    assert len(skipped) == len(response.json()["data"]) == 2 and all(0 < n < STEPS for n in skipped)
    assert _steps_counted(client)["skipped"] - before.get("skipped", 0) == sum(skipped)
    Image.open(io.BytesIO(base64.b64decode(response.json()["data"][1]["b64_json"]))).verify()
    plain = client.post("/v1/images/generations", json=body | {"step_cache": None})
    assert plain.status_code == 200 and "x-steps-skipped" not in plain.headers


@pytest.mark.parametrize(("step_cache", "named"), [
    ("first-block:threshold=2", "step cache first-block: threshold must be between 0 and 1, not 2"),
    ("teacache", "unknown step cache 'teacache': use off, first-block, taylorseer, magcache"),
    ("first-block:interval=3", "step cache first-block takes threshold=, not 'interval=3'"),
    ("taylorseer", "this server serves the step caches off, first-block, not taylorseer"),
    ("magcache", "this server serves the step caches off, first-block, not magcache"),
    (0.5, "step_cache")])
def test_a_bad_step_cache_is_a_400_naming_the_problem_and_the_server_serves_on(client, step_cache, named):
    before = _steps_counted(client)
    refused = _hf(client, step_cache)
    assert refused.status_code == 400 and named in refused.json()["error"], refused.text
    openai = client.post("/v1/images/generations", json={"prompt": "x", "size": "64x64", "step_cache": step_cache})
    assert openai.status_code == 400 and named in _message(openai), openai.text
    assert _steps_counted(client) == before
    assert _hf(client, "off").status_code == 200


def test_a_unet_model_refuses_a_step_cache_with_a_422(client):
    parameters = {"seed": 1, "num_inference_steps": 2, "width": 32, "height": 32}
    refused = client.post("/models/tiny-sd", json={"inputs": "x",
                                                   "parameters": parameters | {"step_cache": "first-block"}})
    assert refused.status_code == 422, refused.text
    assert "tiny-sd takes no step cache" in refused.json()["error"] and "flux" in refused.json()["error"]
    served = client.post("/models/tiny-sd", json={"inputs": "x", "parameters": parameters | {"step_cache": "off"}})
    assert served.status_code == 200 and "x-steps-skipped" not in served.headers
