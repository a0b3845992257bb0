"""How the GPU worker orders, batches and bounds the requests it queues."""

from typing import Annotated

from pydantic import BaseModel, Field

from loraswap.flags import SCHEDULING, Flag


class SchedulerConfig(BaseModel):
    """The worker's queue, its batches, and the fairness bound (`engine/worker.py`)."""

    max_queue: Annotated[int, Flag(SCHEDULING)] = Field(32, ge=1, description="Requests waiting before 503.")
    max_batch: Annotated[int, Flag(SCHEDULING)] = Field(
        1, ge=1, le=64, description="Requests with the same adapters and parameters batched into one pipeline "
                                    "call.")
    max_wait_s: Annotated[float, Flag(SCHEDULING)] = Field(
        30.0, gt=0, description="Fairness: a request waiting this long goes next, seconds.")
    max_skips: Annotated[int, Flag(SCHEDULING)] = Field(
        8, ge=0, description="Fairness: a request passed over this often goes next.")
