"""Put on a test server's PYTHONPATH: in every process of it, on rank 1 alone,
- FLUX.1's transformer fails for an image of 96 x 64 pixels (24 tokens, 12 a rank once
  split), as a GPU out of memory would, while rank 0 goes on into its next collective;
- and holds an image of 128 x 64 pixels (32 tokens, 16 a rank) until the test kills it,
  having logged "rank 1: holding the image";
- the swap fails halfway through writing the adapter "k" (its touched weights restored, as
  after any failed swap), while rank 0 writes it;
- the adapter "b" is read from another version of its file (one replaced between the
  ranks' reads), as its stamp says;
and what rank 0 tells the others to read ahead is logged (at debug)."""

import logging
import time

import torch
import torch.distributed as dist
from diffusers import FluxTransformer2DModel

from loraswap.adapters import store
from loraswap.engine.swap.fused import FusedSwapper

_forward = FluxTransformer2DModel.forward
_write = FusedSwapper._write
_file_stamp = store.file_stamp


def _on_rank_1() -> bool:
    return dist.is_initialized() and dist.get_rank() == 1


def _fails_on_rank_1(self, hidden_states, *args, **kwargs):
    if _on_rank_1() and hidden_states.shape[1] == 12:
        raise torch.OutOfMemoryError("out of memory, on rank 1 alone (made by the test)")
    if _on_rank_1() and hidden_states.shape[1] == 16:
        logging.getLogger(__name__).warning("rank 1: holding the image until killed (made by the test)")
        time.sleep(600)
    return _forward(self, hidden_states, *args, **kwargs)


def _write_fails_on_rank_1(self, adapters):
    if _on_rank_1() and any(bound.adapter_id == "k" for bound, _ in adapters):
        raise torch.OutOfMemoryError("out of memory in the swap, on rank 1 alone (made by the test)")
    return _write(self, adapters)


def _another_version_on_rank_1(location):
    stamp = _file_stamp(location)
    return (*stamp[:-1], stamp[-1] + 1) if _on_rank_1() and location.adapter_id == "b" else stamp


FluxTransformer2DModel.forward = _fails_on_rank_1
FusedSwapper._write = _write_fails_on_rank_1
store.file_stamp = _another_version_on_rank_1
logging.getLogger("loraswap.engine.parallel.ranks").setLevel(logging.DEBUG)
