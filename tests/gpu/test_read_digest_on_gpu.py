"""A never-seen adapter read to the GPU is hashed from the bytes its read brings in through the
staging buffers (`files/hashes.py:ReadDigest`): the same digest as the file's own, several
reads at once and each buffer reused, with room for all of its chunks or for a few; a read
that fails hashes nothing and leaves no reader waiting."""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import save_file
from support.file_hashes import hash_file

from loraswap.adapters.bound import ModelLayers
from loraswap.adapters.files import data as file_data
from loraswap.adapters.files import device_read
from loraswap.adapters.files.hashes import MAX_HELD_BYTES, ReadDigest
from loraswap.adapters.files.location import AdapterLocation
from loraswap.adapters.random import make_random_adapter
from loraswap.adapters.store import TargetModel, read_adapter
from loraswap.errors import AdapterInvalid
from loraswap.models import lora_components

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_cold_read_to_the_gpu_is_hashed_from_its_own_bytes(tmp_path, monkeypatch, evidence):
    device = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setattr(device_read, "CHUNK_BYTES", 2**12 + 8)  # many chunks, each buffer reused
    monkeypatch.setattr(device_read, "STAGING_BUFFERS", 2)
    monkeypatch.setattr(file_data, "LARGE", 64)
    staging = device_read.StagingBuffers(device)
    monkeypatch.setattr(device_read, "staging_buffers", lambda device: staging)
    cls, components = lora_components("tiny-flux")
    sd, md = make_random_adapter(components, 16, "all", "kohya", dtype=torch.bfloat16)
    path = tmp_path / "hashed.safetensors"
    save_file(sd, str(path), metadata=md)
    target = TargetModel("tiny-flux", cls, ModelLayers(components), torch.bfloat16, None)

    def read(i: int) -> tuple:  # every other one with room for 3 chunks: the rest let go, never copied, read back
        digest = ReadDigest(MAX_HELD_BYTES if i % 2 else 3 * device_read.CHUNK_BYTES)
        bound = read_adapter(AdapterLocation("a", path, None), target, device=device, digest=digest)
        return bound.packed.is_cuda, digest.result

    with ThreadPoolExecutor(4) as pool:
        reads = list(pool.map(read, range(8)))
    expected = hash_file(path)
    evidence("read-digest.json", {"check": "cold read hashed on the GPU path", "bytes": path.stat().st_size,
                                  "reads": 8, "same": all(r == (True, expected) for r in reads)})
    assert reads == [(True, expected)] * 8
    copy_file = staging.copy_file

    def cut_short(fd, offset, nbytes, adapter_id, digest=None):
        os.truncate(path, path.stat().st_size // 2)
        return copy_file(fd, offset, nbytes, adapter_id, digest)

    monkeypatch.setattr(staging, "copy_file", cut_short)
    digest = ReadDigest()
    with pytest.raises(AdapterInvalid):
        read_adapter(AdapterLocation("a", path, None), target, device=device, digest=digest)
    assert digest.result is None and staging.free == device_read.STAGING_BUFFERS
