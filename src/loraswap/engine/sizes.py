"""The largest image a served model makes (`LargestSize`): by default a few times its native
size, or the operator's `--max-size`. A request asking for more is refused naming the bound;
one whose size comes from its input image (no size asked) is scaled down to fit.
"""

import re
from dataclasses import dataclass

from loraswap.errors import BadRequest

SMALLEST_BOUND_SIDE = 128
SMALLEST_SIDE = 8  # a request's smallest width or height (`GenerateRequest`)
SIZE_PATTERN = r"^[0-9]{1,5}x[0-9]{1,5}$"  # WIDTHxHEIGHT


def default_largest(native: tuple[int, int]) -> tuple[int, int]:
    """Twice the native size per side (4x the pixels), at least `SMALLEST_BOUND_SIDE` a side.

    Past about twice the resolution it was trained at, a diffusion model repeats its subject
    rather than drawing it larger, while its cost grows faster than its pixels (attention over
    4x the tokens is 16x the work): going further by default only lets one request hold the
    model for minutes (the 32-px demo asked for 1024x1024 takes minutes a step on a CPU). A
    tiny model (the demo's 32 px, the presets' 64 px) gets 128 px: 4x the demo's side, a
    fraction of a second a step on a CPU.
    """
    return max(2 * native[0], SMALLEST_BOUND_SIDE), max(2 * native[1], SMALLEST_BOUND_SIDE)


def parse_size(text: str) -> tuple[int, int]:
    """"WIDTHxHEIGHT" as (width, height); ValueError for anything else."""
    if not re.fullmatch(SIZE_PATTERN, text):
        raise ValueError(f"{text!r} is not a size: write WIDTHxHEIGHT, e.g. 1024x1024")
    width, height = (int(side) for side in text.split("x"))
    if min(width, height) < SMALLEST_SIDE:
        raise ValueError(f"{text} is smaller than any model makes: each side at least {SMALLEST_SIDE}")
    return width, height


def fits(bound: tuple[int, int], width: int, height: int) -> bool:
    """Whether `width` x `height` is within `bound` (width, height), either way round."""
    return (width <= bound[0] and height <= bound[1]) or (width <= bound[1] and height <= bound[0])


def check_fits(model: str, bound: tuple[int, int], width: int, height: int) -> None:
    """BadRequest (400) naming `model`'s largest size `bound` when `width` x `height` is larger."""
    if not fits(bound, width, height):
        turned = f" (or {bound[1]}x{bound[0]})" if bound[0] != bound[1] else ""
        raise BadRequest(f"{model} makes images of at most {bound[0]}x{bound[1]}{turned}, not {width}x{height}: ask "
                         "for a smaller size (the server's --max-size sets this bound)")


@dataclass(frozen=True)
class LargestSize:
    """The largest image model `model` makes: `width` x `height`, either way round (a bound of
    1664x960 takes 960x1664 too), and the size it makes when asked for none (`native`)."""

    model: str
    width: int
    height: int
    native: tuple[int, int]

    @classmethod
    def of(cls, model: str, native: tuple[int, int], max_size: str | None) -> "LargestSize":
        """The operator's `max_size` ("WxH") if given, else `default_largest(native)`."""
        width, height = parse_size(max_size) if max_size else default_largest(native)
        return cls(model, width, height, native)

    def fits(self, width: int, height: int) -> bool:
        return fits((self.width, self.height), width, height)

    def check(self, width: int, height: int) -> None:
        """BadRequest (400) naming the bound when `width` x `height` is larger."""
        check_fits(self.model, (self.width, self.height), width, height)

    def fit(self, width: int, height: int, multiple: int) -> tuple[int, int]:
        """`width` x `height` scaled down to fit (its shape kept, the bound turned to match it),
        each side rounded down to a multiple of `multiple`; unchanged when it fits."""
        if self.fits(width, height):
            return width, height
        wide, high = (max(self.width, self.height), min(self.width, self.height))
        bound = (wide, high) if width >= height else (high, wide)
        scale = min(bound[0] / width, bound[1] / height)
        return tuple(max(multiple, int(side * scale) // multiple * multiple) for side in (width, height))
