"""The generation record an image carries: what made it, so that anyone can make it again.

Written as the tools that read such files expect it, field for field:
- A1111's infotext (`infotext`), the text stable-diffusion-webui writes and Forge, SD.Next,
  Civitai and the prompt readers parse: the prompt (the adapters as `<lora:NAME:WEIGHT>`
  tags), a `Negative prompt: ...` line, then one line of `Key: value` pairs, a value with a
  comma, a colon or a line break quoted as JSON (A1111's `quote`);
- a JSON record (`as_json`) with the same facts and each adapter's full SHA-256.

A PNG carries both as text chunks (`parameters`, A1111's key, and `loraswap`); a JPEG or
WebP in EXIF, as A1111 writes them: the infotext in the Exif IFD's UserComment (UTF-16
big-endian after an 8-byte `UNICODE` prefix), the JSON in ImageDescription.
"""

import json
from dataclasses import asdict, dataclass, field

from PIL import Image, PngImagePlugin

PNG_INFOTEXT_KEY = "parameters"  # A1111's text chunk
PNG_RECORD_KEY = "loraswap"
EXIF_IFD = 0x8769  # the Exif sub-IFD, where UserComment lives
USER_COMMENT = 0x9286
IMAGE_DESCRIPTION = 0x010E
_UNICODE_PREFIX = b"UNICODE\0"  # EXIF's character code for UserComment: UCS-2/UTF-16, read big-endian by A1111
# a JPEG's EXIF is one APP1 segment of at most 64 KiB; past it the JSON is left out, then the EXIF
JPEG_EXIF_BYTES = 65_000
A1111_HASH_DIGITS = 12  # A1111's short hash of a LoRA file (`NetworkOnDisk.shorthash`)
# diffusers' schedulers by the name A1111 gives the same sampler; any other is named by its class
SAMPLER_NAMES = {
    "EulerDiscreteScheduler": "Euler", "EulerAncestralDiscreteScheduler": "Euler a",
    "FlowMatchEulerDiscreteScheduler": "Euler", "DDIMScheduler": "DDIM", "PNDMScheduler": "PLMS",
    "LMSDiscreteScheduler": "LMS", "HeunDiscreteScheduler": "Heun", "KDPM2DiscreteScheduler": "DPM2",
    "KDPM2AncestralDiscreteScheduler": "DPM2 a", "DPMSolverMultistepScheduler": "DPM++ 2M",
    "UniPCMultistepScheduler": "UniPC", "LCMScheduler": "LCM", "DEISMultistepScheduler": "DEIS",
}
# a scheduler whose `algorithm_type` makes it another of A1111's samplers
SAMPLER_ALGORITHMS = {("DPMSolverMultistepScheduler", "sde-dpmsolver++"): "DPM++ 2M SDE"}
# diffusers' `use_NAME_sigmas` as A1111's "Schedule type"
SCHEDULE_TYPES = {"karras": "Karras", "exponential": "Exponential", "beta": "Beta"}


def sampler_name(scheduler: str, algorithm: str | None = None) -> str:
    """A1111's name of the sampler a diffusers scheduler (its class, its `algorithm_type`) is;
    one it has no name for, by its class."""
    return SAMPLER_ALGORITHMS.get((scheduler, algorithm)) or SAMPLER_NAMES.get(scheduler, scheduler)


@dataclass(frozen=True)
class AdapterUse:
    """One adapter of the image: its id, its weight in the blend, and its file's hashes."""

    id: str
    weight: float
    sha256: str | None = None  # of the whole file (None: not known, the file changed since it was used)
    tensors_sha256: str | None = None  # of the bytes after the safetensors header: A1111's (and kohya's) hash


