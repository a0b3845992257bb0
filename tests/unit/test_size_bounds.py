"""Each served model's largest size: from its native size (or --max-size), a size asked beyond
it refused with a 400 naming the bound, an input image with no size asked scaled down to fit."""

import base64
import io

import pytest
from fastapi.testclient import TestClient
from PIL import Image
from pydantic import ValidationError
from support.errors import error_message
from support.servers import wait_ready

from loraswap.engine.calls import PipelineCalls
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.request import GenerateRequest
from loraswap.engine.sizes import LargestSize, default_largest
from loraswap.errors import BadRequest
from loraswap.models import PRESET_FAMILIES, build_preset
from loraswap.models.family import native_size
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig


@pytest.mark.parametrize(("preset", "own_defaults", "native"), [
    ("demo", True, (32, 32)),  # a preset: its family's default size
    ("tiny-sd", True, (64, 64)),
    ("tiny-wan", False, (832, 480)),  # the pipeline's own: WanPipeline's call defaults
    ("tiny-flux", False, (1024, 1024)),  # FluxPipeline: default_sample_size 128 x the VAE's 8
    ("tiny-sd", False, (64, 64)),  # StableDiffusionPipeline: the UNet's sample size (8) x the VAE's 8
])
def test_native_size_is_the_preset_default_else_the_pipeline_own(preset, own_defaults, native):
    defaults = PRESET_FAMILIES[preset].defaults if own_defaults else {}
    assert native_size(build_preset(preset), defaults) == native


def test_a_pipeline_that_says_nothing_is_taken_as_1024():
    class Silent:
        def __call__(self, prompt, width=None, height=None):
            pass

    assert native_size(Silent(), {}) == (1024, 1024)


@pytest.mark.parametrize(("native", "largest"), [
    ((32, 32), (128, 128)),  # the demo: 4x its side, the floor
    ((64, 64), (128, 128)),  # the tiny presets
    ((512, 512), (1024, 1024)),  # SD 1.5
    ((1024, 1024), (2048, 2048)),  # SDXL, FLUX.1
    ((832, 480), (1664, 960)),  # Wan
])
def test_the_default_bound_is_twice_the_native_side_and_at_least_128(native, largest):
    assert default_largest(native) == largest


def test_a_size_beyond_the_bound_is_refused_naming_it_either_way_round():
    wan = LargestSize.of("wan", (832, 480), None)
    assert wan.fits(1664, 960) and wan.fits(960, 1664) and wan.fits(64, 64)
    with pytest.raises(BadRequest) as refused:
        wan.check(1700, 900)
    assert refused.value.status == 400
    assert str(refused.value) == ("wan makes images of at most 1664x960 (or 960x1664), not 1700x900: ask for a "
                                  "smaller size (the server's --max-size sets this bound)")
    demo = LargestSize.of("demo", (32, 32), None)
    with pytest.raises(BadRequest, match=r"^demo makes images of at most 128x128, not 1024x1024: "):
        demo.check(1024, 1024)
    demo.check(128, 128)
    assert LargestSize.of("demo", (32, 32), "256x64").fits(64, 256), "the operator's bound, turned"


@pytest.mark.parametrize(("bound", "image", "multiple", "fitted"), [
    ((128, 128), (640, 480), 8, (128, 96)),  # the photo of the issue on the demo
    ((128, 128), (480, 640), 8, (96, 128)),
    ((256, 128), (200, 400), 8, (128, 256)),  # a portrait in a landscape bound: the bound turned
    ((256, 256), (1000, 600), 16, (256, 144)),  # 153.6 rounded down to a multiple of 16
    ((128, 128), (64, 48), 8, (64, 48)),  # fits: unchanged
    ((128, 128), (4096, 16), 8, (128, 8)),  # never under one multiple
])
def test_an_input_image_is_scaled_down_to_fit_its_shape_kept(bound, image, multiple, fitted):
    largest = LargestSize("m", *bound, native=(64, 64))
    width, height = largest.fit(*image, multiple)
    assert (width, height) == fitted and largest.fits(width, height)
    assert width % multiple == 0 and height % multiple == 0
    if min(fitted) > multiple:  # the shape within one multiple of the image's
        assert abs(height - width * image[1] / image[0]) <= multiple


