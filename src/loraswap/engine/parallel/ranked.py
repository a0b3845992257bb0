"""The engine of one process among several that make each image together (`--ulysses-degree`,
`--ring-degree`, `--cfg-parallel`): an `Engine` whose model is split over the processes
(`split.py`) and whose batches every process makes in step (`ranks.py`).

It attaches where `Engine` leaves room, so that the engine reads the same in one process or
many: `prepare_model` splits each denoiser before the warm-up (which every rank makes in step
on its own), `pipeline_arguments` gives this rank its half of the guidance passes, and once
every rank is up (`use_ranks`) each batch goes round the ranks:

1. rank 0 checks that the call splits and sends the requests, seeds chosen, to the others
   (`Ranks.lead`), which make it too (`ranks.follow`);
2. every rank applies the adapters, and they agree that all did, from the same files, before
   generating (`Ranks.agree`); when one could not, the others go back to the base model and
   every rank raises the first failing rank's error;
3. every rank makes the image and waits for the others to end it (`Ranks.together`).

Rank 0's lender also tells the other ranks' stores to read a queued request's adapters, and
keeping or evicting one is done on every rank.
"""

import logging
from collections.abc import Callable
from concurrent.futures import Future

from loraswap.adapters.files.location import AdapterLocation
from loraswap.adapters.lease import Lease
from loraswap.adapters.reference import AdapterRef
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine, GenerateResult, on_device
from loraswap.engine.parallel.cfg import GuidanceSplit
from loraswap.engine.parallel.ranks import Ranks
from loraswap.engine.parallel.split import check_split, split_model
from loraswap.engine.request import GenerateRequest
from loraswap.errors import LoraswapError

logger = logging.getLogger(__name__)


class RankedEngine(Engine):
    # every rank makes each image in step: none may stop it alone, the others would wait for it
    stoppable = False
    # never retried on one rank alone, which would leave the others waiting
    retries_first_image = False

    def __init__(self, config: EngineConfig):
        self.parallelism = config.parallel.parallelism
        self.ranks: Ranks | None = None  # set once every rank is up (`use_ranks`)
        self.guidance_split: GuidanceSplit | None = None  # --cfg-parallel: this rank's half of the passes
        super().__init__(config)

    def prepare_model(self) -> None:
        """Each denoiser split over the ranks; First-Block Cache then decides to skip a step from
        the sums over every rank's slice, so that all skip the same steps."""
        self.guidance_split = split_model(self.pipeline, self.parallelism, self.device.type, self.model_name,
                                          self.config.compilation.attention, self.calls.family)
        self.step_cache.split_over(self.parallelism.world)

    def pipeline_arguments(self, kwargs: dict) -> dict:
        """A call's arguments on this rank (the second half of --cfg-parallel: prompts swapped)."""
        return self.guidance_split.arguments(kwargs) if self.guidance_split else kwargs

    def use_ranks(self, ranks: Ranks) -> None:
        """From now on each batch goes round `ranks` (rank 0 leads, the others follow); rank 0's
        leases also tell the other ranks to read the adapters."""
        self.ranks = ranks
        if ranks.leading:
            self.lender = ReadAlong(self.lender, ranks)

    def when_lost(self, answer: Callable[[LoraswapError], None]) -> None:
        """`answer(error)` once the ranks cannot go on (`loss.RankLoss.give_up`: a rank died, or
        one fell out of step); rank 0's GPU worker answers every request it holds with it."""
        self.ranks.loss.when_lost(answer)

    def generate_batch(self, requests: list[GenerateRequest], lease: Lease,
                       on_step: Callable[[int, int], None] | None = None,
                       on_latents: Callable | None = None) -> list[GenerateResult]:
        if self.ranks is None:  # the warm-up: every rank makes the same calls on its own
            return super().generate_batch(requests, lease, on_step, on_latents)
        with on_device(self.device):
            # 1. the call; a follower that refuses it says so to rank 0, which waits for its word
            try:
                batch = self.prepare_batch(requests, on_step, on_latents)
            except Exception as e:
                if not self.ranks.leading:
                    self.ranks.agree(e)
                raise
            # 2. rank 0 sends the batch to the others; every rank applies the adapters, agreed
            if self.ranks.leading:
                check_split(self.pipeline, self.calls.family, self.parallelism, batch.kwargs)
                self.ranks.lead(batch.seeded())
            swap_seconds = self._apply_together(lease)
            # 3. every rank makes the images, then waits for the others to end them
            return self.ranks.together(lambda: self.run_batch(batch, lease, swap_seconds))

    def _apply_together(self, lease: Lease) -> float:
        """`apply` on every rank at once. When any rank could not (or they read different
        versions of a file), the first failing rank's error is raised on every rank, and the
        ranks that changed their weights go back to the base model; when all refuse alike (the
        same file: the usual case), nothing changed anywhere."""
        error, seconds = None, 0.0
        try:
            seconds = self.apply(lease)
        except Exception as e:
            error = e
            if not self.ranks.leading:  # rank 0 answers the request with it; here it would go unseen
                logger.warning("rank %d: the adapters could not be applied here: %s", self.ranks.rank, e)
        versions = tuple((item.adapter_id, getattr(item, "stamp", None)) for item, _ in lease.held)
        first = self.ranks.agree(error, versions)
        if first is not None and error is None and seconds > 0:  # this rank swapped; another could not
            self.restore_base()
        if first is not None:
            raise first
        return seconds

    def keep_adapter(self, ref: AdapterRef, location: AdapterLocation | None = None):
        """Read the adapter now and keep it cached until evicted, on every rank (each other
        rank's store finds the file itself, as for a request)."""
        bound = super().keep_adapter(ref, location)
        if self.ranks is not None:
            self.ranks.tell("keep", [ref])
        return bound

    def evict_adapter(self, ref: AdapterRef, download_too: bool = True,
                      location: AdapterLocation | None = None) -> None:
        """Stop keeping the adapter and drop it from the cache, on every rank (and with
        `download_too` its downloaded file, from the folder the ranks share)."""
        super().evict_adapter(ref, download_too, location)
        if self.ranks is not None:
            self.ranks.tell("evict", [ref])


class ReadAlong:
    """Rank 0's lender: each lease of a queued request also tells the other ranks' stores to
    read its adapters (`Ranks.tell`), so that they read a never-seen adapter while earlier
    images are made, as this rank does, not once this rank leads the batch."""

    def __init__(self, lender, ranks: Ranks):
        self.lender, self.ranks = lender, ranks

    def lease(self, refs: list[AdapterRef], located=None) -> Future:
        if refs:
            self.ranks.tell("read", refs)
        return self.lender.lease(refs, located)

    def lease_now(self, refs: list[AdapterRef], located=None) -> Lease:
        return self.lender.lease_now(refs, located)
