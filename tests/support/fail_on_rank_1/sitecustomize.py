"""Put on a test server's PYTHONPATH: in every process of it, on rank 1 alone,
- FLUX.1's transformer fails for an image of 96 x 64 pixels (24 tokens, 12 a rank once
  split), as a GPU out of memory would, while rank 0 goes on into its next collective;
- and holds an image of 128 x 64 pixels (32 tokens, 16 a rank) until the test kills it,
  having logged "rank 1: holding the image";
- the swap fails partway through writing the adapter "k" (its touched weights restored, as
  after any failed swap), while rank 0 writes it: the engine's fused swapper, for
  `--swap-mode fused`, is one that does (`engine.SWAPPERS`);
- the adapter "b" is read from another version of its file (one replaced between the
  ranks' reads), as its stamp says;
and what rank 0 tells the others to read ahead is logged (at debug)."""

import logging
import time

import torch
import torch.distributed as dist
from diffusers import FluxTransformer2DModel
from torch.overrides import TorchFunctionMode

from loraswap.adapters import store
from loraswap.engine import engine
from loraswap.engine.swap.fused import FusedSwapper

_forward = FluxTransformer2DModel.forward
_file_stamp = store.file_stamp
PARTWAY = 260  # of the ~520 torch calls tiny-flux's LoKr "k" takes to apply on the CPU: about half its layers written


def _on_rank_1() -> bool:
    return dist.is_initialized() and dist.get_rank() == 1


def _fails_on_rank_1(self, hidden_states, *args, **kwargs):
    if _on_rank_1() and hidden_states.shape[1] == 12:
        raise torch.OutOfMemoryError("out of memory, on rank 1 alone (made by the test)")
    if _on_rank_1() and hidden_states.shape[1] == 16:
        logging.getLogger(__name__).warning("rank 1: holding the image until killed (made by the test)")
        time.sleep(600)
    return _forward(self, hidden_states, *args, **kwargs)


class _FailsPartway(TorchFunctionMode):
    """Out of memory at the `at`-th torch call made inside it: partway through a swap, whatever
    ops it uses."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.calls = at, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        if self.calls == self.at:
            raise torch.OutOfMemoryError("out of memory in the swap, on rank 1 alone (made by the test)")
        return func(*args, **(kwargs or {}))


class _FailsOnRank1(FusedSwapper):
    """The fused swapper, failing partway through writing the adapter "k" on rank 1."""

    def apply(self, adapters):
        if _on_rank_1() and any(held.adapter_id == "k" for held, _ in adapters):
            with _FailsPartway(at=PARTWAY):
                return super().apply(adapters)
        return super().apply(adapters)



def _another_version_on_rank_1(location):
    stamp = _file_stamp(location)
    return (*stamp[:-1], stamp[-1] + 1) if _on_rank_1() and location.adapter_id == "b" else stamp


FluxTransformer2DModel.forward = _fails_on_rank_1
engine.SWAPPERS["fused"] = _FailsOnRank1
store.file_stamp = _another_version_on_rank_1
logging.getLogger("loraswap.engine.parallel.ranks").setLevel(logging.DEBUG)
