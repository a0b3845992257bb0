"""What a user may name as an adapter, and the id it is then served, cached and listed under.

A name is an adapter id of the folder or the hub (`style/anime`, `owner/name@rev`, checked
by `source.check_adapter_id`), or a reference to a file elsewhere, which becomes an id of
the form `SOURCE:...`. A colon never appears in a folder or hub id, so the two cannot be
confused, and everything after the edge (routing, the cache, `GET /adapters`, errors,
logs) sees only ids:

- `https://host/path/x.safetensors?signature=...` -> `url:<sha256 of the URL, 32 hex>`.
  The URL itself, signature and all, is kept in this process's memory only (`url_book.py`:
  held while a request naming it is unanswered, kept afterwards only if the request was
  accepted, bounded): never in an id, a log line or an error. The one file it is written to
  is a queued video job's row in the state folder (readable by the server's user only), so
  that a job whose download a restart interrupted is fetched again and made. A download
  cached on disk is served by its id after a restart; once evicted, it is fetched again only
  by its URL. Which API keys named the URL (`NamedUrls.owner`: only they may name its id) is
  kept with the URL, in memory only, and lost with it: after a restart, or once the URL has
  dropped out of the book, its download belongs to no key until a key names the URL again
  (admin keys aside); nothing is opened to another key (docs/adapters.md says so to users).
- `civitai:MODEL@VERSION`, or an AIR `urn:air:ECOSYSTEM:lora:civitai:MODEL@VERSION` ->
  `civitai:MODEL@VERSION` (the AIR's ecosystem is a hint of the base model).
- `s3://bucket/key` -> `s3:bucket/key`.
"""

import hashlib
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from loraswap.adapters.sources.local import check_adapter_id
from loraswap.adapters.sources.url_book import UrlBook
from loraswap.errors import BadRequest

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


@dataclass(frozen=True)
class UrlReference:
    url: str

    @property
    def adapter_id(self) -> str:
        return "url:" + hashlib.sha256(self.url.encode()).hexdigest()[:32]


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

_book = UrlBook()  # url:<hash> -> the URL it was made from, while this process may need it


class NamedUrls:
    """The URLs one request names, held from its parse until it is answered (`release`):
    kept afterwards only if it was accepted, scoped to `owner` (its API key's fingerprint;
    None on a server without API keys). Also the `url:` ids it names by id, not by URL
    (`by_id`), which only the keys that named their URL may use."""

    def __init__(self, owner: str | None = None):
        self.owner = owner
        self.by_id: set[str] = set()
        self._held: set[str] = set()

    def add(self, reference: "UrlReference") -> None:
        if reference.adapter_id not in self._held:
            _book.hold(reference.adapter_id, reference.url)
            self._held.add(reference.adapter_id)

    def release(self, accepted: bool) -> None:
        """The request was answered (`accepted`: with success); a second call does nothing."""
        held, self._held = self._held, set()
        for adapter_id in held:
            _book.release(adapter_id, accepted, self.owner)

    def named_by_url(self, adapter_id: str) -> bool:
        return adapter_id in self._held


def looks_like_reference(text: str) -> bool:
    """Whether `text` names a file elsewhere (or is such a file's id), not a folder or hub id."""
    return text.startswith(REFERENCE_PREFIXES)


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


def adapter_id_of(text: str, named: NamedUrls | None = None) -> str:
    """The id `text` is served under: itself for a folder or hub id (checked), else its
    reference's id. A URL is held by `named`, the request's (so that its id can be fetched
    while the request is unanswered); without one (a one-shot caller, the CLI) it is kept
    as an accepted request's would be."""
    if not looks_like_reference(text):
        return check_adapter_id(text)
    if URL_ID.match(text):
        if named is not None:
            named.by_id.add(text)
        return text
    reference = parse_reference(text)
    if isinstance(reference, UrlReference):
        if named is not None:
            named.add(reference)
        else:
            _book.remember(reference.adapter_id, reference.url)
    return reference.adapter_id


def urls_of(adapter_ids) -> dict[str, str]:
    """The URLs behind the `url:` ids among `adapter_ids` that this process holds or keeps: for
    a process that must fetch them without having seen the request (a Ray replica on another node)."""
    return {a: url for a in adapter_ids if (url := _book.url(a)) is not None}


def remember_urls(urls: dict[str, str]) -> None:
    """Keep the URLs another process accepted (`urls_of`), each only under the id its own hash
    gives (bounded as every kept URL is)."""
    for adapter_id, url in urls.items():
        reference = _url(url)
        if reference.adapter_id != adapter_id:
            raise BadRequest(f"the URL handed over for {adapter_id} is another's")
        _book.remember(adapter_id, reference.url)


def pin_url(adapter_id: str) -> None:
    """A kept adapter's URL is never dropped until `unpin_url` (`POST /adapters/{id}/load`)."""
    _book.pin(adapter_id)


def unpin_url(adapter_id: str) -> None:
    _book.unpin(adapter_id)


def url_owned_by(adapter_id: str, owner: str | None) -> bool:
    """Whether an accepted request made with the key `owner` (a fingerprint) named the URL
    behind `adapter_id`."""
    return _book.owned_by(adapter_id, owner)


def url_book() -> UrlBook:
    """This process's URLs (for its size, in tests and figures)."""
    return _book


def check_id(adapter_id: str) -> str:
    """`adapter_id` if it is a folder, hub or reference id (`adapter_id_of`'s output), else BadRequest."""
    if not is_remote(adapter_id):
        return check_adapter_id(adapter_id)
    well_formed = URL_ID.match(adapter_id) if adapter_id.startswith("url:") else \
        parse_reference(adapter_id).adapter_id == adapter_id
    if not well_formed:
        raise BadRequest(f"invalid adapter id {shown(adapter_id)!r}")
    return adapter_id


def is_remote(adapter_id: str) -> bool:
    """Whether the id is one of a file elsewhere (`url:`, `civitai:`, `s3:`)."""
    return adapter_id.startswith(REMOTE_PREFIXES)


def reference_of(adapter_id: str) -> Reference | None:
    """The reference behind a `url:`, `civitai:` or `s3:` id (a `url:` id only if this process
    saw its URL); None for a folder or hub id, or a URL not seen."""
    if adapter_id.startswith("url:"):
        url = _book.url(adapter_id)
        return UrlReference(url) if url is not None else None
    if adapter_id.startswith(("civitai:", "s3:")):
        return parse_reference(adapter_id)
    return None


def source_of(adapter_id: str) -> str:
    """Where a remote id's file comes from: `url`, `civitai` or `s3`."""
    return adapter_id.split(":", 1)[0]


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
