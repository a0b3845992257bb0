"""How a generated image leaves the server: the file format and quality the request asks for,
and the record of what made it (`media/metadata.py`), which every image carries unless the
server (`--no-image-metadata`) or the request (`"metadata": false`) says not.

The record tells what ran, not what was asked: the engine reports the model, sampler, steps,
guidance and adapters of the call (`engine.calls.Ran`), the seed drawn and the size made come
with the image, and each adapter's file was hashed by the store when it read it
(`adapters/files/hashes.py`).
"""

import logging
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from fastapi import Request

from loraswap.engine.engine import GenerateResult
from loraswap.engine.request import GenerateRequest
from loraswap.errors import BadRequest
from loraswap.media.metadata import AdapterUse, ImageRecord

logger = logging.getLogger("loraswap.server")

# OpenAI's output_format -> the media type `generation.encode` takes
FORMAT_MEDIA = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}

try:
    SOFTWARE = f"loraswap {version('loraswap')}"
except PackageNotFoundError:  # run from a source tree that was never installed
    SOFTWARE = "loraswap"


@dataclass(frozen=True)
class ImageOutput:
    """What a request asks of its image files: a format (None: the `Accept` header decides),
    a quality for JPEG and WebP (None: the server's), and whether they carry their record
    (None: as the server is set)."""

    media_type: str | None = None
    quality: int | None = None
    metadata: bool | None = None

    @classmethod
    def of(cls, fields: dict) -> "ImageOutput":
        """From a request's fields (OpenAI `output_format`, `output_compression`; `metadata`),
        their values already checked against `limits.LIMITS`."""
        fmt, compression = fields.get("output_format"), fields.get("output_compression")
        if compression is not None and fmt in (None, "png"):
            raise BadRequest("output_compression applies to output_format jpeg or webp; a PNG is lossless: leave "
                             "output_compression out, or ask for output_format jpeg or webp")
        return cls(FORMAT_MEDIA[fmt] if fmt else None, compression, fields.get("metadata"))

    def accept(self, header: str) -> str:
        """What to encode as: the format the body asked for, else what `header` (Accept) names."""
        return self.media_type or header


async def record_for(request: Request, output: ImageOutput, gen: GenerateRequest,
                     result: GenerateResult) -> ImageRecord | None:
    """The record `result`'s image carries, or None when it carries none (turned off, or a
    backend that does not report what ran). Best-effort: the image is made, so a record that
    cannot be built is logged and left out, never a failed request."""
    wanted = output.metadata if output.metadata is not None else request.app.state.config.image_metadata
    if not wanted:
        return None
    if result.ran is None:
        logger.info("an image goes without its record: its backend did not report what ran")
        return None
    try:
        return build_record(gen, result)
    except Exception:  # a bug here must not turn a finished image into a 500 that clients retry
        logger.exception("an image goes without its record: building it failed")
        return None


def build_record(gen: GenerateRequest, result: GenerateResult, software: str = SOFTWARE) -> ImageRecord:
    """The record of `result` (which has `ran`): the adapters' hashes as the store took them
    when it read their files (`engine.calls.AdapterRan`), None where not known."""
    ran = result.ran
    adapters = tuple(AdapterUse(a.id, a.weight, getattr(a.digest, "sha256", None),
                                getattr(a.digest, "tensors_sha256", None)) for a in ran.adapters)
    return ImageRecord(
        prompt=gen.prompt, negative_prompt=gen.negative_prompt, steps=ran.steps, guidance=ran.guidance,
        seed=result.seed, width=result.image.width, height=result.image.height, model=ran.model,
        sampler=ran.sampler, sampler_algorithm=ran.algorithm, sigmas=ran.sigmas, strength=ran.strength,
        adapters=adapters, software=software,
        extra={"step_cache": result.step_cache} if result.step_cache else {})
