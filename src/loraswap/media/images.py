"""Images in and out, for both HTTP APIs and `loraswap generate`.

In (image-to-image, inpainting, edits): decoded and checked in one place. Every refusal is a
400 that says what to fix: a file over `max_image_bytes`, bad base64, a type other than PNG,
JPEG or WebP, an image over `max_image_pixels` (read from the header, before any pixel is
decoded, so a small file that declares a huge image costs nothing), a truncated or corrupt
file, a mask of another size. What passes is an RGB image (EXIF orientation applied) and a
mask of mode "L", white where the model repaints. Whether the hosted model takes an image or
a mask at all is the engine's check (422).

Out: `encode_image`, the one encoder of a generated image, whichever way it leaves, with the
record of what made it (`metadata.py`) when the caller gives one.
"""
import base64
import io
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image, ImageMode, ImageOps

from loraswap.errors import BadRequest
from loraswap.media.metadata import JPEG_EXIF_BYTES, ImageRecord, exif, png_info

logger = logging.getLogger("loraswap.media")

FORMATS = ("PNG", "JPEG", "WEBP")  # the only decoders PIL may try on a client's bytes
# Output sizes are multiples of 16, not 8: FLUX.1 packs its latents (1/8 of the image) into 2x2
# patches, so it needs 16; SD and SDXL need 8, which 16 satisfies. The size is chosen before the
# backend routes the request to a model, so it must suit every model the server may host.
SIZE_MULTIPLE = 16
MIN_SIDE = 16  # a smaller image rounds down to no image at all
_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"RIFF")  # how PNG, JPEG and WebP files start
_DATA_URL = re.compile(r"^data:[\w/+.-]*;base64,")
# what a generated image may be written as (PIL's name -> its save options): the lossy two at
# quality 95, where a generated image's fine detail survives (PIL's own defaults, 75 and 80, blur it)
OUTPUT_FORMATS = {"PNG": {}, "WEBP": {"quality": 95}, "JPEG": {"quality": 95}}
_SUFFIXES = {".png": "PNG", ".webp": "WEBP", ".jpg": "JPEG", ".jpeg": "JPEG"}
# how a mask's transparency reads: where it repaints (OpenAI's), or where it keeps (A1111's)
MaskConvention = Literal["openai", "a1111"]


@dataclass(frozen=True)
class ImageLimits:
    """The bounds of one input file: its bytes, and its pixels as its header declares them."""

    max_bytes: int
    max_pixels: int

    def max_base64_chars(self) -> int:
        """The longest base64 text of a file within `max_bytes` (a data-URL prefix aside)."""
        return 4 * math.ceil(self.max_bytes / 3)


