"""What the processes of one split image say to each other: every rank swapping the same
adapters before the same pipeline call.

Each rank holds the whole model, its own pristine copies and its own adapter store; the
model's split over them is `split.py`'s, and `ranked.RankedEngine` is the engine that uses
both. loraswap's swap writes into the weights in place, so it composes with the split by
construction: what it needs is that every rank swaps the same adapters before the same call.

Rank 0 serves HTTP and leads: before each batch it broadcasts the requests (seeds chosen) to
the other ranks (`Ranks.lead`), which `follow`: lease the requests' adapters from their own
store, apply them and make the same call. Whether every rank applied them, from the same
files, is agreed before generating (`Ranks.agree`). An adapter every rank refuses alike
changes nothing anywhere; when only some ranks could not apply them (or they read different
versions of a file), the ranks that changed their weights go back to the base model and the
leader answers with the failing rank's error. Each rank knows what it holds, so the next
request's swap starts from there. Beside that, rank 0 tells the others what its store does
(`Ranks.tell`: read a queued request's adapters, keep or evict one), so that they read a
never-seen adapter while earlier images are made, as rank 0 does.

A rank that dies, or one left stuck in a collective, leaves the process group unusable: every
rank exits (code 70) for the server's supervisor to start it again, all ranks anew; rank 0
first answers the requests it holds with a 503 (`loss.RankLoss`).
"""

import contextlib
import datetime
import functools
import logging
import pickle
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Literal, TypeVar

import torch
import torch.distributed as dist

from loraswap.engine.parallel.loss import RankLoss
from loraswap.errors import AdapterChanged, LoraswapError

if TYPE_CHECKING:
    from loraswap.adapters.reference import AdapterRef
    from loraswap.adapters.store import AdapterStore

logger = logging.getLogger(__name__)
T = TypeVar("T")
News = Literal["read", "keep", "evict", "stop"]  # what rank 0 tells the other ranks' stores (`Ranks.tell`)


class Ranks:
    """This process's place among the ranks, and the messages they exchange (Python objects
    over a gloo group, whatever carries the tensors)."""

    def __init__(self, wait_s: float):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # the followers wait here for the next request, however long the server idles
        self._objects = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
        # and here for each other at the end of an image, `wait_s` at most (`together`)
        self._ended = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=wait_s))
        # and here for what rank 0's store does that theirs should do too (`tell`), on threads of their own
        self._news = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        if self.leading:
            threading.Thread(target=self._send_news, name="loraswap-rank-news", daemon=True).start()
        self.wait_s = wait_s
        self._stopping = False  # the server stops its ranks: a broken wait is no failure then
        self.loss = RankLoss(self.rank)  # what this rank does once the ranks cannot go on

    @property
    def leading(self) -> bool:
        return self.rank == 0

    def lead(self, requests: list) -> None:
        """Rank 0: the batch every rank makes next (its adapter refs, URLs and all, pickled with
        the requests: another rank finds their files in the download folder, or fetches them
        again if they were evicted meanwhile)."""
        with self._in_step():
            dist.broadcast_object_list([("generate", requests)], src=0, group=self._objects)

    def stop(self) -> None:
        """Rank 0: the other ranks return from `follow`."""
        self._stopping = True
        self.tell("stop", [])
        dist.broadcast_object_list([("stop", None)], src=0, group=self._objects)

    def tell(self, verb: News, refs: list["AdapterRef"]) -> None:
        """Rank 0: what the other ranks' stores should do too, as this one does it: "read" a
        request's adapters as it is queued (so that every rank reads a never-seen adapter
        while earlier images are made, not after this rank leads its batch), "keep" or
        "evict" one."""
        self._outbox.put((verb, refs))

    def _send_news(self) -> None:
        while True:
            news = self._outbox.get()
            try:
                dist.broadcast_object_list([news], src=0, group=self._news)
            except Exception:  # the ranks are gone (stopped, or a dead one ends the server)
                logger.debug("rank 0: news not sent", exc_info=True)
                return
            if news[0] == "stop":
                return

    def listen(self, store: "AdapterStore") -> threading.Thread:
        """A follower: do to `store` what rank 0 tells, on a thread of its own until rank 0 stops."""
        thread = threading.Thread(target=self._follow_news, args=(store,), name="loraswap-rank-news", daemon=True)
        thread.start()
        return thread

    def _follow_news(self, store: "AdapterStore") -> None:
        while True:
            news = [None]
            dist.broadcast_object_list(news, src=0, group=self._news)
            verb, refs = news[0]
            if verb == "stop":
                return
            try:
                done = _do_as_told(store, verb, refs)
            except Exception as e:  # noqa: BLE001 - this rank reads it again when a request needs it
                done = Future()
                done.set_exception(e)
            done.add_done_callback(functools.partial(self._log_news, verb, refs))

    def _log_news(self, verb: News, refs: list["AdapterRef"], done: Future) -> None:
        if done.exception() is not None:  # this rank reads it again when a request needs it
            logger.warning("rank %d: could not %s %s here: %s", self.rank, verb, refs[0].adapter_id,
                           done.exception())
        else:
            logger.log(logging.DEBUG if verb == "read" else logging.INFO, "rank %d: %s %s", self.rank, verb,
                       ", ".join(ref.adapter_id for ref in refs))

    def receive(self) -> tuple[str, list | None]:
        """A follower: the next message from rank 0 (verb, requests)."""
        message = [None]
        dist.broadcast_object_list(message, src=0, group=self._objects)
        return message[0]

    def agree(self, error: BaseException | None, versions: tuple = ()) -> BaseException | None:
        """Whether every rank applied the adapters: the first failing rank's error (this rank's
        own object when it is this one, traceback kept); or, when all applied them but from
        different files (one replaced between the ranks' reads), an error saying so; else None."""
        outcomes: list = [None] * self.world
        with self._in_step():
            dist.all_gather_object(outcomes, (sendable(error), versions), group=self._objects)
        failed = next((rank for rank, (e, _) in enumerate(outcomes) if e is not None), None)
        if failed is not None:
            return error if failed == self.rank else outcomes[failed][0]
        held = [v for _, v in outcomes]  # every rank leased the same ids, in the same order
        if len(set(held)) > 1:
            changed = next((ids[0][0] for ids in zip(*held) if len(set(ids)) > 1), versions[0][0])
            return AdapterChanged(changed, "its file changed while the processes read it, so they read "
                                           "different versions", "Ask again once the file is written")
        return None

    def together(self, make: Callable[[], T]) -> T:
        """`make()` (an image), then wait for every rank to end it too, failed or not: they end
        it within moments of each other, their steps joined by collectives. A rank that does
        not within `wait_s` is stuck in a collective that a failure on one rank alone (a GPU
        out of memory) left unanswered: the ranks are out of step for good (`RankLoss.give_up`)."""
        try:
            made = make()
        except BaseException as e:
            if not self.leading:  # rank 0 answers the request with it; here it would go unseen
                logger.warning("rank %d: the image failed here: %s", self.rank, e)
            self._wait_for_the_others()
            raise
        self._wait_for_the_others()
        return made

    def _wait_for_the_others(self) -> None:
        try:
            # the GPU's queued collectives first: ranks that failed at different points would pass the
            # barrier with one left unmatched on a stream (the next image would pair them one step off);
            # then a rank stuck here is one the others wait for in vain
            if dist.get_backend() == "nccl":
                torch.cuda.synchronize()  # every stream: NCCL runs its collectives on its own
            dist.monitored_barrier(group=self._ended, timeout=datetime.timedelta(seconds=self.wait_s))
        except Exception as e:  # noqa: BLE001 - whatever the backend raises, the ranks cannot go on
            if self._stopping:  # the server stops them (a rank killed for being slow to stop): no failure
                raise
            logger.error("rank %d: the ranks did not all end the image (waiting %g s at most): %s. A failure on one "
                         "rank alone leaves the others waiting for good", self.rank, self.wait_s, _first_line(e))
            raise self.loss.give_up("the processes did not all end an image") from e

    @contextlib.contextmanager
    def _in_step(self) -> Iterator[None]:
        """A message between the ranks: one that fails (a rank gone) leaves them unable to go on."""
        try:
            yield
        except Exception as e:
            if self._stopping:
                raise
            logger.error("rank %d: a message between the ranks failed: %s", self.rank, _first_line(e))
            raise self.loss.give_up("a message between the processes failed") from e


