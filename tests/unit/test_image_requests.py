"""Image inputs through every front door, over a FakeBackend that records the engine request:
Hugging Face image-to-image (the real `huggingface_hub` client), OpenAI edits (the real
`openai` client, multipart), and `loraswap generate --image`."""

import base64
import io
from types import SimpleNamespace

import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from support.errors import error_message
from support.fakes import fake_app, serve_on_loopback
from support.images import REFUSALS, encode, noise, png_declaring
from typer.testing import CliRunner

from loraswap.adapters.reference import as_refs
from loraswap.cli import app as cli_app
from loraswap.engine.engine import GenerateResult
from loraswap.errors import UnsupportedInput

PICTURE = noise(72, 40)  # rounds down to 64x32
MASK = Image.new("RGBA", (72, 40), (0, 0, 0, 255))
MASK.paste((0, 0, 0, 0), (36, 0, 72, 40))  # transparent right half: repainted (OpenAI's convention)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image)


@pytest.fixture
def live(monkeypatch):
    """(url, backend): a real server on loopback over a FakeBackend."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the suite is offline; this is loopback
    app, backend = fake_app(max_width=512, max_height=512)
    with serve_on_loopback(app) as url:
        yield url, backend


def test_huggingface_image_to_image_with_the_real_client(live):
    from huggingface_hub import InferenceClient

    url, backend = live
    client = InferenceClient(model=url, headers={"lora": "style:0.5"})
    out = client.image_to_image(encode(PICTURE), prompt="a watercolor fox", negative_prompt="blur",
                                num_inference_steps=3, guidance_scale=2.5, seed=4, strength=0.6)
    assert out.size == (8, 8)  # the fake backend's image, sent back as PNG
    request, model = backend.generated[-1]
    assert (request.prompt, request.negative_prompt, request.steps, request.guidance, request.seed) == \
        ("a watercolor fox", "blur", 3, 2.5, 4)
    assert request.loras == as_refs([("style", 0.5)]) and request.strength == 0.6 and model is None
    assert request.image.mode == "RGB" and np.array_equal(pixels(request.image), pixels(PICTURE))
    assert (request.width, request.height) == (64, 32), "no size asked: the image's, a multiple of 16"
    assert request.mask is None
    # target_size and a JPEG, to the path naming the hosted model
    InferenceClient(model=url + "/models/fake").image_to_image(encode(PICTURE, "JPEG"), prompt="x",
                                                               target_size={"width": 128, "height": 96})
    request, model = backend.generated[-1]
    assert (request.width, request.height, model, request.image.size) == (128, 96, "fake", (72, 40))
    # with no parameters the client posts the bare file: there is no prompt to give
    with pytest.raises(Exception) as refused:
        client.image_to_image(encode(PICTURE))
    assert refused.value.response.status_code == 400 and "bare image file, with no prompt" in str(refused.value)
    assert len(backend.generated) == 2


def test_openai_edits_with_image_and_mask_with_the_real_client(live):
    url, backend = live
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    response = client.images.edit(image=("fox.png", encode(PICTURE), "image/png"),
                                  mask=("mask.png", encode(MASK), "image/png"), prompt="a fox in snow",
                                  model="style:0.5, second", n=2, size="64x32", response_format="b64_json",
                                  extra_body={"seed": 7, "strength": 0.25, "num_inference_steps": 3,
                                              "guidance_scale": 1.5, "negative_prompt": "rain"})
    assert len(response.data) == 2
    assert Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json))).format == "PNG"
    (first, model), (second, _) = backend.generated
    assert model is None and first.loras == as_refs([("style", 0.5), ("second", 1.0)])
    assert (first.prompt, first.negative_prompt, first.steps, first.guidance, first.strength) == \
        ("a fox in snow", "rain", 3, 1.5, 0.25)
    assert (first.seed, second.seed) == (7, 8) and (first.width, first.height) == (64, 32)
    assert np.array_equal(pixels(first.image), pixels(PICTURE))
    mask = pixels(first.mask)
    assert first.mask.mode == "L" and (mask[:, :36] == 0).all() and (mask[:, 36:] == 255).all()
    # the least a client sends: the image (bytes, no file name) and the prompt
    client.images.edit(image=encode(PICTURE, "WEBP", lossless=True), prompt="a fox", model="fake")
    request, model = backend.generated[-1]
    assert model == "fake" and (request.width, request.height) == (64, 32) and request.strength is None
    assert np.array_equal(pixels(request.image), pixels(PICTURE))
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.edit(image=[encode(PICTURE), encode(PICTURE)], prompt="two")
    assert "the form gives image more than once" in refused.value.message  # the client shows the server's words


def test_the_json_body_may_carry_images_past_max_body_bytes_and_nothing_else():
    app, backend = fake_app(max_body_bytes=1024, max_image_bytes=40 * 1024)
    client = TestClient(app)
    big = encode(noise(96, 96))  # ~27 KiB
    assert client.post("/", json={"inputs": b64(big), "parameters": {"prompt": "x"}}).status_code == 200
    text = client.post("/", json={"inputs": "x" * 2000})
    assert text.status_code == 400 and "the body is 2013 bytes; the limit is 1024" in text.json()["error"]
    padded = client.post("/", json={"inputs": b64(big), "parameters": {"prompt": "x", "negative_prompt": "y" * 2000}})
    assert padded.status_code == 400 and "the limit is 1024 besides an image and a mask" in padded.json()["error"]
    huge = client.post("/", content=b"{" + b" " * 200_000, headers={"content-type": "application/json"})
    assert huge.status_code == 400 and "the body is 200001 bytes" in huge.json()["error"]
    too_big = client.post("/", json={"inputs": b64(encode(noise(160, 160))), "parameters": {"prompt": "x"}})
    assert too_big.status_code == 400 and "the limit is 40960 bytes" in too_big.json()["error"]
    assert len(backend.generated) == 1


@pytest.mark.parametrize("data,message", [r[1:] for r in REFUSALS if r[0] != "too many bytes"],
                         ids=[r[0] for r in REFUSALS if r[0] != "too many bytes"])
def test_each_bad_image_is_a_400_on_both_apis_and_the_server_keeps_serving(data, message):
    app, backend = fake_app(max_image_pixels=2048 * 2048)
    client = TestClient(app)
    hf = client.post("/", json={"inputs": b64(data), "parameters": {"prompt": "x"}})
    edit = client.post("/v1/images/edits", data={"prompt": "x"}, files={"image": ("in.png", data, "image/png")})
    for answer in (hf, edit):
        assert answer.status_code == 400 and message in error_message(answer), answer.text
    assert backend.generated == []
    assert client.post("/", json={"inputs": b64(encode(PICTURE)), "parameters": {"prompt": "x"}}).status_code == 200


@pytest.mark.parametrize("body,message", [
    ({"inputs": "not base64!", "parameters": {"prompt": "x"}}, "the image is not valid base64"),
    ({"inputs": b64(encode(PICTURE))}, "inputs is an image but parameters.prompt is missing"),
    ({"inputs": b64(encode(PICTURE)), "parameters": {"prompt": "x", "mask": b64(encode(noise(64, 40, "L")))}},
     "the mask is 64x40 but the image is 72x40"),
    ({"inputs": "a fox", "parameters": {"mask": b64(encode(MASK))}}, "a mask was sent without an image"),
    ({"inputs": "a fox", "parameters": {"strength": 0.5}}, "strength was given without an image"),
    ({"inputs": b64(encode(PICTURE)), "parameters": {"prompt": "x", "strength": 0}},
     "strength 0.0 must be more than 0"),
    ({"inputs": b64(encode(PICTURE)), "parameters": {"prompt": "x", "strength": 1.5}}, "and at most 1"),
    ({"inputs": b64(encode(PICTURE)), "parameters": {"prompt": ""}}, "the prompt is empty"),
])
def test_huggingface_image_to_image_refusals(body, message):
    app, backend = fake_app()
    answer = TestClient(app).post("/", json=body)
    assert answer.status_code == 400 and message in answer.json()["error"], answer.text
    assert backend.generated == []


def test_openai_edits_refusals_and_mask_as_in_hf():
    app, backend = fake_app()
    client = TestClient(app)
    image = {"image": ("in.png", encode(PICTURE), "image/png")}
    for kwargs, message in (
            ({"json": {"prompt": "x", "image": b64(encode(PICTURE))}}, "the body must be multipart/form-data"),
            ({"data": {"prompt": "x"}, "files": {"mask": ("m.png", encode(MASK), "image/png")}},
             "image: Field required"),
            ({"data": {"prompt": "x", "n": "many"}, "files": image}, "n: Input should be a valid integer"),
            ({"data": {"prompt": "x", "response_format": "link"}, "files": image},
             "response_format must be 'b64_json' or 'url', not 'link'"),
            ({"data": {"prompt": "x", "size": "65x32"}, "files": image}, "width 65 must be a multiple of 8"),
            ({"data": {"prompt": "x", "strength": "2"}, "files": image}, "strength 2.0 must be more than 0"),
            ({"data": {"prompt": "x"}, "files": {**image, "mask": ("m.png", encode(noise(16, 16)), "image/png")}},
             "the mask is 16x16 but the image is 72x40")):
        answer = client.post("/v1/images/edits", **kwargs)
        assert answer.status_code == 400 and message in answer.json()["error"]["message"], (message, answer.text)
    assert backend.generated == []
    hf_mask = client.post("/", json={"inputs": b64(encode(PICTURE)), "parameters": {"prompt": "x",
                                                                                   "mask": b64(encode(MASK))}})
    edit_mask = client.post("/v1/images/edits", data={"prompt": "x"},
                            files={**image, "mask": ("m.png", encode(MASK), "image/png")})
    assert hf_mask.status_code == edit_mask.status_code == 200
    (hf, _), (edit, _) = backend.generated
    assert np.array_equal(pixels(hf.mask), pixels(edit.mask)) and hf.image.tobytes() == edit.image.tobytes()


def test_a_model_that_takes_no_image_answers_the_engines_422():
    app, backend = fake_app()

    async def generate(request, model, is_disconnected, on_step=None):
        if request.image is not None:
            raise UnsupportedInput("the hosted model tiny-sd takes no image: send a prompt alone")
        return GenerateResult(Image.new("RGB", (8, 8)), 0, 0.0, 0.01)

    backend.generate = generate
    client = TestClient(app)
    answer = client.post("/v1/images/edits", data={"prompt": "x"}, files={"image": ("in.png", encode(PICTURE))})
    assert answer.status_code == 422 and answer.json() == {"error": {
        "message": "the hosted model tiny-sd takes no image: send a prompt alone", "type": "invalid_request_error",
        "param": None, "code": "unsupported_input"}}
    assert client.post("/", json={"inputs": "a fox"}).status_code == 200


def test_edits_are_documented_like_the_other_routes():
    app, _ = fake_app(max_images=3)
    paths = app.openapi()["paths"]
    edits = paths["/v1/images/edits"]["post"]
    form = edits["requestBody"]["content"]["multipart/form-data"]
    assert form["schema"]["required"] == ["prompt", "image"]
    assert form["schema"]["properties"]["image"]["format"] == "binary"
    assert form["schema"]["properties"]["mask"]["format"] == "binary"
    assert form["schema"]["properties"]["n"]["maximum"] == 3
    assert form["schema"]["properties"]["strength"] == {**form["schema"]["properties"]["strength"],
                                                        "exclusiveMinimum": 0, "maximum": 1}
    assert set(edits["responses"]) == {"200", "400", "403", "404", "422", "502", "503", "507"}  # 507: a URL's image
    assert edits["responses"]["404"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/OpenAIError"}
    hf = paths["/"]["post"]["requestBody"]["content"]["application/json"]["schema"]["anyOf"][1]
    assert {"prompt", "strength", "mask"} <= set(hf["properties"]["parameters"]["properties"])


runner = CliRunner()


class RecordingEngine:
    """Stands in for `Engine` in `loraswap generate`: records the request, loads nothing."""

    requests = []

    def __init__(self, config):
        self.calls = SimpleNamespace(sized=lambda request: request)  # no largest size to hold it to

    def generate(self, request, on_step=None):
        RecordingEngine.requests.append(request)
        return GenerateResult(Image.new("RGB", (8, 8)), 1, 0.0, 0.01)


def test_generate_with_an_image_and_a_mask(tmp_path, monkeypatch):
    monkeypatch.setattr("loraswap.engine.engine.Engine", RecordingEngine)
    RecordingEngine.requests = []
    (tmp_path / "in.png").write_bytes(encode(PICTURE))
    (tmp_path / "mask.png").write_bytes(encode(MASK))
    result = runner.invoke(cli_app, ["generate", "a fox", "--image", str(tmp_path / "in.png"), "--mask",
                                     str(tmp_path / "mask.png"), "--strength", "0.4", "-o", str(tmp_path / "o.png")])
    assert result.exit_code == 0, result.output
    request = RecordingEngine.requests[-1]
    assert (request.width, request.height, request.strength) == (64, 32, 0.4)
    assert np.array_equal(pixels(request.image), pixels(PICTURE)) and request.mask.mode == "L"
    assert (pixels(request.mask)[:, 36:] == 255).all()


@pytest.mark.parametrize("files,args,message", [
    ({"in.gif": encode(noise(32, 32), "GIF")}, ["--image", "in.gif"], "the image is not a PNG, JPEG or WebP file"),
    ({"in.png": encode(PICTURE), "m.png": encode(noise(16, 16))}, ["--image", "in.png", "--mask", "m.png"],
     "the mask is 16x16 but the image is 72x40"),
    ({"in.png": png_declaring(5000, 5000)}, ["--image", "in.png"], "the image is 5000x5000"),
    ({"in.png": encode(PICTURE)}, ["--image", "in.png", "--max-image-pixels", "1000"], "the limit is 1000 pixels"),
    ({"in.png": encode(PICTURE)}, ["--image", "in.png", "--max-image-mb", "0.001"], "the limit is 1048 bytes"),
    ({}, ["--strength", "0.5"], "strength was given without an image"),
])
def test_generate_refuses_a_bad_image_before_loading_the_model(tmp_path, monkeypatch, files, args, message):
    def no_engine(config):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("loraswap.engine.engine.Engine", no_engine)
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(cli_app, ["generate", "a fox", *args])
    assert result.exit_code == 1 and message in result.output, result.output
