"""Image inputs are decoded and checked in one place (`media/images.py`): each refusal says
what to fix, the size is read from the header before any pixel is decoded, every mode becomes
RGB (a mask: "L", white where to repaint), EXIF orientation is applied. Output images are
encoded in one place too (`encode_image`), for the HTTP APIs and the CLI alike."""

import asyncio
import base64
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile
from pydantic import ValidationError
from support.images import GOOD, LIMITS, REFUSALS, encode, noise, png_declaring

from loraswap.errors import BadRequest
from loraswap.media.images import (
    ImageLimits,
    check_mask_fits,
    decode_base64,
    encode_image,
    format_for_file,
    looks_like_image,
    output_size,
    read_image,
    read_mask,
    require_image,
)
from loraswap.server.config import ServerConfig
from loraswap.server.generation import encode as encode_for_http

DECODED_TO_BE_REFUSED = {"truncated"}  # the header is fine: only decoding finds the missing half


@pytest.mark.parametrize("name,data,message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_each_refusal_says_what_to_fix(name, data, message, monkeypatch):
    decoded = []  # files whose pixels PIL's decoders were asked for
    load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda image: decoded.append(image) or load(image))
    with pytest.raises(BadRequest) as refused:
        read_image(data, "image", LIMITS)
    assert refused.value.status == 400
    assert message in refused.value.message
    assert "BytesIO" not in refused.value.message
    assert bool(decoded) is (name in DECODED_TO_BE_REFUSED), "refused from the header, not after decoding"


def test_the_pixel_limit_is_the_servers_and_at_most_pils():
    just_in = ImageLimits(max_bytes=64 * 1024, max_pixels=4000 * 2000)
    with pytest.raises(BadRequest, match="cannot be decoded"):  # past the size check: it is the pixels that fail
        read_image(png_declaring(4000, 2000), "image", just_in)
    assert ServerConfig().max_image_pixels == 4096 * 4096
    with pytest.raises(ValidationError):  # PIL warns past its own limit: the server never takes such an image
        ServerConfig(max_image_pixels=Image.MAX_IMAGE_PIXELS + 1)


@pytest.mark.parametrize("mode,fmt,value,expected", [
    ("RGB", "PNG", (10, 20, 30), (10, 20, 30)),
    ("RGBA", "PNG", (10, 20, 30, 0), (10, 20, 30)),  # alpha dropped, as diffusers' load_image does
    ("L", "PNG", 77, (77, 77, 77)),
    ("LA", "PNG", (77, 255), (77, 77, 77)),
    ("I;16", "PNG", 60000, (234, 234, 234)),  # scaled to 8 bits (PIL's convert would clip to 255)
    ("CMYK", "JPEG", (0, 255, 0, 0), (255, 0, 255)),
    ("RGB", "WEBP", (10, 20, 30), None),  # lossy: checked for mode and size only
])
def test_every_mode_becomes_rgb(mode, fmt, value, expected):
    image = read_image(encode(Image.new(mode, (24, 16), value), fmt, **({"lossless": True} if fmt == "WEBP"
                                                                        else {})), "image", LIMITS)
    assert image.mode == "RGB" and image.size == (24, 16)
    if expected:
        assert image.getpixel((5, 5)) == expected


def test_a_palette_image_becomes_its_colours():
    palette = Image.new("P", (16, 16), 1)
    palette.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    assert read_image(encode(palette), "image", LIMITS).getpixel((3, 3)) == (10, 20, 30)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_exif_orientation_is_applied(fmt):
    image = Image.new("RGB", (32, 16), (255, 0, 0))
    image.paste((0, 0, 255), (0, 0, 8, 8))  # a blue corner, top left as stored
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    upright = read_image(encode(image, fmt, exif=exif), "image", LIMITS)
    assert upright.size == (16, 32)
    red, green, blue = upright.getpixel((12, 2))  # the corner is now top right
    assert blue > 200 and red < 30, upright.getpixel((12, 2))


def test_masks_are_white_where_to_repaint():
    white_right = Image.new("L", (32, 16), 0)
    white_right.paste(255, (16, 0, 32, 16))
    transparent_right = Image.new("RGBA", (32, 16), (0, 0, 0, 255))
    transparent_right.paste((0, 0, 0, 0), (16, 0, 32, 16))
    opaque_rgba = white_right.convert("RGBA")  # alpha all 255: its grey is the mask
    palette = Image.new("P", (32, 16), 1)
    palette.putpalette([0, 0, 0, 255, 255, 255] + [0] * 762)
    palette.paste(0, (16, 0, 32, 16))  # index 0 transparent: repainted
    for name, data in (("grey", encode(white_right)), ("alpha (OpenAI)", encode(transparent_right)),
                       ("opaque RGBA", encode(opaque_rgba)), ("palette", encode(palette, transparency=0)),
                       ("RGB", encode(white_right.convert("RGB"), "JPEG", quality=100))):
        mask = read_mask(data, LIMITS)
        assert mask.mode == "L" and mask.size == (32, 16), name
        assert mask.getpixel((4, 4)) < 5 and mask.getpixel((28, 4)) > 250, name


