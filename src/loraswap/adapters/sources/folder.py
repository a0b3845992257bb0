"""The adapter folder (`--adapters DIR`): adapters as files on this machine.

Ids are names, never paths: `style/anime` means `DIR/style/anime.safetensors`, or the
folder `DIR/style/anime/` holding `pytorch_lora_weights.safetensors` (or exactly one
other `.safetensors` file) next to an optional model card and adapter_config.json. A
folder holding `high_noise_model.safetensors` and `low_noise_model.safetensors` is one
Wan 2.2 adapter for both experts, as its trainers publish them. The ref's id was checked
where it was made (`adapters/reference.py`); anything whose real path (after symlinks)
leaves the folder is refused here. Only safetensors are ever read.
"""

from pathlib import Path

from loraswap.adapters.files.location import AdapterLocation
from loraswap.adapters.reference import ADAPTER_ID, AdapterRef
from loraswap.errors import AdapterInvalid, AdapterNotFound

WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # what diffusers' save_lora_weights writes
# a Wan 2.2 adapter's two files, one per expert (transformer, transformer_2), as published
EXPERT_FILES = ("high_noise_model.safetensors", "low_noise_model.safetensors")
UNSAFE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SIDE_FILES = ("README.md", "adapter_config.json")  # read beside the weights for the declared base model


class FolderSource:
    """Adapters in one folder; ids are paths under it without the suffix."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise FileNotFoundError(f"adapter folder {root} does not exist")

    def locate(self, ref: AdapterRef) -> AdapterLocation:
        adapter_id = ref.adapter_id
        if "@" in adapter_id:
            raise AdapterNotFound(adapter_id, "revisions (@...) only exist for hub adapters",
                                  "Drop the @revision, or start the server with --hub")
        file = self.root / f"{adapter_id}.safetensors"
        folder = self.root / adapter_id
        if file.is_file():
            return AdapterLocation(adapter_id, self._inside(adapter_id, file), None)
        if folder.is_dir():
            folder = self._inside(adapter_id, folder)
            for side in SIDE_FILES:  # read for the base model: a link out would leak another file's contents
                if (folder / side).is_symlink():
                    self._inside(adapter_id, folder / side)
            first, second = choose_weight_files(adapter_id, [p.name for p in folder.glob("*.safetensors")])
            return AdapterLocation(adapter_id, self._inside(adapter_id, folder / first), folder,
                                   self._inside(adapter_id, folder / second) if second else None)
        for suffix in UNSAFE_SUFFIXES:
            if (self.root / f"{adapter_id}{suffix}").exists():
                raise AdapterInvalid(adapter_id, f"it is a {suffix} file; only safetensors files are loaded "
                                     "(pickle files can run code)", "Convert it to .safetensors")
        # the folder is not named: a client must not learn the server's paths
        raise AdapterNotFound(adapter_id, "no such adapter in the adapter folder",
                              "GET /adapters lists the ids this server knows")

    def has(self, adapter_id: str) -> bool:
        """Whether the folder holds the id (as a file or an adapter folder), without checking it;
        never an id with a revision (`@`: the hub's)."""
        return "@" not in adapter_id and ((self.root / f"{adapter_id}.safetensors").is_file()
                                          or (self.root / adapter_id).is_dir())

    def list_ids(self) -> list[str]:
        ids = set()
        for path in self.root.rglob("*.safetensors"):
            if not path.resolve().is_relative_to(self.root):
                continue
            rel = path.relative_to(self.root)
            in_folder = path.name in (WEIGHT_NAME, *EXPERT_FILES)
            adapter_id = rel.parent.as_posix() if in_folder else rel.with_suffix("").as_posix()
            if ADAPTER_ID.match(adapter_id):
                ids.add(adapter_id)
        return sorted(ids)

    def _inside(self, adapter_id: str, path: Path) -> Path:
        real = path.resolve()
        if not real.is_relative_to(self.root):
            raise AdapterInvalid(adapter_id, f"its {path.name} is a link that leaves the adapter folder",
                                 "Copy the adapter into the adapter folder instead of linking it")
        return real


def choose_weight_files(adapter_id: str, names: list[str]) -> tuple[str, str | None]:
    """(the weight file, Wan 2.2's low-noise expert's file or None): a pair of expert files
    (`EXPERT_FILES`), else `choose_weight_file`'s one."""
    if WEIGHT_NAME not in names and all(name in names for name in EXPERT_FILES):
        return EXPERT_FILES
    return choose_weight_file(adapter_id, names), None


def choose_weight_file(adapter_id: str, names: list[str]) -> str:
    """As the Hugging Face image does: pytorch_lora_weights.safetensors, else the only
    .safetensors file, else an error listing the candidates."""
    if WEIGHT_NAME in names:
        return WEIGHT_NAME
    candidates = sorted(n for n in names if n.endswith(".safetensors") and "/" not in n)
    if len(candidates) == 1:
        return candidates[0]
    problem = f"it holds {len(candidates)} safetensors files ({', '.join(candidates) or 'none'})"
    raise AdapterInvalid(adapter_id, problem, f"Keep one weight file, or name it {WEIGHT_NAME}")
