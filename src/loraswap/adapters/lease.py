"""A lease: the adapters one request holds, from the store's `lease` until it is given back.

While a lease holds an adapter, the cache never evicts it, so the swap finds it where it
was read. Whoever takes a lease gives it back, once (`release`; later calls do nothing):
in the server that is the GPU worker, for every request, served or dropped.
"""

import threading
from collections.abc import Callable


class Lease:
    def __init__(self, held: list[tuple[object, float]], give_back: Callable[[object], None] | None = None):
        self.held = held  # (what the swapper takes: a cache entry, or a baseline's file; weight)
        self._give_back = give_back  # called once per held item on release; None: nothing is held
        self._lock = threading.Lock()
        self._released = False

    @property
    def ids(self) -> tuple[tuple[str, float], ...]:
        """(adapter id, weight) of each adapter held, in the request's order."""
        return tuple((item.adapter_id, weight) for item, weight in self.held)

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        if self._give_back is not None:
            for item, _ in self.held:
                self._give_back(item)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
