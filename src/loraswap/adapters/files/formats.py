"""Reading adapter files: safe safetensors parsing.

A file is read only after its header has been checked (length, JSON, dtypes, data
offsets inside the file), so a pickle renamed `.safetensors`, a truncated download or
a header claiming gigabytes is refused before anything is allocated. `parse` turns the
tensors into changes of the model's parameters.

The header is bounded before it is parsed, by `HeaderBounds` for the largest file served
(`--max-adapter-mb`), whatever the file came from (the folder, the Hub, a URL, Civitai, a
bucket: downloads check it while streaming, `streamed_header`, and every read of the file
again, `open_checked`). Parsed unbounded, a valid header of 95 MiB of empty tensor entries
costs gigabytes of Python objects and a minute.
- Bytes: 1/128 of the largest file, at least 4 MiB, at most 32 MiB (16 MiB for the default
  2 GiB). A tensor's entry is 60-200 bytes (name, dtype, shape, offsets); the largest real
  layouts in tests/fixtures/key_layouts take about 0.3 MB (2,024 tensors: a OneTrainer DoRA
  of FLUX.1 with CLIP-L and T5), and trainers' metadata (kohya's tag counts, a thumbnail) a
  few hundred KB more. A header past its bound is refused from its 8-byte length alone.
- Entries: at most 32,768 tensors (fewer for a limit under 2 MiB: an entry takes at least
  64 bytes of the file). The real layouts there have up to 2,024 (Wan 2.2's all-linear kohya
  file: 1,200). Every linear layer of FLUX.1 with CLIP-L and T5 (about 740 modules) as LoHa
  with DoRA (6 tensors a module) is about 4,500; of Qwen-Image with its text encoder (about
  1,040 modules) the same, about 6,300: the cap is 5x the largest of them. A header at the
  cap is read (parsed and checked) in about 0.5 s of one core and 15 MiB.
  The count is bounded before the parse by counting the header's `,` and `:` bytes (C speed;
  every JSON item but a container's first follows one): an entry takes 7-11 of them, so more
  than 16 an entry at the cap is refused unparsed (metadata text counts too, hence the margin).
  After the parse, the entries themselves are counted.
"""

import functools
import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG

import torch

from loraswap.adapters.files.host_memory import byte_ranges, host_bytes, run_all
from loraswap.errors import AdapterInvalid

