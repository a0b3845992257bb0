"""What a serving process sets up once, whatever it serves: the CUDA allocator's settings
(a memory cap, expandable segments, pinning by registering pages), and the loaded objects
taken out of the garbage collector's full collections once the process has started.

Called by the engine's start-up (`startup.bring_up`), the server (`server.backend`), a Ray
replica (`cluster.replica`) and each rank process (`parallel.processes`).
"""

import gc
import logging
import os

import torch

logger = logging.getLogger(__name__)


def release_memory(device: torch.device) -> None:
    """Give back what dropped modules held before a second load takes their place."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def cap_gpu_memory(device: torch.device, gigabytes: float) -> None:
    """`--max-gpu-memory-gb`: hold this process to that much of the GPU (a 24 GB card on a
    larger one); torch's allocator refuses beyond it as it would on the smaller card.

    Under a cap the allocator also grows expandable segments (unless PYTORCH_ALLOC_CONF or
    PYTORCH_CUDA_ALLOC_CONF already say): fixed segments leave memory reserved but unused
    at the peak, memory the small card does not have
    (bench/results/runs/2026-12-03-lowmem-flux-h200.md). Set before the first CUDA
    allocation, so every segment is expandable."""
    if use_expandable_segments():
        logger.info("GPU memory in expandable segments (less reserved beyond what is allocated)")
    index = device.index if device.index is not None else torch.cuda.current_device()  # torch wants an index
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gigabytes * 2**30 / total), index)
    logger.info("GPU %d capped at %.1f GiB of %.1f GiB", index, min(gigabytes, total / 2**30), total / 2**30)


def pin_by_registering() -> bool:
    """Have torch pin host memory as malloc'd pages registered with the driver on several
    threads (`cudaHostRegister`), rather than by `cudaHostAlloc`, unless its settings name
    it already (the operator's choice stands); whether it was switched.

    The adapter cache pins each new adapter's host copy on a background thread. A
    `cudaHostAlloc` of a FLUX.1 rank-64 LoRA's 428 MiB holds the driver, and the GPU worker's
    swap, launching kernels meanwhile, waited it out: 187-206 ms for a cold request's swap
    against 15 ms cached; registered, 15-26 ms (`git show e3c5fe4:scripts/pinning_stall_probe.py`,
    bench/results/runs/2026-12-06-cold-path-h100.md)."""
    if "pinned_use_cuda_host_register" in _operators_settings():
        return False
    threads = 1 << (min(8, os.cpu_count() or 1).bit_length() - 1)  # torch takes a power of two
    setting = f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}"
    try:
        _set_allocator_settings(setting)
    except (RuntimeError, ValueError) as e:  # a torch that refuses it: pinning still works, by cudaHostAlloc
        logger.warning("could not set %s (%s): pinning a new adapter may stall a swap", setting, e)
        return False
    return True


def use_expandable_segments() -> bool:
    """Switch torch's CUDA allocator to expandable segments unless its settings name them
    already (the operator's choice stands); whether it was switched."""
    if "expandable_segments" in _operators_settings():
        return False
    _set_allocator_settings("expandable_segments:True")
    return True


def _operators_settings() -> str:
    """The allocator settings the environment gives torch (under either of its names)."""
    return ",".join(filter(None, (os.environ.get(name) for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"))))


def _set_allocator_settings(setting: str) -> None:
    """Give torch's allocator `setting` after the environment's own: torch's parser resets
    some keys a string leaves out (`max_split_size_mb`, say), so each call restates the
    operator's."""
    torch._C._accelerator_setAllocatorSettings(",".join(filter(None, (_operators_settings(), setting))))


def freeze_loaded_objects() -> None:
    """Take every object alive now (the models' modules and parameters, compiled code, the
    libraries) out of the garbage collector's full collections, which otherwise walk them
    all: on a FLUX.1 server a full collection, set off by the objects cold adapters' reads
    make, took up to 380 ms in the middle of a request's swap
    (bench/results/runs/2026-12-06-cold-path-h100.md). Reference counting still frees them;
    `unfreeze_objects` hands them back. Called once a process has started what it serves."""
    gc.collect()
    gc.freeze()


def unfreeze_objects() -> None:
    """Frozen objects collectable again: a server stopped inside a process that goes on."""
    gc.unfreeze()
