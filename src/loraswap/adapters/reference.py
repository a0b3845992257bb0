"""One adapter as a request names it: `AdapterRef`, made and checked once where the request is
parsed, then carried whole to the store, the GPU worker, every rank and every Ray replica.

A name is an adapter id of the folder or the hub (`style/anime`, `owner/name@rev`), or a
reference to a file elsewhere, which becomes an id of the form `SOURCE:...`. A colon never
appears in a folder or hub id, so the two cannot be confused, and the id is what the adapter
is served, cached and listed under (routing, the cache, `GET /adapters`, errors, logs):

- `https://host/path/x.safetensors?signature=...` -> `url:<sha256 of the URL, 32 hex>`.
  The URL itself, signature and all, travels inside the ref (`AdapterRef.url`), never in
  an id, a log line, a repr or an error: the process that fetches the file finds it there,
  whichever process that is. A `url:` id named by its id carries the URL only when the
  server still knows it (`server/url_book.py`, per API key); without it, the adapter is
  served from the download folder alone.
- `civitai:MODEL@VERSION`, or an AIR `urn:air:ECOSYSTEM:lora:civitai:MODEL@VERSION` ->
  `civitai:MODEL@VERSION` (the AIR's ecosystem is a hint of the base model).
- `s3://bucket/key` -> `s3:bucket/key`.

`AdapterRef.named` reads what a user writes, `AdapterRef.of_id` an id as served (a video
job's row, the kept adapters' record, a script); both check it. The plain constructor checks
nothing: it is for a ref already checked (a copy with its URL filled in). A ref pickles
whole, so another process gets the URL with the id.
"""

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Literal
from urllib.parse import urlsplit

from loraswap.errors import BadRequest

ADAPTER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,127}){0,7}"
                        r"(@[A-Za-z0-9][A-Za-z0-9_.-]{0,127})?$")
MAX_URL_CHARS = 2048
# ids are ASCII: [0-9], not \d, which takes every script's digits (civitai:١@١ is no civitai:1@1)
CIVITAI = re.compile(r"^civitai:(?P<model>[0-9]{1,12})@(?P<version>[0-9]{1,12})$")
AIR = re.compile(r"^urn:air:(?P<ecosystem>[a-z0-9_.-]{1,32}):(?P<type>[a-z]{1,32}):civitai:"
                 r"(?P<model>[0-9]{1,12})@(?P<version>[0-9]{1,12})$")
AIR_ADAPTER_TYPES = ("lora", "lycoris", "locon", "loha", "lokr", "dora")
S3 = re.compile(r"^s3:(//)?(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/"
                r"(?P<key>[A-Za-z0-9_.=+-]+(/[A-Za-z0-9_.=+-]+)*)$")
URL_ID = re.compile(r"^url:[0-9a-f]{32}$")
REMOTE_PREFIXES = ("url:", "civitai:", "s3:")
REFERENCE_PREFIXES = ("https://", "http://", "civitai:", "urn:air:", "s3://", "url:", "s3:", "gs://")

Source = Literal["name", "url", "civitai", "s3"]  # name: the adapter folder, else the hub


@dataclass(frozen=True)
class UrlReference:
    url: str

    @property
    def adapter_id(self) -> str:
        return "url:" + hashlib.sha256(self.url.encode()).hexdigest()[:32]

    def __repr__(self) -> str:  # never the signature: a repr ends up in logs
        return f"UrlReference({shown(self.url)!r})"


@dataclass(frozen=True)
class CivitaiReference:
    model: int
    version: int
    ecosystem: str | None = None  # from an AIR: the base model's family, as Civitai names it

    @property
    def adapter_id(self) -> str:
        return f"civitai:{self.model}@{self.version}"


@dataclass(frozen=True)
class S3Reference:
    bucket: str
    key: str

    @property
    def adapter_id(self) -> str:
        return f"s3:{self.bucket}/{self.key}"


Reference = UrlReference | CivitaiReference | S3Reference


