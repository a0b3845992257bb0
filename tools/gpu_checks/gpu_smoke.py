"""A quick check of the CUDA-only paths on tiny presets. Run on a GPU machine:
1. the pinned host tier, GPU tier copies on a side stream and chunked host-to-GPU
   streaming in the swap: images from the GPU tier and the host tier agree;
2. CUDA graphs (`--compile-mode reduce-overhead`): images after swaps equal eager ones
   with the same adapters (the graphs read the swapped weights);
3. `--quantize fp8` (dynamic float8): images with adapters against bf16 ones;
4. a never-seen adapter read straight to the GPU (`adapters/files/device_read.py`) packs the
   bytes the host's packing does, for each kind, layout and dtype, whichever factors stand
   in for the file's bytes; read in many small chunks through two staging buffers by four
   threads at once, the same; a file cut short while it is read is refused, every staging
   buffer given back.

    PYTHONPATH=src python tools/gpu_checks/gpu_smoke.py ADAPTER_DIR
"""

import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from loraswap.adapters.bound import ModelLayers
from loraswap.adapters.cache import CacheConfig
from loraswap.adapters.files import data as file_data
from loraswap.adapters.files import device_read
from loraswap.adapters.random import make_random_adapter
from loraswap.adapters.sources.local import AdapterLocation
from loraswap.adapters.store import TargetModel, read_adapter
from loraswap.engine.config import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest
from loraswap.engine.worker import GpuWorker, SchedulerConfig
from loraswap.errors import AdapterInvalid
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
        tiers = {row["id"]: row["tier"] for row in engine.adapters.cache.table()}
        engine.adapters.cache.finish_pinning()  # fresh reads are pinned after their request
        pinned = all(e.host.packed.is_pinned() for e in (engine.adapters.cache.get(f"g{i}") for i in range(4)))
        print(name, "tiers", tiers, "pinned host buffers", pinned, "swap ms",
              [round(f.result().swap_seconds * 1e3, 2) for f in futures], flush=True)
        worker.stop()
    worst = max(float(np.abs(a - b).max()) for a, b in zip(images["gpu-tier"], images["host-tier"]))
    print("max pixel difference gpu-tier vs host-tier:", worst, flush=True)
    assert worst <= 1.0 and pinned
    check_modes(folder)
    check_cold_read(folder)
    check_staged_reads(folder)


def check_modes(folder: Path) -> None:
    def images(model: str, **options) -> list[np.ndarray]:
        engine = Engine(EngineConfig(model=model, adapters=folder if model == "tiny-sdxl" else flux, device="cuda",
                                     dtype="bfloat16", **options))
        loras = [[("g0", 1.0)], [("g1", 0.8)], [], [("g2", 0.6), ("g3", 0.5)], [("g0", 1.0)]]
        out = [np.asarray(engine.generate(GenerateRequest(prompt="x", seed=k, steps=3, loras=lo)).image, dtype=float)
               for k, lo in enumerate(loras)]
        print(model, options, "recompiles", engine.recompiles, flush=True)
        return out

    def rel(a, b) -> float:
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    eager = images("tiny-sdxl", compile=False)
    graphs = images("tiny-sdxl", compile=True, compile_mode="reduce-overhead")
    worst = max(rel(a, b) for a, b in zip(graphs, eager))
    print("CUDA graphs vs eager, worst relative image difference over 5 swaps:", worst, flush=True)
    assert worst < 0.02

    flux = folder / "flux"
    flux.mkdir(exist_ok=True)
    _, components = lora_components("tiny-flux")
    for i in range(4):
        sd, md = make_random_adapter(components, 8, "all" if i % 2 else "attn", alpha=16.0, seed=10 + i)
        save_file(sd, str(flux / f"g{i}.safetensors"), metadata=md)
    bf16 = images("tiny-flux", compile=False)
    fp8 = images("tiny-flux", compile=False, quantize="fp8")
    print("fp8 vs bf16 relative image difference per request:", [round(rel(a, b), 4) for a, b in zip(fp8, bf16)],
          flush=True)


