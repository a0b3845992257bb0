"""The URLs behind `url:` ids that this server may still need, which API keys named each, and
the URLs one request names: server state, owned by the app (`app.state.urls`, made in
`create_app`), bounded in count and bytes.

A `url:` id is a hash: fetching its file takes the URL it was made from, signature and all.
A request that names the URL carries it inside its `AdapterRef` to wherever the file is
fetched (this process's store, a rank, a Ray replica): nothing else needs this book. What
the book is for is a later request that names the adapter by its id: the URL is filled into
its ref from here (`scoped_refs`), for a key that named the URL before. So a URL is kept in
this server's memory (never in a file or a log), and only as long as that may happen:

- **held** from the parse of a request naming it until the request is answered
  (`NamedUrls`: `UrlBook.hold` / `release`), so that the request's own ids find it;
- then **kept** only if a request naming it was accepted (answered with success): in a
  least-recently-used table of at most `MAX_URLS` URLs and `MAX_BYTES` bytes of them, so
  that its id can be fetched again; a refused request's URLs are dropped when it is
  answered, so a client cannot grow this table by naming URLs it may not use;
- **pinned** while a kept adapter (`POST /adapters/{id}/load`) needs it, until `DELETE`.

Held and pinned URLs are never dropped to make room, nor counted in the bounds (so requests
in flight cannot push the kept ones out); what holds them is bounded elsewhere (the request
body's size and the queue, the host cache's budget). Each kept URL also remembers the API
keys (as fingerprints) whose accepted requests named it (`owned_by`): only they may name its
id (`auth.may_use_url_id`). All of it is lost with the process: after a restart, or once
the URL has dropped out of the book, its download belongs to no key until a key names the URL
again (admin keys aside), and is served by its id from the download folder alone.
"""
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from fastapi import Request

from loraswap.adapters.reference import AdapterRef
from loraswap.errors import AdapterNotFound
from loraswap.server.auth import may_use_url_id

MAX_URLS = 4096  # URLs kept after their requests (each at most 2,048 characters)
MAX_BYTES = 8 * 2**20  # the memory their strings take together


def url_bytes(url: str) -> int:
    """The memory a URL's string takes (1 to 4 bytes a character, and the object's own)."""
    return sys.getsizeof(url)


@dataclass
class _Entry:
    url: str
    holds: int = 0  # unanswered requests naming it
    accepted: bool = False  # a request naming it was accepted: kept once none holds it
    pinned: bool = False  # a kept adapter needs it
    owners: set[str] = field(default_factory=set)  # fingerprints of the keys whose accepted requests named it


