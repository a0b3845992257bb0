"""Where model replicas report, and how the ingress reaches every replica of a model.

Ray Serve routes each request to one replica; it has no call to all of them. So each
replica sends `Reports.put` its figures and cache table every `report_interval_s` (and
right after an adapter load or keep), and gets back the commands waiting for it. The
ingress reads the merged reports for /metrics and /adapters, and `evict` (for
`DELETE /adapters/{id}`) queues a command for every live replica of a model and waits
until each has done it and reported again.

A replica that stops reporting (killed, or stopped) keeps its counters in the totals,
so they never go backwards, but its gauges and cache table no longer count.
"""

import asyncio
import itertools
import time
from collections import defaultdict

MAX_GONE = 256  # reports of replicas gone that are kept for their counters


class Reports:
    """A Ray Serve deployment with one replica; replicas and the ingress call it through handles."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._rows: dict[str, dict] = {}  # replica id -> its latest report
        self._seen: dict[str, float] = {}  # replica id -> when it last reported (monotonic)
        self._stopped: set[str] = set()
        self._pending: dict[str, list[tuple[int, str, str]]] = defaultdict(list)  # replica -> commands
        self._waiting: dict[int, tuple[set[str], asyncio.Event]] = {}  # command -> replicas yet to do it
        self._ids = itertools.count(1)

    @property
    def _stale_after_s(self) -> float:
        return max(4 * self.interval_s, 3.0)

    def _alive(self, replica: str, now: float) -> bool:
        return replica not in self._stopped and now - self._seen[replica] < self._stale_after_s

    async def put(self, report: dict, done: list[int], stopped: bool = False) -> list[tuple[int, str, str]]:
        """Store a replica's report (newer than the one held) and the commands it has done;
        return the commands now waiting for it: (id, verb, adapter id)."""
        replica = report["replica"]
        held = self._rows.get(replica)
        if held is None or held["seq"] < report["seq"]:
            self._rows[replica] = report
        self._seen[replica] = time.monotonic()
        if stopped:
            self._stopped.add(replica)
        for command in done:
            waiting = self._waiting.get(command)
            if waiting is not None:
                waiting[0].discard(replica)
                if not waiting[0]:
                    waiting[1].set()
        self._forget_old()
        return [] if stopped else self._pending.pop(replica, [])

    async def collect(self) -> list[dict]:
        """Every replica's latest report, with `alive`; cache tables only for live ones."""
        now = time.monotonic()
        rows = []
        for replica, row in self._rows.items():
            alive = self._alive(replica, now)
            rows.append({**row, "alive": alive, **({} if alive else {"cache": [], "held": []})})
        return rows

    async def evict(self, deployment: str, adapter_id: str, timeout_s: float | None = None) -> int:
        """Have every live replica of `deployment` stop keeping and evict the adapter; how many did."""
        now = time.monotonic()
        targets = {r for r, row in self._rows.items() if row["deployment"] == deployment and self._alive(r, now)}
        if not targets:
            return 0
        command, event = next(self._ids), asyncio.Event()
        self._waiting[command] = (set(targets), event)
        for replica in targets:
            self._pending[replica].append((command, "evict", adapter_id))
        try:
            await asyncio.wait_for(event.wait(), timeout_s or self._stale_after_s + 2 * self.interval_s)
        except TimeoutError:
            pass  # a replica that died meanwhile holds nothing
        remaining, _ = self._waiting.pop(command)
        return len(targets) - len(remaining)

    def _forget_old(self) -> None:
        now = time.monotonic()
        gone = sorted((r for r in self._rows if not self._alive(r, now)), key=self._seen.get)
        for replica in gone[:max(0, len(gone) - MAX_GONE)]:
            del self._rows[replica], self._seen[replica]
            self._stopped.discard(replica)
            self._pending.pop(replica, None)