COLD_READ_CASES = [  # preset, layout, kind, file dtype, model dtype (None: the file's)
    ("tiny-sd", "kohya", "lora", torch.float16, torch.float16), ("tiny-flux", "kohya", "lora", torch.bfloat16, None),
    ("tiny-flux", "diffusers", "lora", torch.float16, torch.float32), ("tiny-sd", "kohya", "loha", torch.float16, None),
    ("tiny-flux", "kohya", "lokr", torch.float16, torch.float16), ("tiny-sd", "kohya", "dora", torch.float32,
                                                                     torch.float16)]


def check_cold_read(folder: Path) -> None:
    for large in (64, 600, 2**20):  # all factors stand in; some read at the parse; all read at the parse
        file_data.LARGE = large
        for i, (preset, layout, kind, file_dtype, model_dtype) in enumerate(COLD_READ_CASES):
            cls, components = lora_components(preset)
            sd, md = make_random_adapter(components, 4, "all", layout, text_encoder=preset == "tiny-sd",
                                         dtype=file_dtype, kind=kind)
            path = folder / f"cold{i}.safetensors"
            save_file(sd, str(path), metadata=md)
            target = TargetModel(preset, cls, ModelLayers(components), model_dtype, None)
            on_host = read_adapter(AdapterLocation("a", path, None), target)
            on_gpu = read_adapter(AdapterLocation("a", path, None), target, device="cuda")
            same = torch.equal(on_host.packed.view(torch.uint8), on_gpu.packed.cpu().view(torch.uint8))
            print("cold read", large, preset, layout, kind, "on", on_gpu.packed.device, "same:", same, flush=True)
            # on the GPU, but where the parse computes factors from stand-ins (read whole, on the host)
            assert same and on_gpu.packed.is_cuda == (kind != "lokr" or large != 64)


def check_staged_reads(folder: Path) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    device_read.CHUNK_BYTES, device_read.STAGING_BUFFERS = 2**10 + 6, 2  # odd chunks, each buffer reused
    device_read._staging[device] = staging = device_read.StagingBuffers(device)
    file_data.LARGE = 64
    cls, components = lora_components("tiny-flux")
    sd, md = make_random_adapter(components, 16, "all", "kohya", dtype=torch.bfloat16)
    path = folder / "staged.safetensors"
    save_file(sd, str(path), metadata=md)
    target = TargetModel("tiny-flux", cls, ModelLayers(components), torch.bfloat16, None)
    assert chunk_count(path) > 2 * device_read.STAGING_BUFFERS  # on the copy threads, each buffer reused
    on_host = read_adapter(AdapterLocation("a", path, None), target).packed.view(torch.uint8)
    with ThreadPoolExecutor(4) as pool:
        reads = list(pool.map(lambda _: read_adapter(AdapterLocation("a", path, None), target, device=device),
                              range(8)))
    same = all(r.packed.is_cuda and torch.equal(r.packed.cpu().view(torch.uint8), on_host) for r in reads)
    print(f"staged reads: {path.stat().st_size} B in {chunk_count(path)} chunks, 8 reads on 4 threads, "
          f"same: {same}", flush=True)
    assert same
    copy_file = staging.copy_file

    def cut_short(fd, offset, nbytes, adapter_id):
        os.truncate(path, path.stat().st_size // 2)
        return copy_file(fd, offset, nbytes, adapter_id)

    staging.copy_file = cut_short
    try:
        read_adapter(AdapterLocation("a", path, None), target, device=device)
        raise AssertionError("a file cut short while read was served")
    except AdapterInvalid as e:
        print("cut short:", e, "| staging buffers back:", staging._free.qsize(), flush=True)
    assert staging._free.qsize() == device_read.STAGING_BUFFERS


def chunk_count(path: Path) -> int:
    return -(-path.stat().st_size // device_read.CHUNK_BYTES)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))
