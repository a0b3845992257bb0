"""A file's digests taken from the pieces its read brings in (`adapters/files/hashes.py:ReadDigest`):
exactly the file's SHA-256 whatever order the pieces come in, whatever no reader brought in
(read back from the file once the read is done), and however far the read runs ahead of the
hashing, with never more than the digest's cap of pieces kept waiting."""

import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import save_file
from support.file_hashes import hash_file

from loraswap.adapters.files.formats import open_checked
from loraswap.adapters.files.hashes import ReadDigest

PIECE = 4096  # bytes of each tensor of the files below


@pytest.fixture
def read_back(monkeypatch):
    """The sizes of the reads the digest makes of the file (it reads only what it was not handed)."""
    sizes, real = [], os.pread

    def counted(fd, n, offset):
        sizes.append(n)
        return real(fd, n, offset)

    monkeypatch.setattr(os, "pread", counted)
    return sizes


@pytest.fixture
def written(tmp_path, read_back):
    """(path, the file open and checked, [(offset, piece)] of each tensor's bytes in the file's
    order); `read_back` counts the reads of it from then on."""
    opened = []

    def write(tensors: int):
        path = tmp_path / "a.safetensors"
        generator = torch.Generator().manual_seed(tensors)
        save_file({f"t{i:03d}": torch.randn(PIECE // 4, generator=generator) for i in range(tensors)}, str(path))
        file = open_checked(path, "a", 2**30)
        opened.append(file)
        data = path.read_bytes()[file.data_offset:]
        spans = sorted(info["data_offsets"] for info in file.header.values())
        read_back.clear()
        return path, file, [(start, torch.frombuffer(bytearray(data[start:end]), dtype=torch.uint8))
                            for start, end in spans]

    yield write
    for file in opened:
        file.close()


def test_pieces_handed_in_out_of_order_are_hashed_in_the_files_order(written, read_back):
    path, file, pieces = written(32)
    shuffled = pieces + pieces[:3]  # a piece handed in twice is hashed once
    random.Random(0).shuffle(shuffled)
    digest = ReadDigest()
    digest.begin(file)
    with ThreadPoolExecutor(4) as readers:  # as the read's threads hand them in
        list(readers.map(lambda p: digest.add(*p), shuffled))
    assert digest.finish() == hash_file(path)
    assert read_back == [], "every byte handed in: none read again"
    assert digest.held == 0, "nothing kept once hashed"


def test_a_gap_at_the_start_is_read_back_once_the_read_is_done(written, read_back):
    """A tensor the parse never reads: the bytes after it wait, kept, until `finish` reads it
    from the file."""
    path, file, pieces = written(8)
    digest = ReadDigest()
    digest.begin(file)
    for offset, piece in pieces[1:]:
        digest.add(offset, piece)
    assert digest.held == 7 * PIECE, "kept: nothing can be hashed before the gap"
    assert digest.finish() == hash_file(path)
    assert read_back == [PIECE], "the gap alone read back"


def test_a_digest_keeps_no_more_than_its_cap_and_reads_back_what_it_let_go(written, read_back):
    """The read runs ahead of the hashing (here: a gap at the start holds the hashing back
    until the read is done): past the cap a piece is let go, never copied, and read back."""
    path, file, pieces = written(16)
    cap = 3 * PIECE + 100
    digest = ReadDigest(max_held=cap)
    digest.begin(file)
    held = []
    for offset, piece in pieces[1:]:
        digest.add(offset, piece, copy=True)
        piece.zero_()  # the reader reuses its buffer at once: a piece kept was copied
        held.append(digest.held)
    assert held == [PIECE, 2 * PIECE] + [3 * PIECE] * 13, "never past the cap"
    assert digest.finish() == hash_file(path)
    assert sum(read_back) == 13 * PIECE, "the gap and the 12 pieces let go, read back"
    assert digest.held == 0


@pytest.mark.parametrize("in_place", [True, False])
def test_a_read_with_a_small_cap_still_gives_the_files_digest(adapter_factory, in_place):
    """The store's read (in place, fp16 factors converted to the model's fp32; or whole, its
    file closed before `finish`) with pieces let go as it runs ahead of the hashing."""
    from loraswap.adapters import store as store_module
    from loraswap.adapters.bound import ModelLayers
    from loraswap.adapters.files.formats import read_safetensors
    from loraswap.adapters.files.location import AdapterLocation
    from loraswap.models import lora_components

    path = adapter_factory("capped", "tiny-sd", rank=8, targets="all", seed=62)
    digest = ReadDigest(max_held=16 * 2**10)
    if in_place:
        cls, components = lora_components("tiny-sd")
        target = store_module.TargetModel("tiny-sd", cls, ModelLayers(components), torch.float32)
        store_module.read_adapter(AdapterLocation("capped", path, None), target, digest=digest)
    else:
        read_safetensors(path, "capped", 2**30, digest)
        digest.finish()
    assert path.stat().st_size > 4 * digest.max_held
    assert digest.result == hash_file(path) and digest.held == 0


def test_a_cancelled_read_hashes_nothing_and_keeps_nothing(written):
    _, file, pieces = written(4)
    digest = ReadDigest()
    digest.begin(file)
    for offset, piece in pieces[1:]:
        digest.add(offset, piece)
    digest.cancel()
    assert digest.finish() is None and digest.held == 0
    digest.add(*pieces[0])
    assert digest.held == 0, "a read ended takes no more pieces"