class UrlBook:
    """The URLs by id: held, kept (LRU, bounded) or pinned, as the module's docstring says."""

    def __init__(self, max_urls: int = MAX_URLS, max_bytes: int = MAX_BYTES):
        self.max_urls, self.max_bytes = max_urls, max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._loose_urls = 0  # the entries nothing holds or pins (those bounded), and their URLs' bytes
        self._loose_bytes = 0
        self._lock = threading.Lock()

    def hold(self, adapter_id: str, url: str) -> None:
        """The URL is needed until a `release` of it: never dropped before."""
        with self._lock:
            entry = self._entry(adapter_id, url)
            self._change(entry, holds=entry.holds + 1)

    def release(self, adapter_id: str, accepted: bool, owner: str | None = None) -> None:
        """One `hold` of it ends; `accepted`: the request naming it was (kept, scoped to `owner`),
        else it is dropped unless something else holds it or it was kept before."""
        with self._lock:
            entry = self._entries.get(adapter_id)
            if entry is None or entry.holds == 0:
                return
            self._change(entry, holds=entry.holds - 1)
            if accepted:
                self._accept(adapter_id, entry, owner)
            elif not (entry.holds or entry.accepted or entry.pinned):
                self._drop(adapter_id)
            self._trim()

    def url(self, adapter_id: str) -> str | None:
        """The URL behind the id, if held, kept or pinned (a use: most recently used now)."""
        with self._lock:
            entry = self._entries.get(adapter_id)
            if entry is None:
                return None
            self._entries.move_to_end(adapter_id)
            return entry.url

    def pin(self, adapter_id: str) -> bool:
        """Never drop the URL until `unpin` (a kept adapter's); False when it is not known."""
        with self._lock:
            entry = self._entries.get(adapter_id)
            if entry is not None:
                entry.accepted = True
                self._change(entry, pinned=True)
            return entry is not None

    def unpin(self, adapter_id: str) -> None:
        with self._lock:
            entry = self._entries.get(adapter_id)
            if entry is not None:
                self._change(entry, pinned=False)
                self._trim()

    def owned_by(self, adapter_id: str, owner: str | None) -> bool:
        """Whether an accepted request made with the key `owner` named the URL."""
        with self._lock:
            entry = self._entries.get(adapter_id)
            return entry is not None and owner in entry.owners

    def size(self) -> tuple[int, int]:
        """(URLs, bytes of them) in the book, held ones included."""
        with self._lock:
            return len(self._entries), self._bytes

    def held(self) -> int:
        """How many URLs unanswered requests hold."""
        with self._lock:
            return self._held()

    def figures(self) -> tuple[int, int, int]:
        """(URLs, bytes of them, URLs held) at one moment: what `/metrics` reports."""
        with self._lock:
            return len(self._entries), self._bytes, self._held()

    def _held(self) -> int:
        return sum(1 for entry in self._entries.values() if entry.holds)

    def _entry(self, adapter_id: str, url: str) -> _Entry:
        entry = self._entries.get(adapter_id)
        if entry is None:
            entry = self._entries[adapter_id] = _Entry(url)
            self._bytes += url_bytes(url)
            self._count(entry, 1)
        return entry

    def _change(self, entry: _Entry, holds: int | None = None, pinned: bool | None = None) -> None:
        """Set the entry's holds or pin, keeping the count of loose (bounded) entries."""
        self._count(entry, -1)
        entry.holds = entry.holds if holds is None else holds
        entry.pinned = entry.pinned if pinned is None else pinned
        self._count(entry, 1)

    def _count(self, entry: _Entry, sign: int) -> None:
        if not (entry.holds or entry.pinned):
            self._loose_urls += sign
            self._loose_bytes += sign * url_bytes(entry.url)

    def _accept(self, adapter_id: str, entry: _Entry, owner: str | None) -> None:
        entry.accepted = True
        if owner is not None:
            entry.owners.add(owner)
        self._entries.move_to_end(adapter_id)

    def _drop(self, adapter_id: str) -> None:
        entry = self._entries.pop(adapter_id)
        self._bytes -= url_bytes(entry.url)
        self._count(entry, -1)

    def _trim(self) -> None:
        """Drop the least recently used URLs that nothing holds or pins until those are within the bounds."""
        while self._loose_urls > self.max_urls or self._loose_bytes > self.max_bytes:
            victim = next((a for a, e in self._entries.items() if not (e.holds or e.pinned)), None)
            if victim is None:
                return
            self._drop(victim)


class NamedUrls:
    """The URLs one request names, held in the app's `book` from its parse until it is answered
    (`release`): kept afterwards only if it was accepted, scoped to `owner` (its API key's
    fingerprint; None on a server without API keys)."""

    def __init__(self, book: UrlBook, owner: str | None = None):
        self.book, self.owner = book, owner
        self._held: dict[str, str] = {}  # url: id -> its URL

    def hold(self, ref: AdapterRef) -> None:
        """Hold the URL of a ref named by its URL."""
        if ref.url is not None and ref.adapter_id not in self._held:
            self.book.hold(ref.adapter_id, ref.url)
            self._held[ref.adapter_id] = ref.url

    def release(self, accepted: bool) -> None:
        """The request was answered (`accepted`: with success); a second call does nothing."""
        held, self._held = self._held, {}
        for adapter_id in held:
            self.book.release(adapter_id, accepted, self.owner)

    def named_by_url(self, adapter_id: str) -> bool:
        return adapter_id in self._held

    def url(self, adapter_id: str) -> str | None:
        """The URL behind the id: this request's own, else the book's."""
        return self._held.get(adapter_id) or self.book.url(adapter_id)


def scoped_refs(request: Request, named: NamedUrls | None, groups: list[list[AdapterRef]]) -> list[list[AdapterRef]]:
    """The request's adapters (`groups`, as it names them) with the URLs of their `url:` ids:
    each URL named held by `named` (the request's) until it is answered; an id named without
    its URL 404, as an unknown id, when the request's key never named the URL (another key's
    signed URL), else carrying the URL that this request or the app's book knows (None:
    served from the download folder alone). `named` None: a route that holds no URLs."""
    book: UrlBook = request.app.state.urls
    refs = [ref for group in groups for ref in group]
    for ref in refs if named is not None else ():
        named.hold(ref)
    by_id = sorted({ref.adapter_id for ref in refs if ref.source == "url" and ref.url is None})
    for adapter_id in by_id:
        named_here = named is not None and named.named_by_url(adapter_id)
        if not named_here and not may_use_url_id(request, adapter_id):
            raise AdapterNotFound(adapter_id, "this API key has named no URL with this id",
                                  "Name the adapter by its URL")
    urls = {adapter_id: named.url(adapter_id) if named is not None else book.url(adapter_id) for adapter_id in by_id}
    return [[ref.with_url(urls[ref.adapter_id]) if ref.adapter_id in urls else ref for ref in group]
            for group in groups]
