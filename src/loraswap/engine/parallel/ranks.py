"""One image across several processes (one GPU each): diffusers' context parallelism on the
denoiser, every rank swapping the same adapters in step.

Each rank holds the whole model, its own pristine copies and its own adapter store, and
diffusers splits the sequence of each attention layer over the ranks (Ulysses: all-to-all
over heads; ring: key/value blocks passed round). loraswap's swap writes into the weights in
place, so it composes with that by construction: what it needs is that every rank swaps the
same adapters before the same pipeline call.

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
first answers the requests it holds with a 503 (`rank_loss.RankLoss`).
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from loraswap.adapters.naming.references import remember_urls, urls_of
from loraswap.engine.parallel.loss import RankLoss
from loraswap.errors import AdapterChanged, BadRequest, LoraswapError
from loraswap.models.family import Family

if TYPE_CHECKING:
    from loraswap.adapters.store import AdapterStore

logger = logging.getLogger(__name__)
T = TypeVar("T")
News = Literal["read", "keep", "evict", "stop"]  # what rank 0 tells the other ranks' stores (`Ranks.tell`)


@dataclass(frozen=True)
class Parallelism:
    """How one image is spread over processes: its sequence over `ulysses` x `ring` of them,
    and (`cfg` 2) the two passes of classifier-free guidance over two such groups."""

    ulysses: int = 1
    ring: int = 1
    cfg: int = 1

    @property
    def sequence(self) -> int:
        """The processes one pass's sequence is split over."""
        return self.ulysses * self.ring

    @property
    def world(self) -> int:
        return self.cfg * self.sequence


# attention backends that return the log-sum-exp ring attention merges its blocks with (PyTorch's
# own SDPA does not); on the CPU there is none
RING_BACKENDS = ("_native_cudnn", "_native_flash", "flash", "_flash_3_hub", "sage")


def check_ring_attention(parallelism: Parallelism, attention: str | None) -> None:
    """Ring attention merges its blocks with their log-sum-exp, which only some backends return."""
    if parallelism.ring > 1 and attention not in RING_BACKENDS:
        raise ValueError(f"--ring-degree needs an attention backend that returns the log-sum-exp: --attention "
                         f"{' or '.join(RING_BACKENDS)} (CUDA); {attention or 'the default'} does not. Or use "
                         "--ulysses-degree alone")


# families whose split sequences always divide: image tokens (checked per request; an edit's
# input image is sized by its pipeline in multiples of 32 pixels, so its tokens divide by 4),
# a text sequence padded to a fixed length, or (Qwen-Image) the prompt's own length, padded here
FAMILIES = ("flux", "flux-kontext", "flux2", "wan", "qwen-image", "qwen-image-edit")
# families whose plan splits the prompt's text: padded with masked tokens (`pad_text_to_split`),
# which ring attention cannot take (it applies each rank's own mask to every block of keys),
# nor attention backends that refuse a mask: these take one
TEXT_SPLIT = ("qwen-image", "qwen-image-edit")
MASKED_BACKENDS = (None, "native", "_native_efficient", "_native_math")


def check_parallelizable(denoiser: torch.nn.Module, parallelism: Parallelism, model: str,
                         attention: str | None = None, family: Family | None = None) -> None:
    """Refuse a family loraswap does not split, a denoiser diffusers cannot split, a degree its
    heads do not divide by, or ring attention with a backend that cannot merge its blocks."""
    check_ring_attention(parallelism, attention)
    name = family.name if family is not None else None
    if name not in FAMILIES or getattr(type(denoiser), "_cp_plan", None) is None:
        raise ValueError(f"{model} ({name or type(denoiser).__name__}) is not split over processes: "
                         f"--ulysses-degree and --ring-degree take the {', '.join(FAMILIES)} families")
    if name in TEXT_SPLIT and parallelism.ring > 1:
        raise ValueError(f"{model} splits its prompt's text, padded with masked tokens, which ring attention does "
                         "not take: use --ulysses-degree")
    if name in TEXT_SPLIT and attention not in MASKED_BACKENDS:
        raise ValueError(f"{model} splits its prompt's text, padded with masked tokens, which --attention "
                         f"{attention} does not take: use PyTorch's default (or native, _native_efficient)")
    heads = getattr(denoiser.config, "num_attention_heads", None)
    if heads is not None and heads % parallelism.ulysses:
        raise ValueError(f"{model} has {heads} attention heads, which --ulysses-degree {parallelism.ulysses} does "
                         "not divide: choose a divisor of the head count, or use --ring-degree")


