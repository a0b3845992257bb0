"""The CUDA-only paths on tiny presets:
1. the pinned host tier, GPU tier copies on a side stream and chunked host-to-GPU streaming
   in the swap: images from the GPU tier and the host tier agree;
2. CUDA graphs (`--compile-mode reduce-overhead`): images after swaps equal eager ones with
   the same adapters (the graphs read the swapped weights);
3. `--quantize fp8` (dynamic float8): images with adapters near bf16 ones;
4. a never-seen adapter read straight to the GPU (`adapters/files/device_read.py`) packs the
   bytes the host's packing does, for each kind, layout and dtype, whichever factors stand
   in for the file's bytes; read in many small chunks through two staging buffers by four
   threads at once, the same; a file cut short while it is read is refused, every staging
   buffer given back."""

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from loraswap.adapters.bound import ModelLayers
from loraswap.adapters.cache import CacheConfig
from loraswap.adapters.files import data as file_data
from loraswap.adapters.files import device_read
from loraswap.adapters.files.location import AdapterLocation
from loraswap.adapters.random import make_random_adapter
from loraswap.adapters.store import TargetModel, read_adapter
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.config.scheduling import SchedulerConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest
from loraswap.engine.worker import GpuWorker
from loraswap.errors import AdapterInvalid
from loraswap.models import lora_components

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# adapters swapped request after request: each one, none, a blend, the first again
SWAPS = [[("g0", 1.0)], [("g1", 0.8)], [], [("g2", 0.6), ("g3", 0.5)], [("g0", 1.0)]]


