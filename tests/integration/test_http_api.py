"""The HTTP contract, with real clients against a real server on loopback."""

import base64
import io
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from huggingface_hub import InferenceClient
from openai import OpenAI
from PIL import Image

_CLI_IMAGES: dict[tuple, np.ndarray] = {}  # by arguments: each made once for both servers


def cli_image(adapters_dir, tmp_path, lora: str | None, seed: int, *extra: str) -> np.ndarray:
    """The image `loraswap generate` makes in a process of its own (about 10 s each)."""
    key = (str(adapters_dir), lora, seed, extra)
    if key not in _CLI_IMAGES:
        _CLI_IMAGES[key] = _run_cli(adapters_dir, tmp_path, lora, seed, *extra)
    return _CLI_IMAGES[key]


def _run_cli(adapters_dir, tmp_path, lora: str | None, seed: int, *extra: str) -> np.ndarray:
    out = tmp_path / f"cli-{str(lora).replace('/', '_')}-{seed}.png"
    args = [sys.executable, "-m", "loraswap", "generate", "a red fox", "--model", "tiny-sd", "--adapters",
            str(adapters_dir), "--seed", str(seed), "--steps", "2", "-o", str(out), *extra]
    if lora:
        args += ["--lora", lora]
    subprocess.run(args, check=True, capture_output=True)
    return np.asarray(Image.open(out).convert("RGB"))


def input_png() -> bytes:
    """A 64x48 gradient as PNG: an input image whose size needs no rounding."""
    x, y = np.meshgrid(np.arange(64), np.arange(48))
    buffer = io.BytesIO()
    Image.fromarray(np.stack([x * 4, y * 5, (x + y) * 2], -1).astype(np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def right_half_mask(mode: str) -> bytes:
    """The right half to repaint: white on black ("L"), or transparent on opaque ("RGBA", OpenAI's)."""
    mask = Image.new("L", (64, 48), 0) if mode == "L" else Image.new("RGBA", (64, 48), (0, 0, 0, 255))
    mask.paste(255 if mode == "L" else (0, 0, 0, 0), (32, 0, 64, 48))
    buffer = io.BytesIO()
    mask.save(buffer, "PNG")
    return buffer.getvalue()


@pytest.mark.slow  # against `loraswap generate` in a process of its own
def test_image_to_image_and_inpainting_through_both_clients_match_the_cli(server, served_adapters, tmp_path,
                                                                          monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the suite is offline; this is loopback
    hf = InferenceClient(model=server.url, headers={"lora": "style"})
    openai = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    asked = {"seed": 3, "num_inference_steps": 2, "strength": 0.6}
    by_hf = np.asarray(hf.image_to_image(input_png(), prompt="a red fox", **asked).convert("RGB"))
    edit = openai.images.edit(image=("in.png", input_png(), "image/png"), prompt="a red fox", model="style",
                              extra_body=asked)
    by_openai = np.asarray(Image.open(io.BytesIO(base64.b64decode(edit.data[0].b64_json))).convert("RGB"))
    given = served_adapters.parent / "image-to-image-input.png"  # one path for both servers: one CLI run
    given.write_bytes(input_png())
    expected = cli_image(served_adapters, tmp_path, "style", 3, "--image", str(given), "--strength", "0.6")
    assert by_hf.shape == (48, 64, 3)
    assert np.array_equal(by_hf, by_openai) and np.array_equal(by_hf, expected)
    # the same mask in either convention (white through HF, transparent through OpenAI) paints the same
    masked_hf = hf.image_to_image(input_png(), prompt="a red fox", mask=base64.b64encode(right_half_mask("L")).decode(),
                                  **asked)
    masked_edit = openai.images.edit(image=("in.png", input_png(), "image/png"), prompt="a red fox", model="style",
                                     mask=("mask.png", right_half_mask("RGBA"), "image/png"), extra_body=asked)
    masked = np.asarray(masked_hf.convert("RGB"))
    assert np.array_equal(masked, np.asarray(Image.open(io.BytesIO(base64.b64decode(masked_edit.data[0].b64_json)))
                                             .convert("RGB")))
    assert not np.array_equal(masked, by_hf), "the mask makes an inpainting, not the image-to-image"


@pytest.mark.slow  # against `loraswap generate` in a process of its own
def test_huggingface_inference_client(server, served_adapters, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the suite is offline; this is loopback
    client = InferenceClient(model=server.url, headers={"lora": "style"})
    image = client.text_to_image("a red fox", seed=3, num_inference_steps=2)
    expected = cli_image(served_adapters, tmp_path, "style", 3)
    assert np.array_equal(np.asarray(image.convert("RGB")), expected)
    base = InferenceClient(model=server.url).text_to_image("a red fox", seed=3, num_inference_steps=2)
    assert not np.array_equal(expected, np.asarray(base.convert("RGB"))), "the adapter changes the image"


@pytest.mark.slow  # against `loraswap generate` in a process of its own
def test_openai_images_client(server, served_adapters, tmp_path):
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    response = client.images.generate(model="styles/second", prompt="a red fox", response_format="b64_json",
                                      size="64x64", extra_body={"seed": 5, "num_inference_steps": 2})
    image = Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json)))
    assert image.format == "PNG"
    assert np.array_equal(np.asarray(image.convert("RGB")), cli_image(served_adapters, tmp_path, "styles/second", 5))


@pytest.mark.slow  # a CLI run for its reference image: seconds
@pytest.mark.slow  # against `loraswap generate` in a process of its own
def test_both_clients_name_adapters_in_the_bodys_loras_list(server, served_adapters, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the suite is offline; this is loopback
    expected = cli_image(served_adapters, tmp_path, "styles/second:0.7", 5)
    openai = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    response = openai.images.generate(prompt="a red fox", response_format="b64_json", size="64x64", extra_body={
        "seed": 5, "num_inference_steps": 2, "loras": [{"path": "styles/second", "scale": 0.7}]})
    by_openai = np.asarray(Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json))).convert("RGB"))
    by_hf = InferenceClient(model=server.url).text_to_image(
        "a red fox", seed=5, num_inference_steps=2, width=64, height=64,
        extra_body={"loras": [{"path": "styles/second", "scale": 0.7}]})
    assert np.array_equal(by_openai, expected) and np.array_equal(np.asarray(by_hf.convert("RGB")), expected)


