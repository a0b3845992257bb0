"""Where the weights wait, and how much of the GPU one process takes."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraswap.flags import SPEED, Flag


class MemoryConfig(BaseModel):
    """The GPU memory a process may use, and where the swap keeps the weights it restores."""

    model_config = ConfigDict(extra="forbid")

    pristine: Annotated[Literal["device", "host"], Flag(SPEED)] = Field(
        "device", description="Where pristine copies of swapped weights live: device, or host (pinned RAM; the "
                              "low-memory mode).")
    max_gpu_memory_gb: Annotated[float | None, Flag(SPEED)] = Field(
        None, gt=0, description="Cap this process's GPU memory (a smaller card on a larger one).")