ALLOWED_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
# an alpha may also be one integer: diffusers' `convert_state_dict_to_kohya` writes alpha = rank as int64
ALPHA_DTYPES = {"I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8}
MAX_HEADER_BYTES = 32 * 2**20  # the most header bytes read, whatever --max-adapter-mb says
MIN_HEADER_BYTES = 4 * 2**20
HEADER_SHARE = 128  # a header may take 1/128 of the largest file
MAX_HEADER_ENTRIES = 32_768
MIN_BYTES_PER_ENTRY = 64  # of the file, for an entry's name, dtype, shape and offsets
SEPARATORS_PER_ENTRY = 16  # `,` and `:` bytes counted against the entry cap: an entry has 7-11
DTYPE_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_FIX_FILE = "Re-export it as a LoRA in safetensors format (diffusers save_lora_weights or kohya sd-scripts)"


@dataclass(frozen=True)
class HeaderBounds:
    """The most a safetensors header may hold, checked before it is parsed (see the module's
    docstring for the figures behind them)."""

    bytes: int
    entries: int

    @classmethod
    def for_files_up_to(cls, max_bytes: int) -> "HeaderBounds":
        return cls(bytes=min(MAX_HEADER_BYTES, max(MIN_HEADER_BYTES, max_bytes // HEADER_SHARE)),
                   entries=min(MAX_HEADER_ENTRIES, max(1, max_bytes // MIN_BYTES_PER_ENTRY)))


_FIX_HEADER = "Re-save the adapter without its bulky metadata, or raise --max-adapter-mb if it is a real adapter"


def check_header_length(header_len: int, adapter_id: str, max_bytes: int) -> None:
    """Refuse a header longer than the bound for files of up to `max_bytes`, before it is read."""
    bound = HeaderBounds.for_files_up_to(max_bytes).bytes
    if header_len > bound:
        raise AdapterInvalid(adapter_id, f"its safetensors header is {header_len / 2**20:.1f} MiB, over the "
                             f"{bound / 2**20:.0f} MiB read for files of up to {max_bytes / 2**20:.0f} MiB (a "
                             "LoRA's header takes well under 1 MiB)", _FIX_HEADER)


def parse_header(raw: bytes, adapter_id: str, max_bytes: int) -> dict:
    """The JSON header `raw` (its length already checked) parsed: a JSON object with no key given
    twice, and no more entries than the bound, counted before the parse and after it."""
    cap = HeaderBounds.for_files_up_to(max_bytes).entries
    if raw.count(b",") + raw.count(b":") > SEPARATORS_PER_ENTRY * cap:  # an upper bound on its JSON items
        raise AdapterInvalid(adapter_id, f"its safetensors header holds more JSON than {cap:,} tensor entries "
                             "would (the largest real LoRAs have a few thousand)", _FIX_HEADER)
    try:
        header = _HEADER_JSON.decode(raw.decode("utf-8"))
    except _DuplicateKey as e:
        raise AdapterInvalid(adapter_id, f"the safetensors header names '{e.key}' twice", _FIX_FILE) from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # RecursionError: nested past the parser
        raise _NotSafetensors(adapter_id, "the safetensors header is not valid JSON", _FIX_FILE) from None
    if not isinstance(header, dict):
        raise _NotSafetensors(adapter_id, "the safetensors header is not a JSON object", _FIX_FILE)
    entries = len(header) - ("__metadata__" in header)
    if entries > cap:
        raise AdapterInvalid(adapter_id, f"its safetensors header lists {entries:,} tensors, over the {cap:,} read "
                             "for an adapter (the largest real LoRAs have a few thousand)", _FIX_HEADER)
    return header


class _NotSafetensors(AdapterInvalid):
    """A header that is no JSON object: what a download reports as no safetensors file at all."""


@dataclass(frozen=True)
class CheckedFile:
    """A safetensors file open for reading, its header checked: every tensor entry inside
    the data section, the entries laid end to end. The data is read from `fd` (this inode,
    whatever is renamed over its path meanwhile)."""

    fd: int
    header: dict  # name -> {"dtype", "shape", "data_offsets"}
    metadata: dict[str, str]
    data_offset: int  # of the data section in the file
    data_len: int
    head: bytes = b""  # the file's bytes before the data section (the length and the header), as read

    def close(self) -> None:
        os.close(self.fd)


def open_checked(path: Path, adapter_id: str, max_bytes: int) -> CheckedFile:
    """`path` opened and its header checked; the caller closes it."""
    try:  # O_NONBLOCK: a FIFO would block the open; it is refused below
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise AdapterInvalid(adapter_id, f"the file cannot be opened ({e.strerror})", _FIX_FILE) from None
    try:
        return _checked(fd, adapter_id, max_bytes)
    except BaseException:
        os.close(fd)
        raise


def _checked(fd: int, adapter_id: str, max_bytes: int) -> CheckedFile:
    stat = os.fstat(fd)
    if not S_ISREG(stat.st_mode):  # a FIFO or device would block or never end
        raise AdapterInvalid(adapter_id, "it is not a regular file", _FIX_FILE)
    size = stat.st_size
    if size > max_bytes:
        raise AdapterInvalid(adapter_id, f"the file is {size / 2**20:.1f} MiB, over the {max_bytes / 2**20:.0f} MiB "
                             "limit", "Use a smaller adapter or raise --max-adapter-mb")
    header, head = _read_header(fd, adapter_id, size, max_bytes)
    header_len = len(head) - 8
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise AdapterInvalid(adapter_id, "the safetensors metadata is not a map of strings to strings", _FIX_FILE)
    data_len = size - 8 - header_len
    _check_entries(adapter_id, header, data_len)
    return CheckedFile(fd, header, {str(k): str(v) for k, v in metadata.items()}, 8 + header_len, data_len, head)


def read_safetensors(path: Path, adapter_id: str, max_bytes: int,
                     digest=None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a safetensors file, after checking its header is sane. The data
    is read in one buffer with `preadv` (one copy from the page cache; a large file in pieces
    on several threads) that the tensors view. Not a memory map: a file cut short while mapped
    would kill the process (SIGBUS), where a short read is an error. `digest` (a
    `hashes.ReadDigest`): handed each piece as it is read."""
    file = open_checked(path, adapter_id, max_bytes)
    try:
        data = host_bytes(file.data_len)
        if digest is not None:
            digest.begin(file)

        def read(start: int, end: int) -> None:
            read_range(file.fd, data[start:end], file.data_offset + start, adapter_id)
            if digest is not None:
                digest.add(start, data[start:end])

        run_all([functools.partial(read, start, end) for start, end in byte_ranges(file.data_len)])
    finally:
        file.close()
    return {name: view_tensor(data, info) for name, info in file.header.items()}, file.metadata


def read_range(fd: int, out: torch.Tensor, offset: int, adapter_id: str) -> None:
    """The file's bytes from `offset` into `out` (a contiguous CPU tensor, filled whole)."""
    view, done = memoryview(out.reshape(-1).view(torch.uint8).numpy()), 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if not n:
            raise AdapterInvalid(adapter_id, "the file ended while it was read (truncated as it was read?)",
                                 "Download the adapter again")
        done += n


def view_tensor(data: torch.Tensor, info: dict) -> torch.Tensor:
    """One entry of the header as a view of the data (a copy where its offset is not a
    multiple of its element size, which a view of another dtype cannot start at)."""
    start, end = info["data_offsets"]
    raw = data[start:end]
    if start % DTYPE_BYTES[info["dtype"]]:
        raw = raw.clone()
    return raw.view((ALLOWED_DTYPES | ALPHA_DTYPES)[info["dtype"]]).reshape(info["shape"])


def streamed_header(read: Callable[[int], bytes], limit: int, adapter_id: str, max_bytes: int) -> bytes | None:
    """The 8-byte length and the JSON header at the start of a stream (`read(n)`: the next n
    bytes, fewer only where it ends; `limit`: the most the stream may hold), or None when it
    is not safetensors; a header over the bounds for files of up to `max_bytes` is refused.
    For a download: refused before the rest is read. A pickle, a zip or a web page read as a
    length is absurd, and a header starts with "{" (the format's rule), so a crafted length
    is refused before its N bytes are read."""
    prefix = read(8)
    n = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
    if not 0 < n <= limit - 8:
        return None
    header = read(1)
    if header != b"{":
        return None
    check_header_length(n, adapter_id, max_bytes)
    header += read(n - 1)
    if len(header) < n:
        return None
    try:
        parse_header(header, adapter_id, max_bytes)
    except _NotSafetensors:
        return None
    return prefix + header


def _read_header(fd: int, adapter_id: str, size: int, max_bytes: int) -> tuple[dict, bytes]:
    """The JSON header (a dict) and the bytes it was read from (its length and the JSON),
    refusing anything that is not safetensors or is over the header's bounds."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise AdapterInvalid(adapter_id, "the file is too short to be safetensors", _FIX_FILE)
    (header_len,) = struct.unpack("<Q", head)
    if header_len > size - 8:
        raise AdapterInvalid(adapter_id, f"the header claims {header_len} bytes in a {size}-byte file: not "
                             "safetensors (a pickle file renamed?) or truncated", _FIX_FILE)
    check_header_length(header_len, adapter_id, max_bytes)
    raw = os.pread(fd, header_len, 8)
    return parse_header(raw, adapter_id, max_bytes), head + raw


def _check_entries(adapter_id: str, header: dict, data_len: int) -> None:
    """Every tensor entry well formed, of a float dtype, and inside the file's data."""
    for name, info in header.items():
        if not _well_formed(info):
            raise AdapterInvalid(adapter_id, f"tensor '{name}' has a malformed header entry (dtype, shape and "
                                 "data_offsets must be a string, a list of sizes and two offsets)", _FIX_FILE)
        if not _allowed_dtype(name, info):
            raise AdapterInvalid(adapter_id, f"tensor '{name}' has dtype {info['dtype']}; LoRA weights must be "
                                 "F16, BF16 or F32", "Convert the adapter to a floating-point dtype")
        start, end = info["data_offsets"]
        expected = math.prod(info["shape"]) * DTYPE_BYTES.get(info["dtype"], 0)
        if not 0 <= start <= end <= data_len or end - start != expected:
            raise AdapterInvalid(adapter_id, f"tensor '{name}' lies outside the file (truncated download?)",
                                 "Download the adapter again")
    _check_tiling(adapter_id, header, data_len)


def _allowed_dtype(name: str, info: dict) -> bool:
    """A float tensor, or an integer alpha (one value)."""
    if info["dtype"] in ALLOWED_DTYPES:
        return True
    return name.endswith(".alpha") and info["dtype"] in ALPHA_DTYPES and math.prod(info["shape"]) == 1


def _check_tiling(adapter_id: str, header: dict, data_len: int) -> None:
    """The tensors fill the data section end to end, as the format requires (and safetensors'
    own reader checks): no two share bytes, no bytes belong to none."""
    end = 0
    for name, info in sorted(header.items(), key=lambda item: tuple(item[1]["data_offsets"])):
        start, stop = info["data_offsets"]
        if start != end:
            raise AdapterInvalid(adapter_id, f"tensor '{name}' {'overlaps another' if start < end else 'leaves a gap'}"
                                 " in the file's data (the format lays tensors end to end)", _FIX_FILE)
        end = stop
    if end != data_len:
        raise AdapterInvalid(adapter_id, f"the file has {data_len - end} bytes after its last tensor "
                             "(the format lays tensors end to end)", _FIX_FILE)


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _refuse_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """json object hook: a key given twice is refused (parsers disagree on which one wins)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


# one decoder for all reads: json.loads(..., object_pairs_hook=) builds a scanner per call that outlives it
_HEADER_JSON = json.JSONDecoder(object_pairs_hook=_refuse_duplicates)


def _well_formed(info) -> bool:
    def sizes(value, n=None):
        return isinstance(value, list) and (n is None or len(value) == n) and all(
            type(v) is int and v >= 0 for v in value)

    return isinstance(info, dict) and {"dtype", "shape", "data_offsets"} <= info.keys() and \
        isinstance(info["dtype"], str) and sizes(info["shape"]) and sizes(info["data_offsets"], 2)
