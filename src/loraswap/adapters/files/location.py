"""Where an adapter's file is, once a source found it, and what tells a changed file from the
one read before."""

from dataclasses import dataclass
from pathlib import Path

from loraswap.errors import AdapterChanged


@dataclass(frozen=True)
class AdapterLocation:
    adapter_id: str
    weights: Path  # the safetensors file
    folder: Path | None  # the adapter's own folder (model card, adapter_config.json), if it has one
    second_expert: Path | None = None  # Wan 2.2's low-noise expert's file, when `weights` is the high-noise one
    source_says: str | None = None  # what the adapter's source says it is for (Civitai's baseModel)


def file_stamp(location: AdapterLocation) -> tuple:
    """What tells a changed file (or pair of expert files) from the one read before."""
    stamp = ()
    for path in (location.weights, location.second_expert):
        if path is not None:
            try:
                stat = path.stat()
            except FileNotFoundError:  # removed since it was found (another process's DELETE)
                raise AdapterChanged(location.adapter_id, "its file was removed while it was being read",
                                     "Try again") from None
            # ctime and inode too: a copy that keeps the mtime (cp -p, rsync -t, tar) is still a new file
            stamp += (stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino)
    return stamp


def stamp_bytes(stamp: tuple) -> int:
    """The size of the file (or pair of files) a `file_stamp` was taken of."""
    return sum(stamp[0::4])
