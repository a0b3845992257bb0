"""Image bytes for the image-input tests: encoded noise, a PNG that only declares its size, and
the refusals every route must give (against `LIMITS`)."""

import io
import struct
import zlib

import numpy as np
from PIL import Image

from loraswap.media.images import ImageLimits

LIMITS = ImageLimits(max_bytes=64 * 1024, max_pixels=2048 * 2048)


def encode(image: Image.Image, fmt: str = "PNG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def pixels_of(data: bytes) -> np.ndarray:
    """The decoded pixels of an image file: two answers that differ only in the record they
    carry (the adapter's id, say) have the same."""
    return np.asarray(Image.open(io.BytesIO(data)))


def png_declaring(width: int, height: int) -> bytes:
    """A PNG of a few dozen bytes whose header declares width x height (its pixels are missing:
    decoding it would fail, so a refusal that names the size was made from the header alone)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16))
            + chunk(b"IEND", b""))


def noise(width: int, height: int, mode: str = "RGB") -> Image.Image:
    channels = len(mode)
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)


GOOD = encode(noise(48, 32))

REFUSALS = [
    ("empty", b"", "the image is empty: send a PNG, JPEG or WebP file"),
    ("text", b"hello, not an image at all", "the image is not a PNG, JPEG or WebP file: convert it to one of those"),
    ("gif", encode(noise(32, 32, "L"), "GIF"), "the image is not a PNG, JPEG or WebP file"),
    ("bmp", encode(noise(32, 32), "BMP"), "the image is not a PNG, JPEG or WebP file"),
    ("truncated", GOOD[: len(GOOD) // 2], "the image is a PNG file that cannot be decoded (image file is truncated"),
    ("corrupt header", GOOD[:30], "the image has a corrupt header"),
    ("bomb", png_declaring(100_000, 100_000), "the image's header declares more than 178956970 pixels; the limit "
     "is 4194304 pixels: send a smaller image"),
    ("over the pixel limit", png_declaring(4000, 2000), "the image is 4000x2000 (8000000 pixels); the limit is "
     "4194304 pixels (about 2048x2048): send a smaller image"),
    ("too many bytes", encode(noise(256, 256)), "bytes; the limit is 65536 bytes: send a smaller file"),
    ("too small", encode(noise(8, 40)), "the image is 8x40; each side must be at least 16 pixels"),
]


def png16_rgba(width: int, height: int) -> bytes:
    """A 16-bit RGBA PNG of one colour: a few hundred KB that decode to width x height x 4 bytes
    (PIL cannot write 16 bits a channel in colour, so the chunks are written here)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" + b"\x12\x34" * 4 * width  # filter byte, then RGBA at 16 bits
    pixels = zlib.compress(row * height, 9)
    header = struct.pack(">IIBBBBB", width, height, 16, 6, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
