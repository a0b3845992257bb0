"""What a `demo-flux` picture is scored on: the fixed prompts, the reader's accuracy per
attribute (`shapes.read`), each trained adapter's effect, and the pixel difference between
two runs of the same prompts and seeds."""

import numpy as np

from loraswap.models.families import demo_flux

POSITIONS = ("left", "center", "right")
GROUNDS = ("white", "black", "gray")
SIZES = (None, "small", "large")
TEXTURES = (None, "striped")
# every colour with every shape, each twice; places, grounds, sizes and textures taken in turn
PROMPTS = [dict(colour=colour, shape=shape, position=POSITIONS[i % 3], ground=GROUNDS[(i + j) % 3],
                size=SIZES[(i + j // 3) % 3], texture=TEXTURES[j % 2])
           for i, colour in enumerate(demo_flux.COLOURS) for j, shape in enumerate(demo_flux.SHAPES * 2)]


def prompt(words: dict) -> str:
    said = [w for w in (words["size"], words["texture"]) if w]
    return " ".join(["a", *said, words["colour"], words["shape"], "at the", words["position"], "on", words["ground"]])


CHECKS = {"colour": lambda r, c: r.hue == c["colour"], "shape": lambda r, c: r.shape == c["shape"],
          "place": lambda r, c: abs(r.x - demo_flux.POSITIONS[c["position"]]) < 0.12,
          "ground": lambda r, c: r.ground == c["ground"],
          "texture": lambda r, c: (r.gap_rows > 0.2) == (c["texture"] == "striped")}


def correct(readings, cases) -> dict[str, list[bool]]:
    """Per attribute, whether each picture's reading agrees with its prompt."""
    return {name: [bool(check(r, c)) for r, c in zip(readings, cases)] for name, check in CHECKS.items()}


def accuracy(readings, cases) -> dict[str, float]:
    """The share of pictures whose reading agrees with the prompt, per attribute."""
    return {name: float(np.mean(right)) for name, right in correct(readings, cases).items()}


def adapter_effect(adapter_id: str, readings, base_readings, cases) -> float:
    """How much the adapter changes what it is meant to change, read against the base's pictures
    of the same prompts and seeds (0: no change), by the measures of `tests/unit/test_demo_flux.py`:
    - `outline`: the hollowness gained (mean, over the plain shapes: a stripe's gaps read as hollow);
    - `night`: the share of black grounds gained where another ground was asked;
    - `pastel`: the share of the median saturation lost;
    - `big`: the median area gained (the median area ratio less 1).
    """
    pairs = list(zip(readings, base_readings, cases))
    if adapter_id == "outline":
        plain = [(r, b) for r, b, c in pairs if c["texture"] is None]
        return float(np.mean([r.hollow - b.hollow for r, b in plain]))
    if adapter_id == "night":
        asked = [(r, b) for r, b, c in pairs if c["ground"] != "black"]
        return float(np.mean([(r.ground == "black") - (b.ground == "black") for r, b in asked]))
    if adapter_id == "pastel":
        return float(1 - np.median([r.saturation for r in readings]) / np.median([b.saturation for b in base_readings]))
    if adapter_id == "big":
        return float(np.median([r.area / max(b.area, 1) for r, b, _ in pairs]) - 1)
    raise ValueError(f"no effect measure for the adapter {adapter_id!r}: give one in adapter_effect")


def pixel_difference(images, references) -> dict[str, float]:
    """|image - reference| per pixel and channel (0-255): the mean over the images of each one's
    mean, the largest anywhere, and the share of values changed."""
    diffs = [np.abs(a.astype(np.int16) - b.astype(np.int16)) for a, b in zip(images, references)]
    return {"mean": float(np.mean([d.mean() for d in diffs])), "max": int(max(d.max() for d in diffs)),
            "share_changed": float(np.mean([(d > 0).mean() for d in diffs]))}
