"""What the ranks of a context-parallel engine do once they cannot go on.

A rank that dies, or one stuck in a collective that the others left, leaves the process group
unusable: a collective that failed cannot be taken up again. So every rank exits (code 70)
for the server's supervisor (systemd, Kubernetes, Ray Serve) to start it again, every rank
anew. A follower exits at once; rank 0, which serves HTTP, first answers every request it
holds, and each new one, with a 503 (`RanksLost`, with Retry-After), then exits.
"""

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from loraswap.errors import LoraswapError

logger = logging.getLogger(__name__)

EXIT_FOR_RESTART = 70  # EX_SOFTWARE: the ranks cannot go on; the supervisor starts the server again
# rank 0: the time its 503s have to reach their clients before it exits (the event loop sends
# them within milliseconds of the worker failing the requests)
ANSWER_S = 2.0


class RanksLost(LoraswapError):
    """A rank died, or fell out of step with the others: the server restarts (503, Retry-After)."""

    status = 503


class RankLoss:
    """One rank's side of the ranks being lost: said once (`give_up`), by whichever thread
    finds out first (a collective that failed, a rank seen exiting)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.error: RanksLost | None = None  # once the ranks are lost
        self._lock = threading.Lock()
        self._answers: list[Callable[[RanksLost], None]] = []

    def when_lost(self, answer: Callable[[RanksLost], None]) -> None:
        """Rank 0: `answer(error)` once the ranks are lost (its GPU worker fails every request
        it holds, and each new one, with the error)."""
        self._answers.append(answer)

    def give_up(self, why: str) -> RanksLost:
        """Exit for a restart: a follower at once; rank 0 once it has answered what it holds
        (`when_lost`), `ANSWER_S` later. Returns the error for the caller to raise where it
        needed the ranks (the same one every time)."""
        with self._lock:
            first = self.error is None
            if first:
                self.error = RanksLost(f"one of the processes that make this server's images failed ({why}); "
                                       "the server restarts: retry shortly")
        if first:
            leading = self.rank == 0
            logger.error("rank %d: the ranks cannot go on (%s): exiting for a restart (code %d)%s", self.rank, why,
                         EXIT_FOR_RESTART, ", once the requests held are answered" if leading else "")
            if not leading:  # no client waits on a follower
                exit_for_restart()
            # the exit first: an answer that fails or hangs must not keep the process up
            threading.Thread(target=exit_for_restart, args=(ANSWER_S,), name="loraswap-rank-exit", daemon=True).start()
            for answer in self._answers:
                answer(self.error)
        return self.error


def exit_for_restart(after_s: float = 0.0) -> NoReturn:
    """End this process `after_s` from now with code 70, its logs flushed first."""
    time.sleep(after_s)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(EXIT_FOR_RESTART)