@dataclass(frozen=True)
class AdapterRef:
    """One adapter of a request: the id it is served under, its weight in the blend, and for a
    file elsewhere where it is (`where`: its URL, Civitai model and version, or bucket and key;
    None for a folder or hub id, and for a `url:` id whose URL is not known). Two refs are
    equal when their ids and weights are: the id of a file elsewhere names its file."""

    adapter_id: str
    scale: float = 1.0
    where: Reference | None = field(default=None, compare=False, repr=False)

    @classmethod
    def named(cls, text: str, scale: float = 1.0) -> "AdapterRef":
        """The ref of what a user wrote (an id, a URL, a Civitai AIR, `s3://bucket/key`),
        checked; BadRequest saying what is wrong."""
        if not looks_like_reference(text):
            return cls(check_adapter_id(text), scale)
        if URL_ID.match(text):
            return cls(text, scale)
        where = parse_reference(text)
        return cls(where.adapter_id, scale, where)

    @classmethod
    def of_id(cls, adapter_id: str, scale: float = 1.0) -> "AdapterRef":
        """The ref of an id as served (`named`'s output), checked: a `url:` id without its URL."""
        check_id(adapter_id)
        where = None if not is_remote(adapter_id) or adapter_id.startswith("url:") else parse_reference(adapter_id)
        return cls(adapter_id, float(scale), where)

    @property
    def source(self) -> Source:
        """Where its file comes from: `url`, `civitai`, `s3`, or `name` (the adapter folder, else the hub)."""
        return source_of(self.adapter_id) if is_remote(self.adapter_id) else "name"

    @property
    def url(self) -> str | None:
        """The URL behind a `url:` id, signature and all, when known."""
        return self.where.url if isinstance(self.where, UrlReference) else None

    def with_url(self, url: str | None) -> "AdapterRef":
        """This `url:` ref carrying `url` (None: as it is); BadRequest when the URL is another id's."""
        if url is None or self.url == url:
            return self
        where = _url(url)
        if where.adapter_id != self.adapter_id:
            raise BadRequest(f"the URL given for {self.adapter_id} is another's")
        return replace(self, where=where)


def as_refs(loras: Iterable) -> list[AdapterRef]:
    """Refs as they are; `(id, weight)` pairs (or `{"path", "scale"}`) made into refs by their
    ids (`AdapterRef.of_id`): the convenience of scripts, tests and a request kept as JSON. A
    `url:` id given so carries no URL (served from the download folder alone)."""
    refs = []
    for lora in loras:
        if isinstance(lora, AdapterRef):
            refs.append(lora)
        elif isinstance(lora, dict):
            refs.append(AdapterRef.of_id(lora["path"], lora.get("scale", 1.0)))
        else:
            adapter_id, scale = lora
            refs.append(AdapterRef.of_id(adapter_id, scale))
    return refs


def check_adapter_id(adapter_id: str) -> str:
    """`adapter_id` if it is a folder or hub id, else BadRequest (a path, a scheme, odd characters)."""
    if not ADAPTER_ID.match(adapter_id) or adapter_id.endswith("/"):
        raise BadRequest(f"invalid adapter id {adapter_id!r}: ids are names like 'style/anime' (letters, digits, "
                         "'_', '-', '.', '/'), never paths; a file elsewhere is named by an https:// URL, "
                         "civitai:MODEL@VERSION or s3://bucket/key")
    return adapter_id


def check_id(adapter_id: str) -> str:
    """`adapter_id` if it is a folder, hub or reference id (`AdapterRef.named`'s), else BadRequest."""
    if not is_remote(adapter_id):
        return check_adapter_id(adapter_id)
    well_formed = URL_ID.match(adapter_id) if adapter_id.startswith("url:") else \
        parse_reference(adapter_id).adapter_id == adapter_id
    if not well_formed:
        raise BadRequest(f"invalid adapter id {shown(adapter_id)!r}")
    return adapter_id


def looks_like_reference(text: str) -> bool:
    """Whether `text` names a file elsewhere (or is such a file's id), not a folder or hub id."""
    return text.startswith(REFERENCE_PREFIXES)


