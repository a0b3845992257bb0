"""Civitai (`--civitai`): `civitai:MODEL@VERSION`, or an AIR naming one.

`GET {api}/v1/model-versions/{VERSION}` names the version's files; the primary SafeTensor
file of type Model is downloaded and must match the SHA256 Civitai lists. A token
(`CIVITAI_TOKEN`, or `--civitai-token-file`) goes with both requests as a Bearer header,
never into a URL, a log or an error. The file lands in the download folder
(`remote.RemoteSources`), fetched under `fetch.py`'s network rules.
"""

import json
import re
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from loraswap.adapters.reference import AdapterRef, CivitaiReference
from loraswap.adapters.sources.downloads import Download, Reserve
from loraswap.adapters.sources.fetch import FetchRules, display_url, fetch_file, fetch_json
from loraswap.errors import AdapterInvalid, AdapterNotFound, AdapterUnavailable

CIVITAI_API = "https://civitai.com/api"


def fetch_civitai(ref: AdapterRef, dest: Path, reserve: Reserve, api: str, token: str | None,
                  rules: Callable[[tuple[str, ...]], FetchRules]) -> Download:
    """The version's weights file written to `dest`, checked against the SHA256 Civitai lists;
    `api`: Civitai's API base (or a mirror's); `rules(allow)`: the fetch rules for those hosts."""
    adapter_id, reference = ref.adapter_id, ref.where
    # the API's own host is named, so a mirror on a private network works; its download
    # links may redirect to any public host (Civitai's storage)
    allow = ("*", _host_pattern(api))
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    version = fetch_json(f"{api}/v1/model-versions/{reference.version}", rules(allow), adapter_id, headers)
    _check_civitai_answer(adapter_id, version)
    file = _primary_file(adapter_id, reference, version)
    fetched = fetch_file(file["downloadUrl"], dest, rules(allow), adapter_id, headers, reserve=reserve)
    expected = (file.get("hashes") or {}).get("SHA256") or ""
    if fetched.sha256.lower() != expected.lower():
        raise AdapterInvalid(adapter_id, f"the file downloaded does not match the SHA256 Civitai lists "
                             f"({expected[:12] or 'none'}...)", "Try again later, or report it to Civitai")
    return Download("civitai", display_url(file["downloadUrl"]), fetched.sha256, version.get("baseModel"), api)


# what is read of Civitai's answer, and the JSON type each must have when present (a model
# version: `GET /v1/model-versions/{id}`)
CIVITAI_VERSION_FIELDS = {"files": list, "modelId": int, "baseModel": str}
CIVITAI_FILE_FIELDS = {"type": str, "primary": bool, "downloadUrl": str, "metadata": dict, "hashes": dict}
CIVITAI_INNER_FIELDS = {"metadata": {"format": str}, "hashes": {"SHA256": str}}
SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")


def _check_civitai_answer(adapter_id: str, version: object) -> None:
    """502 naming the field of Civitai's answer that is not of the type it must be (`hashes.SHA256`
    a number, `files` an object, ...): its upstream answered wrong, not the client."""
    _check_fields(adapter_id, version, CIVITAI_VERSION_FIELDS, "")
    if version.get("files") is None:
        raise _malformed(adapter_id, "it has no files list")
    for i, file in enumerate(version["files"]):
        _check_fields(adapter_id, file, CIVITAI_FILE_FIELDS, f"files[{i}]")
        for name, fields in CIVITAI_INNER_FIELDS.items():
            _check_fields(adapter_id, file.get(name) or {}, fields, f"files[{i}].{name}")
        sha256 = (file.get("hashes") or {}).get("SHA256")
        if sha256 is not None and not SHA256_HEX.fullmatch(sha256):
            raise _malformed(adapter_id, f"files[{i}].hashes.SHA256 is {_described(sha256)}, not 64 hex digits")


def _check_fields(adapter_id: str, value: object, fields: dict[str, type], where: str) -> None:
    """`value` (the object at `where`; "": the answer) is an object whose `fields` are absent,
    null or of their type."""
    if not isinstance(value, dict):
        raise _malformed(adapter_id, f"{where or 'it'} is {_described(value)}, not an object")
    for name, kind in fields.items():
        field = value.get(name)
        if field is not None and (not isinstance(field, kind) or (kind is int and isinstance(field, bool))):
            path = f"{where}.{name}" if where else name
            raise _malformed(adapter_id, f"{path} is {_described(field)}, not {JSON_TYPES[kind]}")


JSON_TYPES = {list: "a list", dict: "an object", str: "a string", int: "an integer", bool: "true or false"}


def _described(value: object) -> str:
    """A JSON value as a message shows it: its text (short) and its type."""
    kind = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
    return f"{json.dumps(value)[:40]} ({kind})"


def _malformed(adapter_id: str, what: str) -> AdapterUnavailable:
    return AdapterUnavailable(adapter_id, f"Civitai's answer is malformed: {what}",
                              "Try again later; if it persists, report it to Civitai (or the mirror's operator)")


def _primary_file(adapter_id: str, reference: CivitaiReference, version: dict) -> dict:
    """The version's SafeTensor weights file (the primary one when there are several), from an
    answer `_check_civitai_answer` passed."""
    if version.get("modelId") not in (None, reference.model):
        raise AdapterNotFound(adapter_id, f"version {reference.version} belongs to model {version.get('modelId')}, "
                              f"not {reference.model}", "Check the AIR: civitai:MODEL@VERSION")
    files = [f for f in version["files"] if f.get("type", "Model") == "Model"
             and (f.get("metadata") or {}).get("format") == "SafeTensor" and isinstance(f.get("downloadUrl"), str)]
    if not files:
        raise AdapterInvalid(adapter_id, "the version has no SafeTensor file (pickle files can run code)",
                             "Use a version published as .safetensors")
    return next((f for f in files if f.get("primary")), files[0])


def _host_pattern(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}" if parts.port else (parts.hostname or "")