def device_mesh(parallelism: Parallelism, device_type: str) -> DeviceMesh:
    """The ranks as a mesh: `cfg` x `ring` x `ulysses` (every rank calls it, in the same order),
    on the engines' device type ("cuda": NCCL; "cpu": gloo)."""
    if not dist.is_initialized() or dist.get_world_size() != parallelism.world:
        raise RuntimeError(f"{parallelism.world} ranks need a process group of that size")
    return init_device_mesh(device_type, (parallelism.cfg, parallelism.ring, parallelism.ulysses),
                            mesh_dim_names=("cfg", "ring", "ulysses"))


def enable_context_parallel(denoiser: torch.nn.Module, mesh: DeviceMesh, model: str,
                            attention: str | None = None, family: Family | None = None) -> None:
    """Split the denoiser's sequence over the mesh's ring and ulysses dimensions (each half of
    the cfg dimension splits its own pass)."""
    from diffusers import ContextParallelConfig

    parallelism = Parallelism(mesh["ulysses"].size(), mesh["ring"].size(), mesh["cfg"].size())
    check_parallelizable(denoiser, parallelism, model, attention, family)
    config = ContextParallelConfig(ulysses_degree=parallelism.ulysses if parallelism.ulysses > 1 else None,
                                   ring_degree=parallelism.ring if parallelism.ring > 1 else None, mesh=mesh)
    with _one_device_per_cpu_rank():
        denoiser.enable_parallelism(config=config)
    if family is not None and family.name in TEXT_SPLIT:
        pad_text_to_split(denoiser, parallelism.sequence)


def pad_text_to_split(denoiser: torch.nn.Module, pieces: int) -> None:
    """The plan splits the prompt's text into `pieces`: pad it to a multiple of them with tokens
    the attention mask hides, so no image or text token attends to them. The real tokens keep
    their positions (rotary embeddings count from the first), so the image is the one unpadded.
    Every call gets a mask, padded or not, so a compiled model sees one kind of call."""

    def pad(module, args: tuple, kwargs: dict):
        text = kwargs.get("encoder_hidden_states")
        if text is None:
            return None
        extra = -text.shape[1] % pieces
        mask = kwargs.get("encoder_hidden_states_mask")
        mask = text.new_ones(text.shape[:2], dtype=torch.bool) if mask is None else mask.to(torch.bool)
        return args, dict(kwargs, encoder_hidden_states=F.pad(text, (0, 0, 0, extra)),
                          encoder_hidden_states_mask=F.pad(mask, (0, extra), value=False))

    denoiser.register_forward_pre_hook(pad, with_kwargs=True)


