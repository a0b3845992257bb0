"""How one image is spread over processes: its settings, and the checks that need no model."""

from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from loraswap.flags import SPEED, Flag


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


class ParallelConfig(BaseModel):
    """The processes one image is made by (one GPU each), and how long they wait for each other."""

    model_config = ConfigDict(extra="forbid")

    ulysses_degree: Annotated[int, Flag(SPEED)] = Field(
        1, ge=1, le=64, description="Split each image's sequence over this many processes, one GPU each (Ulysses "
                                    "attention; FLUX.1 and Kontext, FLUX.2, Qwen-Image and Edit, Wan): N x "
                                    "--ring-degree processes in all, the first serving HTTP.")
    ring_degree: Annotated[int, Flag(SPEED)] = Field(
        1, ge=1, le=64, description="Split each image's sequence over this many processes with ring attention "
                                    "(times --ulysses-degree).")
    rank_wait_s: Annotated[float, Flag(SPEED)] = Field(
        120.0, gt=0, description="With several processes: how long one that has ended an image waits for the "
                                 "others to end it. Past it, one failed alone (a GPU out of memory) and left the "
                                 "others stuck: the server exits (code 70) for its supervisor to start it again.")
    cfg_parallel: Annotated[bool, Flag(SPEED)] = Field(
        False, description="Make the two passes of classifier-free guidance at once on two sets of processes "
                           "(Wan, Qwen-Image and Edit): twice the processes of --ulysses-degree x --ring-degree.")

    @property
    def parallelism(self) -> Parallelism:
        """How the engine's sequence is split over processes (`world` 1: it is not)."""
        return Parallelism(self.ulysses_degree, self.ring_degree, 2 if self.cfg_parallel else 1)
