"""Frames to an H.264 MP4, for the videos API and `loraswap generate -o out.mp4`.

imageio with imageio-ffmpeg, not PyAV: imageio-ffmpeg's wheel carries a static ffmpeg
build with libx264 (the reference H.264 encoder, the one every player decodes), so nothing
needs to be installed beside the package; imageio feeds it raw RGB frames over a pipe. The
subprocess costs tens of milliseconds per video, nothing beside a video's generation.

The MP4 is H.264 in yuv420p, the pixel format every browser and phone plays. yuv420p keeps
one colour sample per 2x2 block, so width and height must be even: an odd side is padded
by one row or column repeating the edge pixels (nothing is scaled, nothing is cut off).
The moov atom is written first (`+faststart`), so a browser starts playing while it downloads.
"""

import tempfile
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
from PIL import Image

# x264's constant rate factor: 18 is about visually lossless (0 lossless, 23 x264's default, 51 worst)
CRF = 18


def encode_mp4(frames: list[Image.Image], fps: int) -> bytes:
    """The frames, in order, as an H.264 MP4 (yuv420p) playing at `fps` frames per second.

    Frames of any PIL mode are converted to RGB; they must all have one size. An odd width or
    height is padded to even by repeating the last column or row.
    """
    # 1. refuse what cannot be a video, before any work
    if not frames:
        raise ValueError("no frames to encode: a video needs at least one")
    if not (isinstance(fps, int) and fps >= 1):
        raise ValueError(f"fps must be a whole number of frames per second, at least 1; got {fps!r}")
    sizes = {frame.size for frame in frames}
    if len(sizes) > 1:
        raise ValueError(f"the frames have {len(sizes)} sizes ({', '.join(f'{w}x{h}' for w, h in sorted(sizes))}); "
                         "a video's frames all have one size")
    # 2. write through ffmpeg to a file: an MP4's index (moov) is written after the frames, so
    #    ffmpeg must seek back; a pipe cannot
    with tempfile.TemporaryDirectory(prefix="loraswap-mp4-") as folder:
        path = Path(folder) / "video.mp4"
        # macro_block_size=2: imageio would otherwise scale frames to multiples of 16
        with imageio.get_writer(path, format="FFMPEG", mode="I", fps=fps, codec="libx264", pixelformat="yuv420p",
                                quality=None, macro_block_size=2, ffmpeg_log_level="error",
                                output_params=["-crf", str(CRF), "-movflags", "+faststart"]) as writer:
            for frame in frames:
                writer.append_data(even_sized(np.asarray(frame.convert("RGB"))))
        return path.read_bytes()


def even_sized(pixels: np.ndarray) -> np.ndarray:
    """(height, width, 3) pixels with an odd side padded by one, repeating the edge."""
    height, width = pixels.shape[:2]
    if height % 2 == 0 and width % 2 == 0:
        return pixels
    return np.pad(pixels, ((0, height % 2), (0, width % 2), (0, 0)), mode="edge")
