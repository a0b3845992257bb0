"""How fast a never-seen adapter's bytes can reach the GPU from a warm page cache, by each
way there is: the figures the cold path's design needs, on the GPU machine's host.

    PYTHONPATH=src python scripts/cold_copy_probe.py [--architecture flux-dev] [--rank 64] [--rounds 7] [--out F]

A random kohya adapter (all linear layers) is written once under /tmp and read into the
page cache; then each way runs `--rounds` times, interleaved, and the median ms is printed
(and written as JSON to `--out`):

- `loraswap read`: the cold read packed on the host (parse, checks, one copy into a packed
  host buffer), then `to cuda`: that buffer to the GPU (pageable: the driver stages it);
- `loraswap read to cuda`: the server's cold read on a GPU (`adapters/device_read.py`: the
  file's bytes through pinned staging buffers to the GPU, the factors cut out there),
  checked bitwise against the host's packing;
- `pread N threads`: the file's bytes into a fresh huge-page buffer on N threads (the
  host's page-cache copy rate, which bounds the cold read);
- `pread into pinned + to cuda`: the bytes into a reused pinned buffer, then one DMA;
- `mmap to cuda`: the mapped file copied to the GPU straight from the page cache (pageable);
- `mmap register`, `+ to cuda`: the mapped file's pages pinned where they lie
  (`cudaHostRegister`, read-only), then one DMA from the page cache: no host copy at all.
"""

import argparse
import json
import mmap
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraswap.adapters import store
from loraswap.adapters.bound import ModelLayers
from loraswap.adapters.host_memory import host_bytes
from loraswap.adapters.random import make_random_adapter
from loraswap.adapters.source import AdapterLocation
from loraswap.models import lora_components

REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly


def adapter_file(architecture: str, rank: int) -> Path:
    path = Path(f"/tmp/loraswap-cold-{architecture}-r{rank}.safetensors")
    if not path.exists():
        components = lora_components(architecture)[1]
        state_dict, metadata = make_random_adapter(components, rank, "all", "kohya", dtype=torch.bfloat16)
        save_file(state_dict, str(path), metadata=metadata)
    path.read_bytes()  # into the page cache
    return path


def pread_into(path: Path, out: torch.Tensor, threads: int) -> None:
    view, size = memoryview(out.numpy()), out.numel()
    step = -(-size // threads)
    fd = os.open(path, os.O_RDONLY)
    try:
        def piece(start: int) -> None:
            end, done = min(start + step, size), start
            while done < end:
                done += os.preadv(fd, [view[done:end]], done)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(piece, range(0, size, step)))
    finally:
        os.close(fd)


def timed(fn) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3


def ways(path: Path, target) -> dict:
    size = path.stat().st_size
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    cudart = torch.cuda.cudart()
    held: dict = {}

    def loraswap_read():
        held["bound"] = store.read_adapter(AdapterLocation("cold", path, None), target)

    def to_cuda():
        held["bound"].packed.to("cuda")

    def read_to_cuda():
        held["on gpu"] = store.read_adapter(AdapterLocation("cold", path, None), target, device="cuda")

    def mapped() -> torch.Tensor:
        with open(path, "rb") as f:
            held["map"] = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                    prot=mmap.PROT_READ)
        return torch.frombuffer(held["map"], dtype=torch.uint8)

    def register():
        held["mapped"] = mapped()
        error = cudart.cudaHostRegister(held["mapped"].data_ptr(), size, REGISTER_READ_ONLY)
        held["registered"] = int(error) == 0
        if not held["registered"]:
            raise RuntimeError(f"cudaHostRegister failed: {error}")

    def registered_to_cuda():
        held["mapped"].to("cuda", non_blocking=True)
        cudart.cudaHostUnregister(held["mapped"].data_ptr())

    result = {
        "loraswap read": loraswap_read, "to cuda": to_cuda, "loraswap read to cuda": read_to_cuda,
        "pread 1 thread": lambda: pread_into(path, host_bytes(size), 1),
        "pread 8 threads": lambda: pread_into(path, host_bytes(size), 8),
        "pread 16 threads": lambda: pread_into(path, host_bytes(size), 16),
        "pread into pinned + to cuda": lambda: (pread_into(path, pinned, 8), pinned.to("cuda", non_blocking=True)),
        "mmap to cuda": lambda: mapped().to("cuda"),
        "mmap register": register, "+ to cuda": registered_to_cuda,
    }
    return result, held


def same_packing(held: dict) -> bool:
    """Whether the GPU's cold read packed the bytes the host's did."""
    on_gpu = held["on gpu"].packed
    return on_gpu.is_cuda and torch.equal(on_gpu.cpu().view(torch.uint8), held["bound"].packed.view(torch.uint8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--architecture", default="flux-dev")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cls, components = lora_components(args.architecture)
    target = store.TargetModel(args.architecture, cls, ModelLayers(components), torch.bfloat16, None)
    path = adapter_file(args.architecture, args.rank)
    steps, held = ways(path, target)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds + 1):  # the first round warms up and is dropped
        for name, step in steps.items():
            try:
                times[name].append(timed(step))
            except Exception as e:  # noqa: BLE001 - a way this host does not take is reported, not fatal
                times[name].append(float("nan"))
                print(f"{name}: {e}")
    medians = {name: round(statistics.median(t[1:]), 1) for name, t in times.items()}
    size_mib = path.stat().st_size / 2**20
    same = same_packing(held)
    print(f"{path.name}: {size_mib:.0f} MiB, median of {args.rounds} rounds, ms; GPU packing = host's: {same}")
    for name, ms in medians.items():
        print(f"  {name:30s} {ms:8.1f}")
    if args.out:
        args.out.write_text(json.dumps({"file_mib": size_mib, "medians_ms": medians, "gpu_packing_equals_host": same,
                                        "rounds": args.rounds, "device": torch.cuda.get_device_name(),
                                        "cpus": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