@dataclass(frozen=True)
class ImageRecord:
    """What made one image, as it ran: the model's defaults where the request gave none, the
    seed drawn where it gave none, the size made."""

    prompt: str
    negative_prompt: str | None
    steps: int | None
    guidance: float | None
    seed: int
    width: int
    height: int
    model: str | None
    sampler: str | None = None  # the scheduler's class, as diffusers names it
    sampler_algorithm: str | None = None  # its `algorithm_type` (`sde-dpmsolver++`), where it has one
    sigmas: str | None = None  # its noise schedule (`karras`, `exponential`, `beta`; None: the scheduler's own)
    strength: float | None = None  # with an input image: how much of it was repainted
    adapters: tuple[AdapterUse, ...] = ()
    software: str = "loraswap"
    extra: dict = field(default_factory=dict)  # more facts for the JSON record (the step cache, ...)

    def prompt_with_tags(self) -> str:
        """The prompt as A1111 would show it: the adapters as `<lora:NAME:WEIGHT>` tags after it."""
        tags = " ".join(f"<lora:{a.id}:{_weight_text(a.weight)}>" for a in self.adapters)
        return f"{self.prompt} {tags}" if tags else self.prompt

    def infotext(self) -> str:
        """A1111's `parameters` text (its `processing.create_infotext` layout)."""
        # named as the prompt's tags name them (the id, `civitai:1@2` too), so that a reader pairs
        # each tag with its hash; an id holds no comma, the one character that would split the list
        short = {a.id: a.tensors_sha256[:A1111_HASH_DIGITS] for a in self.adapters if a.tensors_sha256}
        params = {
            "Steps": self.steps,
            "Sampler": sampler_name(self.sampler, self.sampler_algorithm) if self.sampler else None,
            "Schedule type": SCHEDULE_TYPES.get(self.sigmas, self.sigmas) if self.sigmas else None,
            "CFG scale": None if self.guidance is None else float(self.guidance),
            "Seed": self.seed,
            "Size": f"{self.width}x{self.height}",
            "Model": _alias(self.model) if self.model else None,
            "Denoising strength": self.strength,
            "Lora hashes": ", ".join(f"{name}: {digest}" for name, digest in short.items()) or None,
            "Version": self.software,
        }
        line = ", ".join(f"{key}: {_quote(value)}" for key, value in params.items() if value is not None)
        negative = f"\nNegative prompt: {self.negative_prompt}" if self.negative_prompt else ""
        return f"{self.prompt_with_tags()}{negative}\n{line}".strip()

    def as_json(self) -> str:
        """The record as JSON text, ASCII only (EXIF's ImageDescription is ASCII)."""
        record = asdict(self)
        record.update(record.pop("extra"))
        return json.dumps(record, ensure_ascii=True, separators=(",", ":"))


def _weight_text(weight: float) -> str:
    """A weight as A1111 writes it (`1`, `0.8`), exactly: a tag sent back gives the same weight."""
    short = f"{weight:g}"
    return short if float(short) == weight else repr(weight)


def _alias(name: str) -> str:
    """A name as A1111 writes it in a `Key: value` list: no commas, no colons."""
    return name.replace(",", "").replace(":", "")


def _quote(value) -> str:
    """A1111's `infotext_utils.quote`: a value with a comma, a colon or a line break as JSON text."""
    text = str(value)
    return json.dumps(text, ensure_ascii=False) if any(c in text for c in ",:\n") else text


def png_info(record: ImageRecord) -> PngImagePlugin.PngInfo:
    """The PNG text chunks (tEXt, or iTXt for text beyond Latin-1) that carry `record`."""
    info = PngImagePlugin.PngInfo()
    info.add_text(PNG_INFOTEXT_KEY, record.infotext())
    info.add_text(PNG_RECORD_KEY, record.as_json())
    return info


def exif(record: ImageRecord, fmt: str) -> Image.Exif | None:
    """The EXIF that carries `record` in a JPEG or WebP; for a JPEG, without the JSON when both
    would not fit its one segment, and None when the infotext alone would not."""
    tags = Image.Exif()
    tags.get_ifd(EXIF_IFD)[USER_COMMENT] = _UNICODE_PREFIX + record.infotext().encode("utf-16-be")
    tags[0x0131] = record.software  # Software
    tags[IMAGE_DESCRIPTION] = record.as_json()
    if fmt != "JPEG" or len(tags.tobytes()) <= JPEG_EXIF_BYTES:
        return tags
    del tags[IMAGE_DESCRIPTION]
    return tags if len(tags.tobytes()) <= JPEG_EXIF_BYTES else None

