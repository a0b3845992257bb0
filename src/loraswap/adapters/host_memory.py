"""Fresh host buffers for adapters, backed by transparent huge pages where the kernel gives them.

A never-seen adapter is read into one new buffer and packed into another (hundreds of MB
for a FLUX.1 LoRA). Written the first time, a buffer of 4 KiB pages costs a page fault
per page: on a 428 MiB adapter that was most of the cold read (about 120 ms of a 140 ms
copy on a 2-core machine). Asked for huge pages (`madvise(MADV_HUGEPAGE)`, which Linux
honours when transparent huge pages are `always` or `madvise`), it is 512x fewer faults
and the copy costs what copying into warm memory does. Elsewhere (no `madvise`, small
buffers) a buffer is plain `torch.empty`.

The buffer is an anonymous private mapping owned by the tensor made over it: it is
unmapped when the last tensor viewing it is freed.
"""

import mmap

import torch

HUGE_PAGE = 2 * 2**20
_HUGE = hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS")


def host_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of `nbytes`, on huge pages when it is large enough."""
    if not _HUGE or nbytes < HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, still correct
        pass
    return torch.frombuffer(mapping, dtype=torch.uint8)


def host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of `numel` elements of `dtype` (see `host_bytes`)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return host_bytes(numel * itemsize).view(dtype)
