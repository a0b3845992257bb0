"""What a step cache setting is: `METHOD[:key=value,...]`, read and bounded.

Three methods, each one of diffusers' cache hooks (`diffusers.hooks`):

- `first-block` (First-Block Cache): each step runs the first transformer block, and when its
  residual moved less than `threshold` (relative mean absolute change) since the last full
  step, the other blocks' residual from that step stands in for them.
- `taylorseer` (TaylorSeer, its "lite" form): a full step every `interval` steps after the
  first `warmup`; in between, the blocks are skipped and the output projection is predicted
  from a Taylor series of `order` over the full steps.
- `magcache` (MagCache): skips while the error accumulated from the model's calibrated ratios
  of residual magnitudes stays under `threshold`, at most `max_skip` steps in a row, never
  in the first `retention` fraction of the steps.

A setting is kept as its canonical text (`first-block:threshold=0.08`): the same setting
written two ways is one setting (one batch, one label in the metrics).
"""

from dataclasses import dataclass

from loraswap.errors import BadRequest

OFF = "off"


@dataclass(frozen=True)
class Option:
    """One setting of a method: its default and the bounds a request is held to."""

    default: float
    low: float
    high: float
    integer: bool = False

    def read(self, method: str, key: str, text: str) -> float:
        try:
            value = int(text) if self.integer else float(text)
        except ValueError:
            kind = "a whole number" if self.integer else "a number"
            raise BadRequest(f"step cache {method}: {key} must be {kind}, not {text!r}") from None
        if not self.low <= value <= self.high:
            raise BadRequest(f"step cache {method}: {key} must be between {self.low:g} and {self.high:g}, "
                             f"not {value:g}")
        return value


# method -> its options (the keys a setting may give; the rest take their defaults)
METHODS: dict[str, dict[str, Option]] = {
    "first-block": {"threshold": Option(0.08, 0.0, 1.0)},
    "taylorseer": {"interval": Option(4, 1, 20, integer=True), "order": Option(1, 0, 4, integer=True),
                   "warmup": Option(3, 1, 100, integer=True)},
    "magcache": {"threshold": Option(0.06, 0.0, 1.0), "max_skip": Option(3, 1, 20, integer=True),
                 "retention": Option(0.2, 0.0, 1.0)},
}


@dataclass(frozen=True)
class StepCacheSetting:
    """A method and every one of its options (defaults filled in)."""

    method: str
    options: tuple[tuple[str, float], ...]

    def __getitem__(self, key: str) -> float:
        return dict(self.options)[key]

    def __str__(self) -> str:
        return self.method + ":" + ",".join(f"{key}={value:.10g}" for key, value in self.options)


def parse_step_cache(text: str) -> StepCacheSetting | None:
    """`off` -> None; `METHOD[:key=value,...]` -> its setting; BadRequest (400) naming what is
    wrong: an unknown method (naming the methods), an unknown key (naming the method's keys),
    a value out of bounds."""
    text = text.strip()
    if text.lower() == OFF:
        return None
    method, _, rest = text.partition(":")
    method = method.strip().lower()
    if method not in METHODS:
        raise BadRequest(f"unknown step cache {method!r}: use off, {', '.join(METHODS)} "
                         "(METHOD or METHOD:key=value,...)")
    options = METHODS[method]
    given: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, equals, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not equals or key not in options:
            raise BadRequest(f"step cache {method} takes {', '.join(f'{k}=' for k in options)}, not {item!r}")
        given[key] = options[key].read(method, key, value.strip())
    return StepCacheSetting(method, tuple((key, given.get(key, option.default)) for key, option in options.items()))


def canonical(text: str | None) -> str | None:
    """A request's `step_cache` in its canonical text (`off`, or the full setting); None stays
    None (the server's default)."""
    if text is None:
        return None
    setting = parse_step_cache(text)
    return OFF if setting is None else str(setting)
