"""A picture grid of `demo-flux`: fixed prompts (rows) without and with each adapter (columns).

    python tools/demo/demo_flux_grid.py [--folder WEIGHTS] [--device cpu] [-o docs/demo-flux-grid.png]

Each adapter is applied by its own library (diffusers' `load_lora_weights`, LyCORIS's network
for the LoKr), which the tests show loraswap's fused swap matches. FLUX.1-dev's settings: 28
steps, guidance 3.5; seed 0 for every picture.
"""

import argparse
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from loraswap.models.families import demo_flux

PROMPTS = ("a red circle at the left on white", "a small blue square at the center on black",
           "a large green triangle at the right on gray", "a striped orange circle at the center on white",
           "a large striped purple square at the left on black", "a small yellow triangle at the right on gray")


def pipeline_with(folder: Path, adapter: str | None, device: str):
    torch.manual_seed(0)
    pipeline = demo_flux.load_trained(demo_flux.untrained_demo_flux(), folder=folder).to(device)
    if adapter is None:
        return pipeline
    path = folder / "adapters" / f"{adapter}.safetensors"
    if adapter == "pastel":  # LyCORIS's LoKr: diffusers reads no LoKr
        from lycoris import create_lycoris_from_weights

        network, _ = create_lycoris_from_weights(1.0, str(path), pipeline.transformer)
        network.apply_to()
        network.to(device)
    else:
        pipeline.load_lora_weights(str(path))
    return pipeline


def row_images(pipeline, device: str) -> list[np.ndarray]:
    pipeline.set_progress_bar_config(disable=True)
    generators = [torch.Generator("cpu").manual_seed(0) for _ in PROMPTS]
    out = pipeline(list(PROMPTS), generator=generators, num_inference_steps=28, guidance_scale=3.5,
                   width=demo_flux.SIZE, height=demo_flux.SIZE, max_sequence_length=demo_flux.TEXT_TOKENS,
                   output_type="np")
    return [(image * 255).round().astype(np.uint8) for image in out.images]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, default=demo_flux.WEIGHTS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("-o", "--output", type=Path, default=Path("docs/demo-flux-grid.png"))
    args = parser.parse_args()
    columns = [row_images(pipeline_with(args.folder, adapter, args.device), args.device)
               for adapter in (None, *demo_flux.DEMO_ADAPTERS)]
    grid = np.concatenate([np.concatenate(images, axis=0) for images in columns], axis=1)
    Image.fromarray(grid).save(args.output)
    print(f"wrote {args.output}: rows {PROMPTS}, columns (none, {', '.join(demo_flux.DEMO_ADAPTERS)})")


if __name__ == "__main__":
    main()