def test_blend_header_models_route_and_formats(server):
    body = {"inputs": "a red fox", "parameters": {"seed": 1, "num_inference_steps": 2}}
    blended = httpx.post(server.url + "/", json=body, headers={"lora": "style:0.7, styles/second:0.4",
                                                               "accept": "image/png"})
    assert blended.status_code == 200 and blended.headers["content-type"] == "image/png"
    assert float(blended.headers["x-compute-time"]) > 0
    via_path = httpx.post(server.url + "/models/style", json=body, headers={"lora": "styles/second:0.4",
                                                                           "accept": "image/png"})
    # the path names the adapter at weight 1.0; the header adds the second
    assert via_path.status_code == 200 and via_path.content != blended.content
    base_by_name = httpx.post(server.url + "/models/tiny-sd", json=body, headers={"accept": "image/webp"})
    assert base_by_name.headers["content-type"] == "image/webp"
    assert Image.open(io.BytesIO(base_by_name.content)).size == (64, 64)
    jpeg = httpx.post(server.url + "/", json="a bare string prompt")
    assert jpeg.status_code == 200 and jpeg.headers["content-type"] == "image/jpeg"
    assert Image.open(io.BytesIO(jpeg.content)).format == "JPEG"


@pytest.mark.parametrize("body,headers,status,phrase", [
    ({"inputs": "x", "parameters": {"width": 100}}, {}, 400, "multiple of 8"),
    ({"inputs": "x", "parameters": {"width": 1024}}, {}, 400, "between 8 and 512"),
    ({"inputs": "x", "parameters": {"num_inference_steps": 500}}, {}, 400, "num_inference_steps"),
    ({"inputs": "x" * 300}, {}, 400, "the limit is 200"),
    ({"inputs": ""}, {}, 400, "empty"),
    ({"inputs": "x", "parameters": {"sampler": "ddim"}}, {}, 400, "sampler"),
    ({"prompt": "x"}, {}, 400, "inputs"),
    ({"inputs": "x"}, {"lora": "style, styles/second, sdxl-only"}, 400, "at most 2"),
    ({"inputs": "x"}, {"lora": "style:abc"}, 400, "must be a number"),
    ({"inputs": "x"}, {"lora": "../../etc/passwd"}, 400, "invalid adapter id"),
    ({"inputs": "x"}, {"lora": "nope"}, 404, "no such adapter"),
    ({"inputs": "x"}, {"lora": "sdxl-only"}, 422, "this server hosts tiny-sd"),
])
def test_errors_are_json_with_the_right_status(server, body, headers, status, phrase):
    response = httpx.post(server.url + "/", json=body, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert phrase in error
    assert "Traceback" not in response.text


def test_malformed_bodies(server):
    for content, phrase in ((b"{not json", "must be JSON"), (b"x" * 5000, "limit is 4096")):
        response = httpx.post(server.url + "/", content=content, headers={"content-type": "application/json"})
        assert response.status_code == 400 and phrase in response.json()["error"]
    openai = httpx.post(server.url + "/v1/images/generations", json={"prompt": "x", "response_format": "link"})
    assert openai.status_code == 400 and "'b64_json' or 'url'" in openai.json()["error"]["message"]
    size = httpx.post(server.url + "/v1/images/generations", json={"prompt": "x", "size": "big"})
    assert size.status_code == 400 and "WIDTHxHEIGHT" in size.json()["error"]["message"]
    missing = httpx.post(server.url + "/v1/images/generations", json={"size": "64x64"})
    assert missing.status_code == 400 and "prompt" in missing.json()["error"]["message"]
    unknown_route = httpx.get(server.url + "/nope")
    assert unknown_route.status_code == 404 and "error" in unknown_route.json()


def test_health_ready_metrics_and_adapter_endpoints(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").json()["model"] == "tiny-sd"
    loaded = httpx.post(server.url + "/adapters/styles/second/load")
    assert loaded.status_code == 200 and loaded.json()["kept"]
    rows = {row["id"]: row for row in httpx.get(server.url + "/adapters").json()["adapters"]}
    assert set(rows) == {"style", "styles/second", "sdxl-only"}
    assert rows["styles/second"]["cached"] == "host" and rows["styles/second"]["rank"] == 4
    assert rows["styles/second"]["bytes"] > 0 and rows["styles/second"]["base_model"] == "tiny-sd"
    assert httpx.delete(server.url + "/adapters/styles/second").json()["cached"] == "disk"
    rows = {row["id"]: row for row in httpx.get(server.url + "/adapters").json()["adapters"]}
    assert rows["styles/second"]["cached"] == "disk"
    assert httpx.post(server.url + "/adapters/nope/load").status_code == 404
    assert httpx.delete(server.url + "/adapters/nope").status_code == 404
    metrics = httpx.get(server.url + "/metrics").text
    for name in ("loraswap_requests_total", "loraswap_adapter_swap_seconds_bucket", "loraswap_recompiles_total",
                 "loraswap_adapter_cache_hits_total", "loraswap_adapter_cache_misses_total", "loraswap_queue_depth"):
        assert name in metrics, name
    assert server.metric("loraswap_requests_total", '{route="/",status="404"}') >= 1


def test_server_timing_says_where_a_requests_time_went(server):
    body = {"inputs": "a red fox", "parameters": {"seed": 3, "num_inference_steps": 2}}
    response = httpx.post(server.url + "/", json=body, headers={"lora": "style:0.5, styles/second:0.5"})
    assert response.status_code == 200
    phases = {name: float(duration) for name, duration in
              (item.strip().split(";dur=") for item in response.headers["server-timing"].split(","))}
    expected = {"parse", "read", "wait", "swap", "generate", "encode"}
    if "--ray" in server.proc.args:  # Serve's routing and transport, and the replica taking the adapters in
        expected |= {"ray", "hold"}
    assert set(phases) == expected, phases
    assert all(ms >= 0 for ms in phases.values()), phases
    # the swap and the generation are x-compute-time, in milliseconds (each rounded to 0.1 ms)
    assert phases["swap"] + phases["generate"] == pytest.approx(float(response.headers["x-compute-time"]) * 1e3,
                                                                abs=0.3)
    assert phases["read"] <= phases["wait"], "waiting for the worker includes waiting for the read"
    # every phase happened within the request: their sum (the read is inside the wait) fits the latency
    spent = sum(ms for name, ms in phases.items() if name != "read")
    assert spent <= response.elapsed.total_seconds() * 1e3, (phases, response.elapsed)


def test_a_key_in_the_query_string_never_reaches_the_log(server, request):
    body = {"inputs": "x", "parameters": {"num_inference_steps": 1}}
    assert httpx.post(server.url + "/?api_key=SECRET-IN-THE-QUERY&b=2", json=body).status_code == 200
    time.sleep(0.5)  # the access line is written after the response
    log = server.log()
    assert "SECRET-IN-THE-QUERY" not in log
    if request.node.callspec.params["server"] == "plain":  # on Ray, Serve's proxy logs the route only
        assert 'POST /?(query hidden) HTTP/1.1" 200' in log