@pytest.fixture(scope="module")
def sdxl_adapters(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sdxl")
    _, components = lora_components("tiny-sdxl")
    for i in range(4):
        sd, md = make_random_adapter(components, 4 * (i + 1), "all" if i % 2 else "attn", text_encoder=i == 1,
                                     alpha=8.0 * (i + 1), seed=i)
        save_file(sd, str(folder / f"g{i}.safetensors"), metadata=md)
    return folder


@pytest.fixture(scope="module")
def flux_adapters(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("flux")
    _, components = lora_components("tiny-flux")
    for i in range(4):
        sd, md = make_random_adapter(components, 8, "all" if i % 2 else "attn", alpha=16.0, seed=10 + i)
        save_file(sd, str(folder / f"g{i}.safetensors"), metadata=md)
    return folder


def test_the_gpu_tier_and_the_host_tier_make_the_same_images(sdxl_adapters, evidence):
    images, pinned = {}, {}
    for name, gpu_bytes in (("gpu-tier", 2**30), ("host-tier", 0)):
        engine = Engine(EngineConfig(model="tiny-sdxl", adapters=sdxl_adapters, device="cuda", dtype="float32",
                                     compile=False, warmup=False,
                                     cache=CacheConfig(host_bytes=2**30, gpu_bytes=gpu_bytes)))
        worker = GpuWorker(engine, SchedulerConfig(max_queue=16))
        worker.start()
        try:
            futures = [worker.submit(GenerateRequest(prompt="x", seed=k, steps=2, loras=[(f"g{k % 4}", 1.0)]))
                       for k in range(8)]
            images[name] = [np.asarray(f.result(timeout=120).image, dtype=float) for f in futures]
            tiers = {row["id"]: row["tier"] for row in engine.adapters.cache.table()}
            engine.adapters.cache.finish_pinning()  # fresh reads are pinned after their request
            pinned[name] = all(engine.adapters.cache.get(f"g{i}").host.packed.is_pinned() for i in range(4))
            evidence("gpu-smoke.json", {"check": "tiers", "cache": name, "tiers": tiers,
                                        "pinned_host_buffers": pinned[name],
                                        "swap_ms": [round(f.result().swap_seconds * 1e3, 2) for f in futures]})
        finally:
            worker.stop()
    worst = max(float(np.abs(a - b).max()) for a, b in zip(images["gpu-tier"], images["host-tier"]))
    evidence("gpu-smoke.json", {"check": "tiers", "max_pixel_difference_gpu_vs_host_tier": worst})
    assert worst <= 1.0
    assert pinned["host-tier"], "the host tier's copies are pinned once their requests are answered"


def swapped_images(model: str, adapters: Path, evidence, **options) -> list[np.ndarray]:
    """The images of `SWAPS`, one request each, in bfloat16."""
    engine = Engine(EngineConfig(model=model, adapters=adapters, device="cuda", dtype="bfloat16", **options))
    out = [np.asarray(engine.generate(GenerateRequest(prompt="x", seed=k, steps=3, loras=loras)).image, dtype=float)
           for k, loras in enumerate(SWAPS)]
    evidence("gpu-smoke.json", {"check": "modes", "model": model, "options": options,
                                "recompiles": engine.recompiles})
    return out


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_cuda_graphs_read_the_swapped_weights(sdxl_adapters, evidence):
    eager = swapped_images("tiny-sdxl", sdxl_adapters, evidence, compile=False)
    graphs = swapped_images("tiny-sdxl", sdxl_adapters, evidence, compile=True, compile_mode="reduce-overhead")
    worst = max(relative(a, b) for a, b in zip(graphs, eager))
    evidence("gpu-smoke.json", {"check": "CUDA graphs against eager, worst relative image difference over the swaps",
                                "worst": worst})
    assert worst < 0.02


def test_float8_images_with_adapters_stay_near_bfloat16(flux_adapters, evidence):
    bf16 = swapped_images("tiny-flux", flux_adapters, evidence, compile=False)
    fp8 = swapped_images("tiny-flux", flux_adapters, evidence, compile=False, quantize="fp8")
    differences = [relative(a, b) for a, b in zip(fp8, bf16)]
    evidence("gpu-smoke.json", {"check": "fp8 against bf16, relative image difference per request",
                                "differences": [round(d, 4) for d in differences]})
    assert max(differences) < 0.05  # measured: 0.013-0.017


COLD_READ_CASES = [  # preset, layout, kind, file dtype, model dtype (None: the file's)
    ("tiny-sd", "kohya", "lora", torch.float16, torch.float16), ("tiny-flux", "kohya", "lora", torch.bfloat16, None),
    ("tiny-flux", "diffusers", "lora", torch.float16, torch.float32), ("tiny-sd", "kohya", "loha", torch.float16, None),
    ("tiny-flux", "kohya", "lokr", torch.float16, torch.float16), ("tiny-sd", "kohya", "dora", torch.float32,
                                                                     torch.float16)]
# bytes from which a tensor stands in for the file's bytes: all factors; some (read at the parse); none
LARGE = (64, 600, 2**20)


@pytest.mark.parametrize("large", LARGE)
@pytest.mark.parametrize("case", COLD_READ_CASES, ids=lambda c: "-".join(str(p).removeprefix("torch.") for p in c))
def test_a_cold_read_to_the_gpu_packs_what_the_host_packs(case, large, tmp_path, monkeypatch, evidence):
    monkeypatch.setattr(file_data, "LARGE", large)
    preset, layout, kind, file_dtype, model_dtype = case
    cls, components = lora_components(preset)
    sd, md = make_random_adapter(components, 4, "all", layout, text_encoder=preset == "tiny-sd", dtype=file_dtype,
                                 kind=kind)
    path = tmp_path / "cold.safetensors"
    save_file(sd, str(path), metadata=md)
    target = TargetModel(preset, cls, ModelLayers(components), model_dtype, None)
    on_host = read_adapter(AdapterLocation("a", path, None), target)
    on_gpu = read_adapter(AdapterLocation("a", path, None), target, device="cuda")
    same = torch.equal(on_host.packed.view(torch.uint8), on_gpu.packed.cpu().view(torch.uint8))
    evidence("gpu-smoke.json", {"check": "cold read", "large": large, "case": [str(p) for p in case],
                                "packed_on": str(on_gpu.packed.device), "same": same})
    assert same
    # on the GPU, but where the parse computes factors from stand-ins (read whole, on the host)
    assert on_gpu.packed.is_cuda == (kind != "lokr" or large != 64)


def test_staged_reads_on_several_threads_pack_the_same_and_a_file_cut_short_gives_every_buffer_back(
        tmp_path, monkeypatch, evidence):
    device = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setattr(device_read, "CHUNK_BYTES", 2**10 + 6)  # odd chunks
    monkeypatch.setattr(device_read, "STAGING_BUFFERS", 2)  # each buffer reused
    monkeypatch.setattr(file_data, "LARGE", 64)
    staging = device_read.StagingBuffers(device)  # made with these sizes, for this test alone
    monkeypatch.setattr(device_read, "staging_buffers", lambda device: staging)
    cls, components = lora_components("tiny-flux")
    sd, md = make_random_adapter(components, 16, "all", "kohya", dtype=torch.bfloat16)
    path = tmp_path / "staged.safetensors"
    save_file(sd, str(path), metadata=md)
    chunks = -(-path.stat().st_size // device_read.CHUNK_BYTES)
    assert chunks > 2 * device_read.STAGING_BUFFERS  # on the copy threads, each buffer reused
    target = TargetModel("tiny-flux", cls, ModelLayers(components), torch.bfloat16, None)
    on_host = read_adapter(AdapterLocation("a", path, None), target).packed.view(torch.uint8)
    with ThreadPoolExecutor(4) as pool:
        reads = list(pool.map(lambda _: read_adapter(AdapterLocation("a", path, None), target, device=device),
                              range(8)))
    same = all(r.packed.is_cuda and torch.equal(r.packed.cpu().view(torch.uint8), on_host) for r in reads)
    evidence("gpu-smoke.json", {"check": "staged reads", "bytes": path.stat().st_size, "chunks": chunks,
                                "reads": 8, "threads": 4, "same": same})
    assert same
    copy_file = staging.copy_file

    def cut_short(fd, offset, nbytes, adapter_id, digest=None):
        os.truncate(path, path.stat().st_size // 2)
        return copy_file(fd, offset, nbytes, adapter_id, digest)

    monkeypatch.setattr(staging, "copy_file", cut_short)
    with pytest.raises(AdapterInvalid):
        read_adapter(AdapterLocation("a", path, None), target, device=device)
    back = staging.free
    evidence("gpu-smoke.json", {"check": "cut short", "staging_buffers_back": back})
    assert back == device_read.STAGING_BUFFERS
