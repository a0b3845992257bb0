"""One image across several processes (one GPU each): diffusers' context parallelism on the
denoiser, every rank swapping the same adapters in step.

Each rank holds the whole model, its own pristine copies and its own adapter store, and
diffusers splits the sequence of each attention layer over the ranks (Ulysses: all-to-all
over heads; ring: key/value blocks passed round). loraswap's swap writes into the weights in
place, so it composes with that by construction: what it needs is that every rank swaps the
same adapters before the same pipeline call.

Rank 0 serves HTTP and leads: before each batch it broadcasts the requests (seeds chosen) to
the other ranks (`Ranks.lead`), which `follow`: lease the requests' adapters from their own
store, apply them and make the same call. Whether every rank applied them is agreed before
generating (`Ranks.agree`): when one could not, every rank goes back to the base model and
the leader answers with that rank's error, so a refused or failed swap on any rank leaves
every rank as it was.
"""

import contextlib
import datetime
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist

from ..errors import BadRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Parallelism:
    ulysses: int = 1
    ring: int = 1

    @property
    def world(self) -> int:
        return self.ulysses * self.ring


# attention backends that return the log-sum-exp ring attention merges its blocks with (PyTorch's
# own SDPA does not); on the CPU there is none
RING_BACKENDS = ("_native_cudnn", "_native_flash", "flash", "_flash_3_hub", "sage")


def check_ring_attention(parallelism: Parallelism, attention: str | None) -> None:
    """Ring attention merges its blocks with their log-sum-exp, which only some backends return."""
    if parallelism.ring > 1 and attention not in RING_BACKENDS:
        raise ValueError(f"--ring-degree needs an attention backend that returns the log-sum-exp: --attention "
                         f"{' or '.join(RING_BACKENDS)} (CUDA); {attention or 'the default'} does not. Or use "
                         "--ulysses-degree alone")


# families whose split sequences always divide: image tokens (checked per request) and a text
# sequence padded to a fixed length. Qwen-Image's plan also splits its text, which is the
# prompt's own length: not yet.
FAMILIES = ("flux", "flux-kontext", "flux2", "wan")


def check_parallelizable(denoiser: torch.nn.Module, parallelism: Parallelism, model: str,
                         attention: str | None = None, family=None) -> None:
    """Refuse a family loraswap does not split, a denoiser diffusers cannot split, a degree its
    heads do not divide by, or ring attention with a backend that cannot merge its blocks."""
    check_ring_attention(parallelism, attention)
    name = family.name if family is not None else None
    if name not in FAMILIES or getattr(type(denoiser), "_cp_plan", None) is None:
        raise ValueError(f"{model} ({name or type(denoiser).__name__}) is not split over processes: "
                         f"--ulysses-degree and --ring-degree take the {', '.join(FAMILIES)} families")
    heads = getattr(denoiser.config, "num_attention_heads", None)
    if heads is not None and heads % parallelism.ulysses:
        raise ValueError(f"{model} has {heads} attention heads, which --ulysses-degree {parallelism.ulysses} does "
                         "not divide: choose a divisor of the head count, or use --ring-degree")


def enable_context_parallel(denoiser: torch.nn.Module, parallelism: Parallelism, model: str,
                            attention: str | None = None, family=None) -> None:
    """Split the denoiser's sequence over the process group (initialized by the caller)."""
    from diffusers import ContextParallelConfig

    check_parallelizable(denoiser, parallelism, model, attention, family)
    if not dist.is_initialized() or dist.get_world_size() != parallelism.world:
        raise RuntimeError(f"context parallelism over {parallelism.world} ranks needs a process group of that size")
    config = ContextParallelConfig(ulysses_degree=parallelism.ulysses if parallelism.ulysses > 1 else None,
                                   ring_degree=parallelism.ring if parallelism.ring > 1 else None)
    with _one_device_per_cpu_rank():
        denoiser.enable_parallelism(config=config)


@contextlib.contextmanager
def _one_device_per_cpu_rank() -> Iterator[None]:
    """diffusers places rank r on device r % device_count(): 0 devices on a CPU build (a
    modulo by zero). Ranks on the CPU all share it."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    with mock.patch.object(torch.accelerator, "device_count", lambda: 1):
        yield


def check_sequence(tokens: int, parallelism: Parallelism) -> None:
    """A sequence the ranks split must divide into equal pieces (a gather of unequal ones fails)."""
    if tokens % parallelism.world:
        raise BadRequest(f"this size makes {tokens} image tokens, which do not split over {parallelism.world} "
                         f"ranks: choose a width and height whose tokens divide by {parallelism.world}")


class Ranks:
    """This process's place among the ranks, and the messages they exchange (Python objects
    over a gloo group, whatever carries the tensors)."""

    def __init__(self, parallelism: Parallelism):
        self.parallelism = parallelism
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # the followers wait here for the next request, however long the server idles
        self._objects = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))

    @property
    def leading(self) -> bool:
        return self.rank == 0

    def lead(self, requests: list) -> None:
        """Rank 0: the batch every rank makes next."""
        dist.broadcast_object_list([("generate", requests)], src=0, group=self._objects)

    def stop(self) -> None:
        """Rank 0: the other ranks return from `follow`."""
        dist.broadcast_object_list([("stop", None)], src=0, group=self._objects)

    def receive(self) -> tuple[str, object]:
        message = [None]
        dist.broadcast_object_list(message, src=0, group=self._objects)
        return message[0]

    def agree(self, error: BaseException | None) -> BaseException | None:
        """Every rank's outcome of applying the adapters: the first rank's error, or None."""
        errors: list = [None] * self.world
        dist.all_gather_object(errors, error, group=self._objects)
        return next((e for e in errors if e is not None), None)


def follow(engine, ranks: Ranks) -> None:
    """A rank other than 0: make every batch rank 0 leads, until it says stop."""
    engine.use_ranks(ranks)
    while True:
        verb, requests = ranks.receive()
        if verb == "stop":
            return
        try:
            lease = engine.lender.lease_now(requests[0].loras)
        except Exception as e:  # this rank cannot read them: every rank stays on the base model
            ranks.agree(e)
            continue
        with lease:
            try:
                engine.generate_batch(requests, lease)
            except Exception:  # the leader answers for it; the ranks stay in step
                logger.debug("rank %d: batch failed", ranks.rank, exc_info=True)
