"""The adapter folders as A1111's `GET /sdapi/v1/loras` lists its LoRA folder: each adapter's
`name` (its id here, what a `<lora:NAME:WEIGHT>` tag names), `alias` (its metadata's
`ss_output_name`, else the name, as A1111 makes it), `path` and `metadata` (the safetensors
metadata, a value that is a JSON object given as one, as A1111 reads it; one nested deeper
than a request body may be stays text, so that no file can make the answer unwritable).

Listed only with `--list-adapters-as-models`, as `GET /v1/models` lists adapters: the
metadata is the files' own, and a trainer's may name paths and data sets of the machine it
ran on. Off (the default), the list is empty.

`path` is the file's path under its adapter folder, not on the server's disk: a client never
learns the server's paths. Only the folders (`--adapters`) are listed, as A1111 lists its own
folder: not hub adapters nor files fetched by URL. Each file's header is read once per version
of the file (`FileFacts`, keyed by the file's stamp), off the event loop by the caller.
"""

import json
import logging

from loraswap.adapters.files.facts import FileFacts
from loraswap.adapters.files.formats import open_checked
from loraswap.adapters.files.location import AdapterLocation, file_stamp
from loraswap.adapters.reference import AdapterRef
from loraswap.adapters.sources.folder import FolderSource
from loraswap.errors import AdapterError
from loraswap.server.config import ServerConfig
from loraswap.server.requests.parse import MAX_JSON_NESTING, json_nesting

logger = logging.getLogger("loraswap.server")


class LoraListing:
    """The listing of the server's adapter folders (each model's `--adapters`), the metadata of
    each file kept while the file is unchanged. Its methods block: run them on a worker thread."""

    def __init__(self, config: ServerConfig):
        # (folder, largest adapter file) per model; a folder two models share is listed once
        folders = {engine.sources.adapters.resolve(): engine.sources.max_adapter_bytes
                   for engine in config.engines if engine.sources.adapters is not None}
        self._folders = list(folders.items()) if config.list_adapters_as_models else []
        self._metadata: FileFacts[dict] = FileFacts()

    def rows(self) -> list[dict]:
        """One row per adapter of the folders, by name; a name in two folders, the first's.
        Empty without --list-adapters-as-models."""
        rows: dict[str, dict] = {}
        for folder, max_bytes in self._folders:
            if not folder.is_dir():
                continue
            source = FolderSource(folder)
            for adapter_id in source.list_ids():
                if adapter_id not in rows:
                    row = self._row(source, adapter_id, max_bytes)
                    if row is not None:
                        rows[adapter_id] = row
        return [rows[name] for name in sorted(rows)]

    def _row(self, source: FolderSource, adapter_id: str, max_bytes: int) -> dict | None:
        try:
            location = source.locate(AdapterRef(adapter_id))  # (an id the folder listed)
            metadata = self._read_metadata(location, max_bytes)
        except AdapterError as e:  # gone since it was listed, a link out of the folder, a file refused
            logger.debug("GET /sdapi/v1/loras leaves out %s: %s", adapter_id, e.message)
            return None
        alias = metadata.get("ss_output_name")
        return {"name": adapter_id, "alias": alias if isinstance(alias, str) and alias else adapter_id,
                "path": location.weights.relative_to(source.root).as_posix(), "metadata": metadata}

    def _read_metadata(self, location: AdapterLocation, max_bytes: int) -> dict:
        stamp = file_stamp(location)
        known = self._metadata.get(location.adapter_id, stamp)
        if known is None:
            file = open_checked(location.weights, location.adapter_id, max_bytes)  # its header checked, bounded
            file.close()
            known = {key: _as_a1111_reads_it(value) for key, value in file.metadata.items()}
            self._metadata.put(location.adapter_id, stamp, known)
        return known


def _as_a1111_reads_it(value: str):
    """A metadata value as A1111's `read_metadata_from_safetensors` gives it: one that starts
    with `{` parsed as JSON when it is JSON (kohya's `ss_tag_frequency`, ...), else the text;
    the text too when it nests deeper than `MAX_JSON_NESTING` (the answer's encoder recurses)."""
    if not value.startswith("{"):
        return value
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        return value
    return parsed if json_nesting(parsed) <= MAX_JSON_NESTING else value