def is_remote(adapter_id: str) -> bool:
    """Whether the id is one of a file elsewhere (`url:`, `civitai:`, `s3:`)."""
    return adapter_id.startswith(REMOTE_PREFIXES)


def source_of(adapter_id: str) -> str:
    """Where a remote id's file comes from: `url`, `civitai` or `s3`."""
    return adapter_id.split(":", 1)[0]


def parse_reference(text: str) -> Reference:
    """The reference `text` makes (see the module's docstring); BadRequest saying what is wrong."""
    if text.startswith(("https://", "http://")):
        return _url(text)
    if text.startswith(("civitai:", "urn:air:")):
        return _civitai(text)
    if text.startswith("gs://"):
        # boto3 speaks no gs://; Cloud Storage answers the S3 API at its own endpoint
        raise BadRequest(f"adapter {shown(text)!r}: gs:// is not read; a Cloud Storage bucket is read as "
                         "s3://BUCKET/KEY by a server started with --s3 --s3-endpoint-url "
                         "https://storage.googleapis.com and an HMAC key as its AWS access key")
    match = S3.match(text)
    if match is None:
        raise BadRequest(f"adapter {shown(text)!r}: not a reference loraswap reads: use an adapter id, an https:// "
                         "URL, civitai:MODEL@VERSION, urn:air:ECOSYSTEM:lora:civitai:MODEL@VERSION or s3://bucket/key")
    if ".." in match["key"].split("/"):
        raise BadRequest(f"adapter {shown(text)!r}: '..' in an object key")
    return S3Reference(match["bucket"], match["key"])


def _url(text: str) -> UrlReference:
    if len(text) > MAX_URL_CHARS:
        raise BadRequest(f"adapter URL over {MAX_URL_CHARS} characters")
    try:
        parts = urlsplit(text)  # raises on a bracketed host that is no IPv6 address ('http://[::1/')
    except ValueError:
        raise BadRequest(f"adapter URL {shown(text)[:80]!r}: its host is not a name or an address") from None
    try:
        parts.port  # noqa: B018  (raises on a port that is not ASCII digits)
    except ValueError:
        raise BadRequest(f"adapter URL {shown(text)[:80]!r}: its port is not a number") from None
    if not parts.hostname or parts.username is not None or parts.password is not None:
        raise BadRequest(f"adapter {shown(text)!r}: a URL names a host and no user or password")
    if any(ord(c) < 33 for c in text):
        raise BadRequest(f"adapter {shown(text)!r}: a URL has no spaces or control characters")
    return UrlReference(text)


def _civitai(text: str) -> CivitaiReference:
    match = CIVITAI.match(text)
    if match is not None:
        return CivitaiReference(int(match["model"]), int(match["version"]))
    match = AIR.match(text)
    if match is None:
        raise BadRequest(f"adapter {text[:80]!r}: a Civitai reference is civitai:MODEL@VERSION or "
                         "urn:air:ECOSYSTEM:lora:civitai:MODEL@VERSION (numbers in ASCII digits 0-9)")
    if match["type"] not in AIR_ADAPTER_TYPES:
        raise BadRequest(f"adapter {text!r}: it is a {match['type']}, not an adapter (lora, lycoris, ...)")
    return CivitaiReference(int(match["model"]), int(match["version"]), match["ecosystem"])


ENCODED_QUERY = re.compile(r"%(?:25)*3f", re.IGNORECASE)  # a '?' %-encoded, once or more


def shown(text: str) -> str:
    """A reference as an error may show it: no query string (a signature), even %-encoded into
    the path, no user or password."""
    if text.startswith(("https://", "http://")):
        try:
            parts = urlsplit(text)
        except ValueError:  # a bracketed host that is no IPv6 address: nothing after it is shown
            return text.partition("://")[0] + "://(an unreadable host)"
        host = (parts.netloc.rpartition("@")[2]) or ""
        path = ENCODED_QUERY.split(parts.path, maxsplit=1)[0]
        return f"{parts.scheme}://{host}{path}"[:200]
    return text[:200]