def _first_line(error: BaseException) -> str:
    return (str(error) or type(error).__name__).splitlines()[0]


def _do_as_told(store: "AdapterStore", verb: News, refs: list["AdapterRef"]) -> Future:
    """A follower's store does what rank 0's did, reading on its own threads (a file from
    elsewhere is fetched once, by whichever rank comes first, into the download folder they
    share); done when it is."""
    if verb == "read":
        return store.read_ahead(refs)
    if verb == "keep":
        return store.keep_ahead(refs[0])
    store.cache.evict(refs[0].adapter_id)  # "evict" (rank 0 removes a download from the shared folder)
    done = Future()
    done.set_result(None)
    return done


def sendable(error: BaseException | None) -> BaseException | None:
    """`error` as another process can rebuild it; if it cannot be pickled, its type and message
    (a rank whose error failed to send would skip the collective and leave the others in it)."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any failure to pickle or rebuild
        sent = LoraswapError(f"{type(error).__name__}: {error}")
        sent.status = getattr(error, "status", LoraswapError.status)  # a 4xx stays one
        return sent


def follow(engine, ranks: Ranks) -> None:
    """A rank other than 0: make every batch rank 0 leads, until it says stop."""
    engine.use_ranks(ranks)
    news = ranks.listen(engine.adapters)
    while True:
        verb, requests = ranks.receive()
        if verb == "stop":
            news.join(5)  # told to stop first: its last collective ends at once
            return
        try:
            lease = engine.lender.lease_now(requests[0].loras)
        except Exception as e:  # this rank cannot read them: the ranks that applied them go back to the base
            logger.warning("rank %d: the adapters could not be read here: %s", ranks.rank, e)
            ranks.agree(e)
            continue
        with lease:
            try:
                engine.generate_batch(requests, lease)
            except Exception:  # logged where it failed; the leader answers for it; the ranks stay in step
                logger.debug("rank %d: batch failed", ranks.rank, exc_info=True)