def _calls(max_size: str | None = None) -> PipelineCalls:
    """The demo's calls (32 px by default), with no pipeline: `sized` reads the bound alone."""
    defaults = {"width": 32, "height": 32, "steps": 20}
    return PipelineCalls(object(), None, defaults, LargestSize.of("demo", (32, 32), max_size))


def test_sized_refuses_a_size_asked_and_fits_one_taken_from_the_image():
    calls = _calls()
    with pytest.raises(BadRequest, match="at most 128x128, not 1024x1024"):
        calls.sized(GenerateRequest(prompt="x", width=1024, height=1024))
    with pytest.raises(BadRequest, match="not 32x256"):  # one side asked, the other the default
        calls.sized(GenerateRequest(prompt="x", height=256))
    plain = GenerateRequest(prompt="x")
    assert calls.sized(plain) is plain, "no size asked: the default, within the bound"
    photo = GenerateRequest(prompt="x", width=640, height=480, image=Image.new("RGB", (640, 480)),
                            size_from_image=True)
    fitted = calls.sized(photo)
    assert (fitted.width, fitted.height) == (128, 96) and fitted.image is photo.image
    assert (photo.width, photo.height) == (640, 480), "the caller's request is left as it was"
    assert calls.capabilities()["max_size"] == [128, 128]


def test_the_operator_sets_the_bound():
    calls = _calls("64x48")
    assert calls.capabilities()["max_size"] == [64, 48]
    calls.sized(GenerateRequest(prompt="x", width=48, height=64))
    with pytest.raises(BadRequest, match="at most 64x48 \\(or 48x64\\), not 128x128"):
        calls.sized(GenerateRequest(prompt="x", width=128, height=128))
    with pytest.raises(BadRequest, match="not 32x32"):  # the model's default is larger than the bound
        _calls("16x16").sized(GenerateRequest(prompt="x"))


@pytest.mark.parametrize(("value", "message"), [("big", "not a size: write WIDTHxHEIGHT"),
                                                ("1024", "not a size"), ("4x512", "each side at least 8")])
def test_a_bad_max_size_is_refused_at_start(value, message):
    with pytest.raises(ValidationError, match=message):
        EngineConfig(model="demo", max_size=value)


@pytest.fixture(scope="module")
def demo_client(tmp_path_factory):
    """The demo served in this process, as `make serve` serves it (no warm-up: a faster start)."""
    app = create_app(ServerConfig(engines=[EngineConfig(model="demo", warmup=False)],
                                  state_dir=tmp_path_factory.mktemp("state")))
    with TestClient(app) as client:
        wait_ready(client, 60)
        yield client


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/images/generations", {"prompt": "a red circle", "size": "1024x1024"}),  # the OpenAI example of old
    ("/", {"inputs": "a red circle", "parameters": {"width": 256, "height": 128}}),
    ("/models/demo", {"inputs": "a red circle", "parameters": {"width": 136, "height": 64}}),
])
def test_every_api_answers_a_size_beyond_the_demo_bound_with_a_400_naming_it(demo_client, path, body):
    response = demo_client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert "demo makes images of at most 128x128" in error_message(response)


def test_an_edit_beyond_the_bound_is_refused_and_a_photo_with_no_size_scaled_to_fit(demo_client):
    photo = io.BytesIO()
    Image.new("RGB", (640, 480), (200, 40, 40)).save(photo, "PNG")
    form = {"prompt": "a red circle", "num_inference_steps": "2"}
    files = {"image": ("photo.png", photo.getvalue(), "image/png")}
    refused = demo_client.post("/v1/images/edits", data={**form, "size": "640x480"}, files=files)
    assert refused.status_code == 400 and "at most 128x128, not 640x480" in refused.json()["error"]["message"]
    made = demo_client.post("/v1/images/edits", data=form, files=files)
    assert made.status_code == 200, made.text
    image = Image.open(io.BytesIO(base64.b64decode(made.json()["data"][0]["b64_json"])))
    assert image.size == (128, 96), "the 640x480 photo's shape, scaled down to the demo's 128x128"