def test_a_mask_of_another_size_and_one_without_an_image_are_refused():
    with pytest.raises(BadRequest) as refused:
        check_mask_fits(Image.new("RGB", (64, 48)), Image.new("L", (64, 32)))
    assert refused.value.message == "the mask is 64x32 but the image is 64x48: send a mask of the image's size"
    with pytest.raises(BadRequest, match="a mask was sent without an image"):
        require_image(False, True, None)
    with pytest.raises(BadRequest, match="strength was given without an image"):
        require_image(False, False, 0.5)
    require_image(True, True, 0.5)
    require_image(False, False, None)


def test_base64_is_checked_before_it_is_decoded():
    assert decode_base64(base64.b64encode(GOOD).decode(), "image", LIMITS) == GOOD
    assert decode_base64("data:image/png;base64," + base64.b64encode(GOOD).decode(), "image", LIMITS) == GOOD
    for text, message in (("not base64!", "is not valid base64 (Only base64 data is allowed)"),
                          (base64.urlsafe_b64encode(b"\xfb\xff" * 30).decode(), "not valid base64"),
                          ("QUJD\nREVG", "no line breaks"),
                          ("QUJDé===", "string argument should contain only ASCII characters"),
                          ("A" * (4 * 65536 // 3 + 8), "base64 characters, over 65536 bytes once decoded")):
        with pytest.raises(BadRequest) as refused:
            decode_base64(text, "mask", LIMITS)
        assert message in refused.value.message and refused.value.message.startswith("the mask")


def test_images_are_told_from_prompts():
    assert looks_like_image(GOOD) and looks_like_image(encode(noise(16, 16), "JPEG"))
    assert looks_like_image(base64.b64encode(encode(noise(16, 16), "WEBP")).decode())
    assert looks_like_image("data:image/png;base64," + base64.b64encode(GOOD).decode())
    assert not looks_like_image("a watercolor fox") and not looks_like_image("iVBOR")
    assert not looks_like_image("\u009aQ&\U00019520 1 une forêt")  # not ASCII: a prompt, not base64


@pytest.mark.parametrize("image,asked,limit,expected", [
    ((72, 40), (None, None), (2048, 2048), (64, 32)),  # rounded down to multiples of 16
    ((512, 512), (None, None), (2048, 2048), (512, 512)),
    ((4000, 3000), (None, None), (2048, 2048), (2048, 1536)),  # scaled to fit, its shape kept
    ((3000, 800), (None, None), (1024, 1024), (1024, 272)),
    ((100, 90), (64, None), (2048, 2048), (64, 80)),  # a side asked for is kept; the other is the image's
    ((5000, 20), (None, None), (2048, 2048), (2048, 16)),  # never below 16
])
def test_the_output_size_is_the_images_within_the_limits(image, asked, limit, expected):
    assert output_size(Image.new("RGB", image), *asked, *limit) == expected


@pytest.mark.parametrize("image,asked,expected", [
    ((4096, 4096), (None, None), (1024, 1024)),  # a 4096² input makes a 1024² image, not 2048²
    ((4000, 3000), (None, None), (1168, 880)),  # its shape kept, within 1024² pixels
    ((4096, 4096), (512, None), (512, 1024)),  # one side asked: the other as with no size asked
    ((1024, 1024), (2048, None), (2048, 1024)),  # within the bound: the image's own side
    ((4096, 4096), (2048, 2048), (2048, 2048)),  # a size asked for is the client's, within max_width/height
    ((640, 480), (None, None), (640, 480)),
])
def test_the_size_chosen_for_an_image_input_is_bounded_in_pixels(image, asked, expected):
    assert output_size(Image.new("RGB", image), *asked, 2048, 2048, max_pixels=1024 * 1024) == expected


def test_one_encoder_writes_every_output_format():
    """PNG keeps every pixel; WebP and JPEG are written at quality 95, above PIL's defaults (80
    and 75), which blur a generated image's fine detail."""
    picture = noise(48, 32)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(encode_image(picture, "PNG")))), np.asarray(picture))
    for fmt in ("WEBP", "JPEG"):
        data = encode_image(picture, fmt)
        assert Image.open(io.BytesIO(data)).format == fmt
        assert data == encode(picture, fmt, quality=95) and len(data) > len(encode(picture, fmt))
    names = ("a.png", "b.JPG", "c.jpeg", "d.webp")
    assert [format_for_file(Path(name)) for name in names] == ["PNG", "JPEG", "JPEG", "WEBP"]
    with pytest.raises(BadRequest, match=r"cannot write an image as out\.bmp: write a png, jpg or webp"):
        format_for_file(Path("out.bmp"))


@pytest.mark.parametrize("accept,fmt,media", [("image/webp", "WEBP", "image/webp"),
                                              ("image/png, image/jpeg", "PNG", "image/png"),
                                              ("*/*", "JPEG", "image/jpeg"), ("", "JPEG", "image/jpeg")])
def test_the_http_apis_answer_with_the_one_encoder(accept, fmt, media):
    picture = noise(48, 32)
    assert asyncio.run(encode_for_http(picture, accept)) == (encode_image(picture, fmt), media)
