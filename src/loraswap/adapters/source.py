"""Where adapter files come from: a local folder (`--adapters DIR`).

Ids are names, never paths: `style/anime` means `DIR/style/anime.safetensors`, or the
folder `DIR/style/anime/` holding `pytorch_lora_weights.safetensors` (or exactly one
other `.safetensors` file) next to an optional model card and adapter_config.json.
`..`, absolute paths, URL schemes and odd characters are refused, and so is anything
whose real path (after symlinks) leaves the folder. Only safetensors are ever read.
"""

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import AdapterInvalid, AdapterNotFound, BadRequest

ADAPTER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,127}){0,7}$")
WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # what diffusers' save_lora_weights writes
UNSAFE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class AdapterLocation:
    adapter_id: str
    weights: Path  # the safetensors file
    folder: Path | None  # the adapter's own folder (model card, adapter_config.json), if it has one


def check_adapter_id(adapter_id: str) -> str:
    if not ADAPTER_ID.match(adapter_id) or adapter_id.endswith("/"):
        raise BadRequest(f"invalid adapter id {adapter_id!r}: ids are names like 'style/anime' (letters, digits, "
                         "'_', '-', '.', '/'), never paths or URLs")
    return adapter_id


class LocalAdapterSource:
    """Adapters in one folder; ids are paths under it without the suffix."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise FileNotFoundError(f"adapter folder {root} does not exist")

    def locate(self, adapter_id: str) -> AdapterLocation:
        check_adapter_id(adapter_id)
        file = self.root / f"{adapter_id}.safetensors"
        folder = self.root / adapter_id
        if file.is_file():
            return AdapterLocation(adapter_id, self._inside(adapter_id, file), None)
        if folder.is_dir():
            folder = self._inside(adapter_id, folder)
            return AdapterLocation(adapter_id, self._inside(adapter_id, self._weights_in(adapter_id, folder)), folder)
        for suffix in UNSAFE_SUFFIXES:
            if (self.root / f"{adapter_id}{suffix}").exists():
                raise AdapterInvalid(adapter_id, f"it is a {suffix} file; only safetensors files are loaded "
                                     "(pickle files can run code)", "Convert it to .safetensors")
        raise AdapterNotFound(adapter_id, f"no such adapter in {self.root}",
                              "GET /adapters lists the ids this server knows")

    def list_ids(self) -> list[str]:
        ids = set()
        for path in self.root.rglob("*.safetensors"):
            if not path.resolve().is_relative_to(self.root):
                continue
            rel = path.relative_to(self.root)
            adapter_id = rel.parent.as_posix() if path.name == WEIGHT_NAME else rel.with_suffix("").as_posix()
            if ADAPTER_ID.match(adapter_id):
                ids.add(adapter_id)
        return sorted(ids)

    def _inside(self, adapter_id: str, path: Path) -> Path:
        real = path.resolve()
        if not real.is_relative_to(self.root):
            raise AdapterInvalid(adapter_id, "its file is a link that leaves the adapter folder",
                                 "Copy the adapter into the adapter folder instead of linking it")
        return real

    @staticmethod
    def _weights_in(adapter_id: str, folder: Path) -> Path:
        if (folder / WEIGHT_NAME).is_file():
            return folder / WEIGHT_NAME
        candidates = sorted(p.name for p in folder.glob("*.safetensors"))
        if len(candidates) == 1:
            return folder / candidates[0]
        problem = f"its folder holds {len(candidates)} safetensors files ({', '.join(candidates) or 'none'})"
        raise AdapterInvalid(adapter_id, problem, f"Keep one weight file, or name it {WEIGHT_NAME}")

