"""Write docs/preview-strip.png: the demo model's previews of one image, every 4 of its 20 steps,
sketched (the linear map: top row) and decoded by the VAE (bottom row), then the image itself,
each picture scaled up 3 times (nearest) to be seen.

    PYTHONPATH=src python tools/docs/preview_strip.py [OUT.png]
"""

import sys
from pathlib import Path

from PIL import Image

from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest
from loraswap.engine.step_listener import StepListener, every_steps, previews_hook

PAGE_IMAGE = Path(__file__).resolve().parents[2] / "docs" / "preview-strip.png"
PROMPT, SEED, EVERY, SCALE = "a red circle at the left on white", 3, 4, 3


class Collected(StepListener):
    asks_previews = True

    def __init__(self, full: bool):
        self.preview_full, self.pictures = full, []

    def wants_preview(self, done: int, total: int) -> bool:
        return every_steps(EVERY, done, total)

    def preview(self, done: int, total: int, picture) -> None:
        self.pictures.append(picture.image())


def strip(out: Path) -> None:
    engine = Engine(EngineConfig(model="demo", device="cpu", compile=False, warmup=False))
    rows = []
    for full in (False, True):
        listener = Collected(full)
        with engine.lender.lease_now([]) as lease:
            result = engine.generate_batch([GenerateRequest(prompt=PROMPT, seed=SEED)], lease,
                                           on_step=lambda done, total: None, on_latents=previews_hook([listener]))[0]
        rows.append([*listener.pictures, result.image])
    side = rows[0][0].width * SCALE
    sheet = Image.new("RGB", (side * len(rows[0]), side * len(rows)), "white")
    for y, row in enumerate(rows):
        for x, picture in enumerate(row):
            sheet.paste(picture.resize((side, side), Image.Resampling.NEAREST), (x * side, y * side))
    sheet.save(out, optimize=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    strip(Path(sys.argv[1]) if len(sys.argv) > 1 else PAGE_IMAGE)
