"""OpenAI's `output_format` and `output_compression`, and the record each image carries, with
the real `openai` client against a real tiny model served on loopback."""

import base64
import hashlib
import io
import json

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from support.fakes import serve_on_loopback
from support.servers import wait_ready

from loraswap.engine.config.engine import EngineConfig
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig


@pytest.fixture(scope="module")
def live(adapter_factory):
    """(openai client, adapter folder): tiny-sd with one adapter, on loopback."""
    folder = adapter_factory.root / "formats"
    adapter_factory("style", "tiny-sd", rank=4, seed=41, folder=folder)
    app = create_app(ServerConfig(engines=[EngineConfig(model="tiny-sd", adapters=folder)]))
    with serve_on_loopback(app) as url:
        wait_ready(httpx.Client(base_url=url), 120)
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), folder


def _file(item) -> bytes:
    return base64.b64decode(item.b64_json)


def _jpeg(image: Image.Image, quality: int) -> bytes:
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def test_webp_comes_back_as_webp_of_the_asked_size_with_its_record(live):
    client, folder = live
    response = client.images.generate(prompt="a red fox", model="style:0.6", size="64x48", output_format="webp",
                                      extra_body={"seed": 3})
    data = _file(response.data[0])
    assert data[:4] == b"RIFF" and data[8:12] == b"WEBP"
    image = Image.open(io.BytesIO(data))
    assert image.format == "WEBP" and image.size == (64, 48)
    exif = image.getexif()
    record = json.loads(exif[0x010E])
    file = (folder / "style.safetensors").read_bytes()
    tensors = hashlib.sha256(file[8 + int.from_bytes(file[:8], "little"):]).hexdigest()  # A1111's LoRA hash
    assert record["adapters"] == [{"id": "style", "weight": 0.6, "sha256": hashlib.sha256(file).hexdigest(),
                                   "tensors_sha256": tensors}]
    assert (record["seed"], record["width"], record["height"], record["steps"]) == (3, 64, 48, 4)
    infotext = exif.get_ifd(0x8769)[0x9286][8:].decode("utf-16-be")
    assert infotext.startswith("a red fox <lora:style:0.6>\nSteps: 4, Sampler: Euler, CFG scale: 7.5, Seed: 3, "
                               f"Size: 64x48, Model: tiny-sd, Lora hashes: \"style: {tensors[:12]}\", Version: ")
    png = _file(client.images.generate(prompt="a red fox", model="style:0.6", size="64x48",
                                       extra_body={"seed": 3}).data[0])
    assert Image.open(io.BytesIO(png)).format == "PNG", "no output_format: PNG, as OpenAI's default"


def test_jpeg_compression_sets_the_quality(live):
    client, _ = live
    sizes = {}
    for compression in (10, 95):
        data = _file(client.images.generate(prompt="a red fox", size="64x64", output_format="jpeg",
                                            output_compression=compression, extra_body={"seed": 5}).data[0])
        assert data[:3] == b"\xff\xd8\xff"
        assert Image.open(io.BytesIO(data)).size == (64, 64)
        sizes[compression] = len(data)
    assert sizes[10] < sizes[95] * 0.8, sizes


def test_edits_take_the_format_as_form_fields(live):
    client, _ = live
    picture = Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    picture.save(buffer, "PNG")
    response = client.images.edit(image=("in.png", buffer.getvalue(), "image/png"), prompt="a fox", size="64x64",
                                  output_format="jpeg", output_compression=80, extra_body={"seed": 2})
    data = _file(response.data[0])
    image = Image.open(io.BytesIO(data))
    assert image.format == "JPEG" and image.size == (64, 64)
    record = json.loads(image.getexif()[0x010E])
    assert record["strength"] == 0.8, "no strength asked: the img2img pipeline's own default, as it ran"
    # compression 80 is quality 80: the quantization tables of that quality, not of the default 95
    tables = {quality: Image.open(io.BytesIO(_jpeg(image, quality))).quantization for quality in (80, 95)}
    assert image.quantization == tables[80] != tables[95]


@pytest.mark.parametrize("fields,words", [
    ({"output_format": "gif"}, "output_format must be 'png', 'jpeg' or 'webp'"),
    ({"output_format": "jpeg", "output_compression": 150}, "output_compression 150 must be between 0 and 100"),
])
def test_a_bad_value_is_a_400_naming_the_field(live, fields, words):
    client, _ = live
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(prompt="a fox", size="64x64", **fields)
    assert words in str(refused.value)


def test_metadata_false_in_the_body_or_the_form_leaves_the_record_out(live):
    client, _ = live
    ask = dict(prompt="a red fox", size="64x64", output_format="webp", output_compression=90)
    carried = Image.open(io.BytesIO(_file(client.images.generate(**ask, extra_body={"seed": 9}).data[0])))
    bare = Image.open(io.BytesIO(_file(client.images.generate(**ask, extra_body={"seed": 9,
                                                                                  "metadata": False}).data[0])))
    assert carried.getexif() and not bare.getexif()
    assert np.array_equal(np.asarray(carried), np.asarray(bare)), "the same seed's pixels"
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (90, 90, 200)).save(buffer, "PNG")
    edited = client.images.edit(image=("in.png", buffer.getvalue(), "image/png"), prompt="a fox", size="64x64",
                                extra_body={"seed": 2, "metadata": "false"})  # a form field is text
    assert not Image.open(io.BytesIO(_file(edited.data[0]))).text
