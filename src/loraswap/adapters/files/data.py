"""A safetensors file read in place: parsed from its header, its factors read from the file
straight into the packed buffer the cache keeps.

Read whole, a new adapter costs two copies of its bytes: the file into one buffer, then
each factor into its place in the packed buffer. Read in place, the large tensors are
stand-ins (meta tensors, views of one meta buffer at the data's own offsets) and only the
small ones (alphas, DoRA magnitudes) are read at once; the parse and the checks run on
shapes, and the packing reads each factor's bytes from the file into its place (`read_into`,
converting the dtype where the model's differs): one copy.

A factor the parse computed rather than cut out of a tensor (a LoKr cut into rows, say) is
no view of the file: packing it raises `NotInFile`, and the caller reads the file whole.
"""

import torch

from loraswap.adapters.files.formats import (
    ALLOWED_DTYPES,
    DTYPE_BYTES,
    CheckedFile,
    open_checked,
    read_range,
    view_tensor,
)

LARGE = 64 * 2**10  # bytes: a tensor this large stands in until packed; smaller ones are read at once


class NotInFile(Exception):
    """A factor of an adapter read in place is no contiguous view of its file's data."""


class FileData:
    """A checked file whose large tensors stand in as views of a meta buffer per dtype, the
    data section's size: element i of the `torch.bfloat16` one is the file's bfloat16 at data
    offset 2 i (views of a view keep their root in `_base`; a dtype view would not)."""

    def __init__(self, file: CheckedFile, adapter_id: str, digest=None):
        self.file, self.adapter_id = file, adapter_id
        self.digest = digest  # a `hashes.ReadDigest` handed what is read of the file, or None
        self._bases: dict[torch.dtype, torch.Tensor] = {}

    def close(self) -> None:
        self.file.close()

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.is_meta and tensor._base is not None and tensor._base is self._bases.get(tensor.dtype)

    def _base(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._bases:
            itemsize = torch.empty(0, dtype=dtype).element_size()
            self._bases[dtype] = torch.empty(self.file.data_len // itemsize, dtype=dtype, device="meta")
        return self._bases[dtype]

    def read_into(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        """The bytes `tensor` stands for into `out` (CPU, as many elements), in `out`'s dtype."""
        if not tensor.is_contiguous():
            raise NotInFile("a strided view of the file")
        start = tensor.storage_offset() * tensor.element_size()
        if out.dtype == tensor.dtype:
            read_range(self.file.fd, out, self.file.data_offset + start, self.adapter_id)
            self._read(start, out)
            return
        staged = torch.empty(tensor.numel(), dtype=tensor.dtype)
        read_range(self.file.fd, staged, self.file.data_offset + start, self.adapter_id)
        self._read(start, staged)
        out.copy_(staged.reshape(out.shape))

    def _read(self, start: int, data: torch.Tensor) -> None:
        """`data` holds the data section's bytes from `start`, as read (for the file's digest)."""
        if self.digest is not None:
            self.digest.add(start, data)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the header: the large ones as stand-ins, the small ones read."""
        return {name: self._tensor(info) for name, info in self.file.header.items()}

    def _tensor(self, info: dict) -> torch.Tensor:
        start, end = info["data_offsets"]
        itemsize = DTYPE_BYTES[info["dtype"]]
        if end - start >= LARGE and start % itemsize == 0:
            base = self._base(ALLOWED_DTYPES[info["dtype"]])
            return base[start // itemsize: end // itemsize].reshape(info["shape"])
        data = torch.empty(end - start, dtype=torch.uint8)
        read_range(self.file.fd, data, self.file.data_offset + start, self.adapter_id)
        self._read(start, data)
        return view_tensor(data, {**info, "data_offsets": [0, end - start]})


def open_in_place(path, adapter_id: str, max_bytes: int,
                  digest=None) -> tuple[dict[str, torch.Tensor], dict[str, str], FileData]:
    """The file's tensors (large ones standing in) and metadata, and its `FileData` (open: the
    caller closes it once the adapter is packed); `digest` (a `hashes.ReadDigest`) is handed
    what is read of the file."""
    data = FileData(open_checked(path, adapter_id, max_bytes), adapter_id, digest)
    if digest is not None:
        digest.begin(data.file)
    try:
        return data.tensors(), data.file.metadata, data
    except BaseException:
        data.close()
        raise
