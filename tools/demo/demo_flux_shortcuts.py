"""What a shortcut does to `demo-flux`'s pictures: the reader's accuracy per attribute and the
pixel difference against the exact model, over the fixed prompts of `tests/unit/test_demo_flux.py`.

    PYTHONPATH=src:tests python tools/demo/demo_flux_shortcuts.py [--variant NAME]... [--json OUT]

Variants (each against `exact`, the float32 model in one process on the CPU):
- `fp8-weight-only`: float8 weights de-quantized in the matmul (`--quantize fp8-weight-only`;
  runs on a CPU);
- `fp8`: float8 weights and activations (`--quantize fp8`; needs a GPU of compute 8.9 or later,
  so it is measured there against the GPU's own exact run, both in bfloat16);
- `split`: the image split over two processes (`--ulysses-degree 2`, gloo on the CPU), through
  a real server, as a client sees it;
- `adapters`: each demo adapter, for the reader's accuracy with it (no pixel difference: an
  adapter is meant to change the picture).
Also the time of one 28-step image on this machine.
"""

import argparse
import io
import json
import os
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from support import shapes  # noqa: E402
from support.servers import ServerProcess  # noqa: E402
from unit.test_demo_flux import PROMPTS, accuracy, prompt  # noqa: E402

from loraswap.adapters.reference import as_refs
from loraswap.engine.config.engine import EngineConfig  # noqa: E402
from loraswap.engine.engine import Engine  # noqa: E402
from loraswap.engine.request import GenerateRequest
from loraswap.models.families import demo_flux  # noqa: E402


def engine_images(device: str, dtype: str, quantize: str = "none", loras=()) -> list[np.ndarray]:
    engine = Engine(EngineConfig(model="demo-flux", adapters=demo_flux.ADAPTERS, compile=False, warmup=False,
                                 device=device, dtype=dtype, quantize=quantize))
    requests = [GenerateRequest(prompt=prompt(case), seed=1000 + i, loras=list(loras))
                for i, case in enumerate(PROMPTS)]
    with engine.lender.lease_now(as_refs(loras)) as lease:
        return [np.asarray(r.image) for r in engine.generate_batch(requests, lease)]


def split_images(tmp: Path) -> list[np.ndarray]:
    server = ServerProcess(["--model", "demo-flux", "--no-compile", "--ulysses-degree", "2"], tmp / "split.log")
    try:
        server.wait_ready()
        images = []
        for i, case in enumerate(PROMPTS):
            answer = httpx.post(server.url + "/", json={"inputs": prompt(case), "parameters": {"seed": 1000 + i}},
                                headers={"accept": "image/png"}, timeout=600)
            answer.raise_for_status()
            images.append(np.asarray(Image.open(io.BytesIO(answer.content)).convert("RGB")))
        return images
    finally:
        server.stop()


def compare(images: list[np.ndarray], exact: list[np.ndarray] | None) -> dict:
    readings = [shapes.read(image) for image in images]
    result = {"accuracy": accuracy(readings, PROMPTS)}
    if exact is not None:
        diffs = [np.abs(a.astype(np.int16) - b.astype(np.int16)) for a, b in zip(images, exact)]
        result["pixel_difference"] = {"mean": float(np.mean([d.mean() for d in diffs])),
                                      "max": int(max(d.max() for d in diffs)),
                                      "share_changed": float(np.mean([(d > 0).mean() for d in diffs]))}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", choices=("fp8-weight-only", "fp8", "split", "adapters"))
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--tmp", type=Path, default=Path("/tmp/demo-flux-shortcuts"))
    args = parser.parse_args()
    variants = args.variant or ["fp8-weight-only", "split", "adapters"]
    args.tmp.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    exact = engine_images("cpu", "float32")
    results = {"exact": compare(exact, None),
               "seconds_per_image_cpu": (time.perf_counter() - started) / len(PROMPTS),
               "threads": torch.get_num_threads(), "cores": os.cpu_count()}
    for variant in variants:
        if variant == "fp8-weight-only":
            results[variant] = compare(engine_images("cpu", "float32", "fp8-weight-only"), exact)
        elif variant == "fp8":  # the GPU's own exact run is the reference
            reference = engine_images("cuda", "bfloat16")
            results["bf16-gpu"] = compare(reference, None)
            results[variant] = compare(engine_images("cuda", "bfloat16", "fp8"), reference)
        elif variant == "split":
            results[variant] = compare(split_images(args.tmp), exact)
        else:
            for adapter in demo_flux.DEMO_ADAPTERS:
                results[f"with {adapter}"] = compare(engine_images("cpu", "float32", loras=[(adapter, 1.0)]), None)
        print(variant, json.dumps(results.get(variant), indent=1), flush=True)
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