@contextlib.contextmanager
def _one_device_per_cpu_rank() -> Iterator[None]:
    """diffusers places rank r on device r % device_count(): 0 devices on a CPU build (a
    modulo by zero). Ranks on the CPU all share it."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    with mock.patch.object(torch.accelerator, "device_count", lambda: 1):
        yield


def check_sequence(tokens: int, parallelism: Parallelism, with_input: bool = False) -> None:
    """A sequence the ranks split must divide into equal pieces (a gather of unequal ones fails):
    the output's tokens, and (`with_input`) an edit's input image's beside them."""
    pieces = parallelism.sequence
    if tokens % pieces == 0:
        return
    if with_input:
        raise BadRequest(f"this size and input image make {tokens} tokens, which do not split over {pieces} ranks: "
                         f"choose an output size and input image whose tokens (width / 16 x height / 16 each) add "
                         f"up to a multiple of {pieces}")
    raise BadRequest(f"this size makes {tokens} image tokens, which do not split over {pieces} "
                     f"ranks: choose a width and height whose tokens divide by {pieces}")


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
        """Rank 0: the batch every rank makes next, with the URLs behind its `url:` adapter ids
        (another process knows only the ids: it finds their files in the download folder, or
        fetches them again if they were evicted meanwhile)."""
        urls = urls_of(adapter_id for request in requests for adapter_id, _ in request.loras)
        with self._in_step():
            dist.broadcast_object_list([("generate", requests, urls)], src=0, group=self._objects)

    def stop(self) -> None:
        """Rank 0: the other ranks return from `follow`."""
        self._stopping = True
        self.tell("stop", [])
        dist.broadcast_object_list([("stop", None, {})], src=0, group=self._objects)

    def tell(self, verb: News, loras: list[tuple[str, float]]) -> None:
        """Rank 0: what the other ranks' stores should do too, as this one does it: "read" a
        request's adapters as it is queued (so that every rank reads a never-seen adapter
        while earlier images are made, not after this rank leads its batch), "keep" or
        "evict" one."""
        self._outbox.put((verb, loras, urls_of(adapter_id for adapter_id, _ in loras)))

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
            verb, loras, urls = news[0]
            if verb == "stop":
                return
            try:
                remember_urls(urls)
                done = _do_as_told(store, verb, loras)
            except Exception as e:  # noqa: BLE001 - this rank reads it again when a request needs it
                done = Future()
                done.set_exception(e)
            done.add_done_callback(functools.partial(self._log_news, verb, loras))

    def _log_news(self, verb: News, loras: list[tuple[str, float]], done: Future) -> None:
        if done.exception() is not None:  # this rank reads it again when a request needs it
            logger.warning("rank %d: could not %s %s here: %s", self.rank, verb, loras[0][0], done.exception())
        else:
            logger.log(logging.DEBUG if verb == "read" else logging.INFO, "rank %d: %s %s", self.rank, verb,
                       ", ".join(adapter_id for adapter_id, _ in loras))

    def receive(self) -> tuple[str, list | None, dict[str, str]]:
        """A follower: the next message from rank 0 (verb, requests, URLs)."""
        message = [None]
        dist.broadcast_object_list(message, src=0, group=self._objects)
        return message[0]

    def agree(self, error: BaseException | None, versions: tuple = ()) -> BaseException | None:
        """Whether every rank applied the adapters: the first failing rank's error (this rank's
        own object when it is this one, traceback kept); or, when all applied them but from
        different files (one replaced between the ranks' reads), an error saying so; else None."""
        outcomes: list = [None] * self.world
        with self._in_step():
            dist.all_gather_object(outcomes, (_sendable(error), versions), group=self._objects)
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


def _do_as_told(store: "AdapterStore", verb: News, loras: list[tuple[str, float]]) -> Future:
    """A follower's store does what rank 0's did, reading on its own threads (a file from
    elsewhere is fetched once, by whichever rank comes first, into the download folder they
    share); done when it is."""
    if verb == "read":
        return store.read_ahead(loras)
    if verb == "keep":
        return store.keep_ahead(loras[0][0])
    store.cache.evict(loras[0][0])  # "evict" (rank 0 removes a download from the shared folder)
    done = Future()
    done.set_result(None)
    return done


def _sendable(error: BaseException | None) -> BaseException | None:
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
        verb, requests, urls = ranks.receive()
        if verb == "stop":
            news.join(5)  # told to stop first: its last collective ends at once
            return
        try:
            remember_urls(urls)
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
