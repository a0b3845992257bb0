"""Where adapter files come from: a local folder (`--adapters DIR`) and the Hugging Face Hub.

Ids are names, never paths: `style/anime` means `DIR/style/anime.safetensors`, or the
folder `DIR/style/anime/` holding `pytorch_lora_weights.safetensors` (or exactly one
other `.safetensors` file) next to an optional model card and adapter_config.json. A
folder holding `high_noise_model.safetensors` and `low_noise_model.safetensors` is one
Wan 2.2 adapter for both experts, as its trainers publish them.
`..`, absolute paths, URL schemes and odd characters are refused, and so is anything
whose real path (after symlinks) leaves the folder. Only safetensors are ever read.

Hub adapters (`owner/name` or `owner/name@revision`) come through huggingface_hub and
its cache (HF_HUB_OFFLINE=1 serves from the cache alone), with the weight file chosen
as the Hugging Face image chooses it, a size cap, and allow/deny patterns on ids.
"""

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path

from loraswap.errors import AdapterChanged, AdapterForbidden, AdapterInvalid, AdapterNotFound, BadRequest

ADAPTER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,127}){0,7}"
                        r"(@[A-Za-z0-9][A-Za-z0-9_.-]{0,127})?$")
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})"
                    r"(@(?P<revision>[A-Za-z0-9][A-Za-z0-9_.-]{0,127}))?$")
WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # what diffusers' save_lora_weights writes
# a Wan 2.2 adapter's two files, one per expert (transformer, transformer_2), as published
EXPERT_FILES = ("high_noise_model.safetensors", "low_noise_model.safetensors")
UNSAFE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SIDE_FILES = ("README.md", "adapter_config.json")  # read beside the weights for the declared base model


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


def check_adapter_id(adapter_id: str) -> str:
    if not ADAPTER_ID.match(adapter_id) or adapter_id.endswith("/"):
        raise BadRequest(f"invalid adapter id {adapter_id!r}: ids are names like 'style/anime' (letters, digits, "
                         "'_', '-', '.', '/'), never paths; a file elsewhere is named by an https:// URL, "
                         "civitai:MODEL@VERSION or s3://bucket/key")
    return adapter_id


class LocalAdapterSource:
    """Adapters in one folder; ids are paths under it without the suffix."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise FileNotFoundError(f"adapter folder {root} does not exist")

    def locate(self, adapter_id: str) -> AdapterLocation:
        check_adapter_id(adapter_id)
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
        """Whether the folder holds the id (as a file or an adapter folder), without checking it."""
        return (self.root / f"{adapter_id}.safetensors").is_file() or (self.root / adapter_id).is_dir()

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


class HubAdapterSource:
    """Adapters on the Hugging Face Hub, through huggingface_hub and its cache."""

    def __init__(self, cache_dir: str | Path | None = None, allow: tuple[str, ...] = ("*",),
                 deny: tuple[str, ...] = (), max_bytes: int = 2**31):
        self.cache_dir, self.allow, self.deny, self.max_bytes = cache_dir, tuple(allow), tuple(deny), max_bytes

    def handles(self, adapter_id: str) -> bool:
        return HUB_ID.match(adapter_id) is not None

    def locate(self, adapter_id: str) -> AdapterLocation:
        from huggingface_hub import constants, hf_hub_download, snapshot_download
        from huggingface_hub.errors import (
            EntryNotFoundError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        match = HUB_ID.match(adapter_id)
        if match is None:
            raise BadRequest(f"invalid hub adapter id {adapter_id!r}: use owner/name or owner/name@revision")
        repo, revision = match["repo"], match["revision"]
        if not any(fnmatch.fnmatchcase(repo, p) for p in self.allow) or \
                any(fnmatch.fnmatchcase(repo, p) for p in self.deny):
            raise AdapterForbidden(adapter_id, "this server does not serve it (allow/deny patterns)",
                                   "Ask the operator to allow it, or use another adapter")
        try:
            if constants.HF_HUB_OFFLINE:
                folder = Path(snapshot_download(repo, revision=revision, cache_dir=self.cache_dir,
                                                local_files_only=True))
                names = choose_weight_files(adapter_id, [p.name for p in folder.glob("*.safetensors")])
            else:
                folder, names = self._download(adapter_id, repo, revision, hf_hub_download)
        except (RepositoryNotFoundError, RevisionNotFoundError, LocalEntryNotFoundError, EntryNotFoundError,
                HFValidationError) as e:
            raise AdapterNotFound(adapter_id, f"not found on the hub or in its cache ({type(e).__name__})",
                                  "Check the id and revision; offline, only cached adapters are served") from None
        first, second = names
        return AdapterLocation(adapter_id, folder / first, folder, folder / second if second else None)

    def _download(self, adapter_id, repo, revision, hf_hub_download) -> tuple[Path, tuple[str, str | None]]:
        """The snapshot folder the weight file(s) and side files were downloaded into, and the
        weight files' names (`choose_weight_files`)."""
        from huggingface_hub import HfApi

        info = HfApi().model_info(repo, revision=revision, files_metadata=True)
        sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
        names = choose_weight_files(adapter_id, list(sizes))
        total = sum(sizes[name] for name in names if name)
        if total > self.max_bytes:
            raise AdapterInvalid(adapter_id, f"{' + '.join(n for n in names if n)} is {total / 2**20:.0f} MiB, over "
                                 f"the {self.max_bytes / 2**20:.0f} MiB limit", "Use a smaller adapter")
        for name in [n for n in names if n] + [side for side in SIDE_FILES if side in sizes]:
            folder = Path(hf_hub_download(repo, name, revision=info.sha, cache_dir=self.cache_dir)).parent
        return folder, names


class AdapterSources:
    """The local folder first, then the hub for ids shaped `owner/name[@revision]`; ids of
    files elsewhere (`url:`, `civitai:`, `s3:`, references.py) go to `remote`."""

    def __init__(self, local: LocalAdapterSource | None, hub: HubAdapterSource | None, remote=None):
        self.local, self.hub, self.remote = local, hub, remote  # remote: a remote.RemoteSources

    def locate(self, adapter_id: str) -> AdapterLocation:
        if self.remote is not None and self.remote.handles(adapter_id):
            return self.remote.locate(adapter_id)
        check_adapter_id(adapter_id)
        if self.local is not None:
            try:
                return self.local.locate(adapter_id)
            except AdapterNotFound:
                if self.hub is None or not self.hub.handles(adapter_id):
                    raise
        if self.hub is not None and self.hub.handles(adapter_id):
            return self.hub.locate(adapter_id)
        raise AdapterNotFound(adapter_id, "no adapter folder is configured and it is not a hub id",
                              "Start the server with --adapters DIR or --hub")

    def list_ids(self) -> list[str]:
        local = self.local.list_ids() if self.local is not None else []
        return local + (self.remote.list_ids() if self.remote is not None else [])

    def source_name(self, adapter_id: str) -> str:
        """Where the adapter comes from: folder, hub, url, civitai or s3."""
        if self.remote is not None and self.remote.handles(adapter_id):
            return self.remote.source_of(adapter_id)
        in_folder = self.local is not None and self.local.has(adapter_id)
        return "hub" if self.hub is not None and self.hub.handles(adapter_id) and not in_folder else "folder"

    def forget(self, adapter_id: str) -> None:
        """Drop what is kept of the adapter beyond the caches: a download's file."""
        if self.remote is not None and self.remote.handles(adapter_id):
            self.remote.forget(adapter_id)

