"""How requests' adapters are swapped in: the swapper, what it takes, the threads reading ahead of it."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraswap.flags import ADAPTERS, Flag


class SwapConfig(BaseModel):
    """The swapper (loraswap's fused swap, or a baseline), the largest blend and rank it takes, and
    the threads that read a request's adapters while earlier requests generate."""

    model_config = ConfigDict(extra="forbid")

    swap_mode: Annotated[Literal["fused", "load-and-fuse", "hotswap"], Flag(ADAPTERS)] = Field(
        "fused", description="fused (loraswap's swap), or a benchmark baseline: load-and-fuse (diffusers' "
                             "load_lora_weights + fuse_lora per request, eager) or hotswap (diffusers + PEFT "
                             "hotswap, compiled).")
    hotswap_rank: Annotated[int, Flag(ADAPTERS)] = Field(
        128, ge=1, le=1024, description="With --swap-mode hotswap: the highest rank served (every adapter is padded "
                                        "to it).")
    max_blend: Annotated[int, Flag(ADAPTERS)] = Field(
        4, ge=1, le=32, description="Most adapters blended in one request.")
    max_rank: Annotated[int, Flag(ADAPTERS)] = Field(1024, ge=1, description="Highest LoRA rank accepted.")
    prefetch_threads: Annotated[int, Flag(ADAPTERS)] = Field(
        4, ge=1, le=64, description="Threads reading adapters ahead of the GPU.")
