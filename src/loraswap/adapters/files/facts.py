"""What was found out about each adapter's file (whether it fits a model, where it lies),
remembered while the file is unchanged.

Ids have no end: every distinct URL is a `url:` id of its own, and a client can name as many
as it likes, refused ones included. So the table is bounded: the least recently used entry
goes first, past as many entries as the URL book keeps URLs. A forgotten entry costs one
more look at the file's header, no more.
"""

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

MAX_ENTRIES = 4096  # as many as the URL book keeps URLs (url_book.MAX_URLS)

T = TypeVar("T")


class FileFacts(Generic[T]):
    """adapter id -> (its file's stamp, what was found of that file), least recently used
    dropped first past `max_entries`. The store's threads share it."""

    def __init__(self, max_entries: int = MAX_ENTRIES):
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[tuple, T]] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def get(self, adapter_id: str, stamp: tuple) -> T | None:
        """What was found of the file, if it has not changed since (its `stamp`), else None."""
        with self._lock:
            known = self._entries.get(adapter_id)
            if known is None or known[0] != stamp:
                return None
            self._entries.move_to_end(adapter_id)
            return known[1]

    def put(self, adapter_id: str, stamp: tuple, value: T) -> None:
        with self._lock:
            self._entries[adapter_id] = (stamp, value)
            self._entries.move_to_end(adapter_id)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def drop(self, adapter_id: str) -> None:
        """Forget the adapter (its download was deleted, say)."""
        with self._lock:
            self._entries.pop(adapter_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