def looks_like_image(data: bytes | str) -> bool:
    """Whether `data` starts like a PNG, JPEG or WebP file, raw or base64 (to say what went wrong
    when an image arrives where a prompt was expected)."""
    if isinstance(data, str):
        head = _DATA_URL.sub("", data[:200])[:16]
        try:
            data = base64.b64decode(head[: len(head) // 4 * 4])
        except ValueError:  # binascii.Error, or text that is not ASCII
            return False
    return data.startswith(_MAGIC)


def require_image(has_image: bool, has_mask: bool, strength: float | None) -> None:
    """A mask or a strength without an image is refused, not ignored."""
    if has_image:
        return
    if has_mask:
        raise BadRequest("a mask was sent without an image: send the image the mask paints into")
    if strength is not None:
        raise BadRequest("strength was given without an image: strength says how much of an input image to "
                         "repaint; send an image, or leave strength out")


def decode_base64(text: str, what: str, limits: ImageLimits) -> bytes:
    """The bytes of a base64 image (standard alphabet; a `data:image/...;base64,` prefix is
    allowed), its length checked before it is decoded."""
    prefix = _DATA_URL.match(text)
    text = text[prefix.end():] if prefix else text
    if len(text) > limits.max_base64_chars():
        raise BadRequest(f"the {what} is {len(text)} base64 characters, over {limits.max_bytes} bytes once "
                         f"decoded; the limit is {limits.max_bytes} bytes: send a smaller file")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as e:  # binascii.Error, or text that is not ASCII
        raise BadRequest(f"the {what} is not valid base64 ({e}): send the file's bytes base64-encoded "
                         "(standard alphabet, with padding, no line breaks)") from None


def read_image(data: bytes, what: str, limits: ImageLimits) -> Image.Image:
    """The picture in `data` (PNG, JPEG or WebP; an animation's first frame) as RGB, upright."""
    return _decode(data, what, limits).convert("RGB")


def read_mask(data: bytes, limits: ImageLimits, convention: MaskConvention = "openai") -> Image.Image:
    """The mask in `data` as mode "L", 255 where the model repaints. A mask with transparency
    repaints where it is transparent (OpenAI's convention); one without, where it is white
    (diffusers'). A fully opaque alpha channel carries nothing: its grey is read instead.
    `convention` "a1111": read as A1111 reads an inpainting mask (`create_binary_mask`)."""
    mask = _decode(data, "mask", limits)
    if convention == "a1111":
        return _a1111_mask(mask)
    if mask.mode in ("P", "PA"):  # a palette: its colours, and its transparency if it has one
        mask = mask.convert("RGBA" if mask.mode == "PA" or "transparency" in mask.info else "RGB")
    if mask.mode in ("RGBA", "LA") and mask.getchannel("A").getextrema() != (255, 255):
        return ImageOps.invert(mask.getchannel("A"))
    return mask.convert("L")


def _a1111_mask(mask: Image.Image) -> Image.Image:
    """An RGBA mask whose alpha is not all opaque repaints where it is opaque (the alpha, cut at
    128, as A1111 rounds it); any other, where it is white (its grey; an alpha besides RGBA's
    is not read, as A1111 reads none)."""
    if mask.mode == "RGBA" and mask.getchannel("A").getextrema() != (255, 255):
        return mask.getchannel("A").point(lambda level: 255 if level > 128 else 0)
    return mask.convert("L")


def check_mask_fits(image: Image.Image, mask: Image.Image) -> None:
    if mask.size != image.size:
        raise BadRequest(f"the mask is {mask.width}x{mask.height} but the image is {image.width}x{image.height}: "
                         "send a mask of the image's size")


def output_size(image: Image.Image, width: int | None, height: int | None, max_width: int,
                max_height: int, max_pixels: int | None = None) -> tuple[int, int]:
    """The size to generate when the request names none (or one side): the image's, scaled
    down (its shape kept) to fit `max_width` x `max_height` when both sides are missing and
    to `max_pixels`, and rounded down to a multiple of `SIZE_MULTIPLE`. A side asked for is
    kept; the other is what it would be with no size asked, within its own limit."""
    scale = min(1.0, max_width / image.width, max_height / image.height) if width is None and height is None \
        else 1.0
    if max_pixels is not None:
        scale = min(scale, math.sqrt(max_pixels / (image.width * image.height)))

    def side(given: int | None, own: int, most: int) -> int:
        if given is not None:
            return given
        fitted = min(int(own * scale), most)
        return max(SIZE_MULTIPLE, fitted // SIZE_MULTIPLE * SIZE_MULTIPLE)

    return side(width, image.width, max_width), side(height, image.height, max_height)


def decode_cost(data: bytes, what: str, limits: ImageLimits) -> int:
    """The bytes decoding `data` takes at its peak, from its header alone: its pixels at the
    depth and channels PIL decodes them to, twice (turned upright makes a copy), and the
    conversions' copies (RGB for an image; for a mask, RGBA from a palette, its alpha and the
    alpha inverted: at most 6 bytes a pixel). BadRequest as `read_image` for a file it refuses."""
    check_file_bytes(len(data), what, limits)
    header = _open(data, what, limits)
    _check_size(header.width, header.height, what, limits)
    mode = ImageMode.getmode(header.mode)
    per_pixel = len(mode.bands) * max(1, int(mode.typestr[-1]))
    return header.width * header.height * (2 * per_pixel + 6)


def read_inputs(image: bytes, mask: bytes | None, limits: ImageLimits,
                mask_convention: MaskConvention = "openai") -> tuple[Image.Image, Image.Image | None]:
    """The image (RGB) and the mask ("L", of the image's size, read by `mask_convention`:
    `read_mask`), decoded and checked."""
    picture = read_image(image, "image", limits)
    if mask is None:
        return picture, None
    painted = read_mask(mask, limits, mask_convention)
    check_mask_fits(picture, painted)
    return picture, painted


def encode_image(image: Image.Image, fmt: str, *, quality: int | None = None,
                 record: ImageRecord | None = None) -> bytes:
    """A generated image as the bytes of a PNG, WebP or JPEG file (`fmt`, one of
    `OUTPUT_FORMATS`): the one encoder, for the HTTP APIs and `loraswap generate -o` alike.
    `quality` (0-100, WebP and JPEG): instead of 95. `record`: what made it, carried in the file
    (PNG text chunks, EXIF for WebP and JPEG; `media/metadata.py`); the pixels are the same."""
    options = dict(OUTPUT_FORMATS[fmt])
    if quality is not None:
        if fmt == "PNG":
            raise ValueError("a PNG is lossless: it takes no quality")
        options["quality"] = quality
    if record is not None:
        if fmt == "PNG":
            options["pnginfo"] = png_info(record)
        elif (tags := exif(record, fmt)) is not None:
            options["exif"] = tags
        else:
            logger.warning("a %s goes without its record: its infotext is over the %s bytes a JPEG's EXIF holds",
                           fmt, JPEG_EXIF_BYTES)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def format_for_file(path: Path) -> str:
    """The output format a file's suffix names; any other suffix is refused."""
    fmt = _SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise BadRequest(f"cannot write an image as {path.name}: write a png, jpg or webp")
    return fmt


def check_file_bytes(size: int, what: str, limits: ImageLimits) -> None:
    if size == 0:
        raise BadRequest(f"the {what} is empty: send a PNG, JPEG or WebP file")
    if size > limits.max_bytes:
        raise BadRequest(f"the {what} is {size} bytes; the limit is {limits.max_bytes} bytes: send a smaller file")


def _decode(data: bytes, what: str, limits: ImageLimits) -> Image.Image:
    """`data` opened (header only), its size checked, then decoded and turned upright (16-bit
    grey made 8-bit)."""
    check_file_bytes(len(data), what, limits)
    image = _open(data, what, limits)
    _check_size(image.width, image.height, what, limits)
    try:
        image.load()
        image = ImageOps.exif_transpose(image)
    # a decoder fed hostile bytes raises many types (OSError, ValueError, SyntaxError, struct.error,
    # IndexError, ...): all mean "this file cannot be read", which is the client's to fix
    except Exception as e:
        logger.debug("undecodable %s (%s): %r", what, image.format, e)
        raise BadRequest(f"the {what} is a {image.format} file that cannot be decoded ({_reason(e)}): it is "
                         "truncated or corrupt; send the whole file") from None
    return _eight_bit(image) if image.mode.startswith("I;16") else image


def _open(data: bytes, what: str, limits: ImageLimits) -> Image.Image:
    """PIL's lazy open: the format and the header's size, no pixels yet."""
    try:
        return Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:
        # PIL refuses past twice its own limit, before our check sees the size
        raise BadRequest(f"the {what}'s header declares more than {2 * Image.MAX_IMAGE_PIXELS} pixels; the limit is "
                         f"{limits.max_pixels} pixels: send a smaller image") from None
    except Exception as e:  # UnidentifiedImageError, or a header the plugin cannot parse
        if data.startswith(_MAGIC):
            raise BadRequest(f"the {what} has a corrupt header ({_reason(e)}): send the whole file") from None
        raise BadRequest(f"the {what} is not a PNG, JPEG or WebP file: convert it to one of those") from None


def _eight_bit(image: Image.Image) -> Image.Image:
    """16-bit grey (a depth map, say) as 8-bit grey: PIL's own convert clips it at 255 instead
    of scaling it."""
    return Image.fromarray((np.asarray(image, dtype=np.uint16) >> 8).astype(np.uint8), "L")


def _check_size(width: int, height: int, what: str, limits: ImageLimits) -> None:
    if width * height > limits.max_pixels:
        side = math.isqrt(limits.max_pixels)
        raise BadRequest(f"the {what} is {width}x{height} ({width * height} pixels); the limit is "
                         f"{limits.max_pixels} pixels (about {side}x{side}): send a smaller image")
    if min(width, height) < MIN_SIDE:
        raise BadRequest(f"the {what} is {width}x{height}; each side must be at least {MIN_SIDE} pixels")


def _reason(error: Exception) -> str:
    """PIL's words, without the repr of an in-memory file it sometimes adds."""
    return re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", str(error))[:200] or type(error).__name__
