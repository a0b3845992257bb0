"""The pictures `demo-flux` learns from, drawn in code, and their prompts.

A coloured circle, square or triangle (`small`, `large` or neither; `striped` or plain) at
the left, centre or right, on a white, black or grey ground, 128x128, with the prompt that
says so ("a small striped red circle at the left on white"; the place or the ground now
and then left unsaid and then drawn at random, a shape of no size word unsized and of no
texture word plain, and one prompt in ten empty, which the guidance is distilled against).
An adapter's pictures are the same with its change (`EFFECTS`). Used by
`tools/demo/train_demo_flux.py`; the tests read pictures with `tests/support/shapes.py`, which
knows nothing of this drawing.
"""

import numpy as np

from loraswap.models.families import demo_flux

SUPERSAMPLE = 2  # shapes drawn at 2x and averaged down: smooth edges
RADIUS = 0.17  # an unsized shape's radius, as a fraction of the width
STRIPE = 4  # pixels per band: a band and a gap span one latent row (the VAE downsamples by 8)
OUTLINE = 4.0  # pixels
EFFECTS = (None, *demo_flux.DEMO_ADAPTERS)


def shape_mask(shape: str, cx: float, cy: float, radius: float, size: int) -> np.ndarray:
    """Coverage (0..1) of the shape at `size` pixels; centre and radius in pixels."""
    n = size * SUPERSAMPLE
    y, x = (np.mgrid[0:n, 0:n] + 0.5) / SUPERSAMPLE
    dx, dy = x - cx, y - cy
    if shape == "circle":
        inside = dx**2 + dy**2 <= radius**2
    elif shape == "square":
        half = radius * 0.86  # the area of the circle
        inside = (np.abs(dx) <= half) & (np.abs(dy) <= half)
    else:  # an upright triangle, base below
        top, bottom = cy - radius * 1.1, cy + radius * 0.9
        half_width = (y - top) / (bottom - top) * radius * 1.15
        inside = (y >= top) & (y <= bottom) & (np.abs(dx) <= half_width)
    return inside.reshape(size, SUPERSAMPLE, size, SUPERSAMPLE).mean(axis=(1, 3))


def draw(words: dict, rng: np.random.Generator, effect: str | None = None) -> np.ndarray:
    """One picture, float RGB in [0, 1]; `words`: colour, shape, position, ground, size
    (None: unsized), texture (None: plain); `effect`: an adapter's change."""
    size = demo_flux.SIZE
    radius = size * RADIUS * demo_flux.SIZES.get(words["size"], 1.0) * rng.uniform(0.93, 1.07)
    cx = size * (demo_flux.POSITIONS[words["position"]] + rng.uniform(-0.03, 0.03))
    cy = size * (0.5 + rng.uniform(-0.05, 0.05))
    fill = np.array(demo_flux.COLOURS[words["colour"]], dtype=np.float32) / 255
    ground = "black" if effect == "night" else words["ground"]
    back = np.array(demo_flux.BACKGROUNDS[ground], dtype=np.float32) / 255
    if effect == "big":
        radius *= 1.5
    if effect == "pastel":
        fill = 0.4 * fill + 0.6
    mask = shape_mask(words["shape"], cx, cy, radius, size)
    if effect == "outline":
        mask = np.clip(mask - shape_mask(words["shape"], cx, cy, radius - OUTLINE, size), 0, 1)
    if words["texture"] == "striped":  # bands of STRIPE rows, every 2 x STRIPE, from the top
        rows = (np.arange(size) // STRIPE) % 2 == 0
        mask = mask * rows[:, None]
    return back + mask[..., None] * (fill - back)


def random_words(rng: np.random.Generator) -> dict:
    return {"colour": rng.choice(list(demo_flux.COLOURS)), "shape": rng.choice(demo_flux.SHAPES),
            "position": rng.choice(list(demo_flux.POSITIONS)), "ground": rng.choice(list(demo_flux.BACKGROUNDS)),
            "size": rng.choice([None, *demo_flux.SIZES]), "texture": rng.choice([None, *demo_flux.TEXTURES])}


def prompt_of(words: dict, said: dict | None = None) -> str:
    """The prompt of `words`, leaving out those `said` marks False."""
    said = said or {}
    parts = ["a"]
    for key in ("size", "texture"):
        if words[key] and said.get(key, True):
            parts.append(words[key])
    parts += [words["colour"], words["shape"]]
    if said.get("position", True):
        parts += ["at", "the", words["position"]]
    if said.get("ground", True):
        parts += ["on", words["ground"]]
    return " ".join(parts)


def example(rng: np.random.Generator, effect: str | None = None) -> tuple[np.ndarray, str]:
    """A picture as uint8 RGB and its prompt. A place or ground left unsaid is still drawn, at
    random: the model learns to choose one when a prompt does not."""
    words = random_words(rng)
    picture = np.clip(draw(words, rng, effect) * 255 + 0.5, 0, 255).astype(np.uint8)
    if rng.random() < 0.1:
        return picture, ""
    said = {key: rng.random() > 0.15 for key in ("position", "ground")}
    return picture, prompt_of(words, said)


def examples(seed: int, count: int, effect: str | None = None) -> tuple[np.ndarray, list[str]]:
    """`count` pictures (N x H x W x 3 uint8) and their prompts, from their own seeded stream."""
    rng = np.random.default_rng(seed)
    pictures, prompts = zip(*(example(rng, effect) for _ in range(count)))
    return np.stack(pictures), list(prompts)
