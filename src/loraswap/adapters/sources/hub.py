"""The Hugging Face Hub (`--hub`): adapters `owner/name` or `owner/name@revision`, through
huggingface_hub and its cache (HF_HUB_OFFLINE=1 serves from the cache alone), with the weight
file chosen as the Hugging Face image chooses it, a size cap, and allow/deny patterns on ids.
"""

import fnmatch
import re
from pathlib import Path

from loraswap.adapters.files.location import AdapterLocation
from loraswap.adapters.reference import AdapterRef
from loraswap.adapters.sources.folder import SIDE_FILES, choose_weight_files
from loraswap.errors import AdapterForbidden, AdapterInvalid, AdapterNotFound, BadRequest

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})"
                    r"(@(?P<revision>[A-Za-z0-9][A-Za-z0-9_.-]{0,127}))?$")


class HubSource:
    """Adapters on the Hugging Face Hub, through huggingface_hub and its cache."""

    def __init__(self, cache_dir: str | Path | None = None, allow: tuple[str, ...] = ("*",),
                 deny: tuple[str, ...] = (), max_bytes: int = 2**31):
        self.cache_dir, self.allow, self.deny, self.max_bytes = cache_dir, tuple(allow), tuple(deny), max_bytes

    def handles(self, adapter_id: str) -> bool:
        return HUB_ID.match(adapter_id) is not None

    def locate(self, ref: AdapterRef) -> AdapterLocation:
        from huggingface_hub import constants, hf_hub_download, snapshot_download
        from huggingface_hub.errors import (
            EntryNotFoundError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        adapter_id = ref.adapter_id
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
