"""A numeric reading of a picture of one shape on a plain ground: the ground's colour, the
shape's hue, kind (from its geometry), place, size, hollowness and stripes. It knows
nothing of how the demo models or their training pictures are drawn: its references are
shapes drawn by PIL and colour names by hue. A striped shape's kind is read from its
bands joined up again (a closing along the columns), so stripes do not change its kind."""

import colorsys
from dataclasses import dataclass
from functools import cache

import numpy as np
from PIL import Image, ImageDraw

HUES = {"red": 0, "orange": 30, "yellow": 55, "green": 130, "blue": 225, "purple": 280}  # degrees
GROUNDS = {"white": 245, "black": 15, "gray": 125}  # grey level
MIN_DISTANCE = 60  # RGB distance from the ground that makes a pixel part of the shape


@dataclass
class Reading:
    ground: str
    area: int  # pixels of the shape
    hue: str | None
    saturation: float  # of the shape's pixels, median
    shape: str | None
    x: float  # centroid, as a fraction of the width
    hollow: float  # fraction of the pixels near the centroid that are ground
    empty_rows: float  # fraction of the rows inside the shape's extent that are mostly ground
    gap_rows: float = 0.0  # fraction of the shape's rows mostly missing from its joined-up outline (stripes)


def _ground(image: np.ndarray) -> np.ndarray:
    border = np.concatenate([image[:2].reshape(-1, 3), image[-2:].reshape(-1, 3), image[:, :2].reshape(-1, 3),
                             image[:, -2:].reshape(-1, 3)])
    return np.median(border, axis=0)


def _hue_name(pixels: np.ndarray) -> tuple[str | None, float]:
    hsv = np.array([colorsys.rgb_to_hsv(*(p / 255.0)) for p in pixels])
    angles = hsv[:, 0] * 2 * np.pi
    mean = np.degrees(np.arctan2(np.sin(angles).mean(), np.cos(angles).mean())) % 360
    name = min(HUES, key=lambda n: min(abs(mean - HUES[n]), 360 - abs(mean - HUES[n])))
    return name, float(np.median(hsv[:, 1]))


def extent(mask: np.ndarray) -> float:
    """The shape's area over its bounding box's: a square ~1, a disc ~0.79, a triangle ~0.5
    (see `_references`)."""
    ys, xs = np.nonzero(mask)
    return float(len(xs) / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1)))


@cache
def _references() -> dict[str, float]:
    """`extent` of a disc, a square and a triangle drawn by PIL at 32 px."""
    shapes = {"circle": lambda d: d.ellipse((9, 9, 23, 23), fill=255),
              "square": lambda d: d.rectangle((10, 10, 22, 22), fill=255),
              "triangle": lambda d: d.polygon([(16, 8), (24, 23), (8, 23)], fill=255)}
    values = {}
    for name, draw in shapes.items():
        image = Image.new("L", (32, 32))
        draw(ImageDraw.Draw(image))
        values[name] = extent(np.asarray(image) > 127)
    return values


def _close_columns(mask: np.ndarray, reach: int) -> np.ndarray:
    """A binary closing along each column: gaps of up to 2 x `reach` rows between shape
    pixels filled (a dilation then an erosion by a vertical run of 2 x `reach` + 1)."""
    padded = np.pad(mask, ((reach, reach), (0, 0)))
    n = mask.shape[0]
    grown = np.any([padded[k:k + n] for k in range(2 * reach + 1)], axis=0)
    padded = np.pad(grown, ((reach, reach), (0, 0)), constant_values=True)
    return np.all([padded[k:k + n] for k in range(2 * reach + 1)], axis=0)


def read(image: np.ndarray) -> Reading:
    """`image`: HxWx3 uint8."""
    image = image.astype(np.float64)
    ground = _ground(image)
    mask = np.linalg.norm(image - ground, axis=-1) > MIN_DISTANCE
    ground_name = min(GROUNDS, key=lambda n: abs(ground.mean() - GROUNDS[n]))
    area = int(mask.sum())
    if area < 6:
        return Reading(ground_name, area, None, 0.0, None, 0.5, 1.0, 0.0)
    hue, saturation = _hue_name(image[mask])
    ys, xs = np.nonzero(mask)
    cy, cx = ys.mean(), xs.mean()
    references = _references()
    closed = _close_columns(mask, max(1, mask.shape[0] // 32))
    value = extent(closed)
    shape = min(references, key=lambda n: abs(references[n] - value))
    near = np.hypot(*np.mgrid[0:mask.shape[0], 0:mask.shape[1]] - np.array([cy, cx])[:, None, None])
    inner = near <= 0.35 * np.sqrt(area / np.pi) + 0.5
    rows = mask[ys.min():ys.max() + 1, xs.min():xs.max() + 1].mean(axis=1)
    outline_rows = closed[ys.min():ys.max() + 1].sum(axis=1)
    gaps = mask[ys.min():ys.max() + 1].sum(axis=1) < 0.3 * outline_rows
    return Reading(ground=ground_name, area=area, hue=hue, saturation=saturation, shape=shape,
                   x=float(cx / mask.shape[1]), hollow=float(1 - mask[inner].mean()),
                   empty_rows=float((rows < 0.3).mean()), gap_rows=float(gaps[outline_rows > 0].mean()))
