"""One video job: what to generate, how far it is, and once finished its MP4 or its error.

A job outlives the request that made it: its client may leave and poll later with the id.
Its status is derived from what it holds, so the GPU worker's thread (which reports steps)
and the event loop never race on it: `queued` until a first denoising step is reported,
`in_progress` after, then `completed` with the MP4 or `failed` with an error.

The progress hook: `VideoJob.report_step(done, total)`, callable from any thread. The
backend receives it as `on_step` (`Backend.generate`); the engine is to call it from the
pipeline's `callback_on_step_end` once per denoising step.

A job is kept in the state folder as a row (`row`, `from_row`: `state.COLUMNS`) and
its files; `mp4` and `thumbnail` read them back. A row is checked column by column when
read (`JobRow`): one changed by hand (a time that is text, an error that is a number, an id
that is a pattern) is refused whole rather than served.
"""

import asyncio
import io
import json
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Annotated

from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from loraswap.engine.request import GenerateRequest
from loraswap.errors import LoraswapError
from loraswap.server.state_files import read_plain_file
from loraswap.server.videos.ids import is_video_id

RESTARTED = "server_restarted"  # the error code of a job the server's restart cost


class VideoStatus(str, Enum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"


@dataclass(eq=False)
class VideoJob:
    """One video: what to generate, how far it is, and once finished its MP4 or its error."""

    id: str
    request: GenerateRequest
    model: str  # what the request named (adapters, or a base model), as the Video object shows it
    fps: int | None  # asked by the request; None: the model's rate, else the server's video_fps
    created_at: float
    target: str | None = None  # the base model the request named (None: the adapters' own), to route it again
    steps: tuple[int, int] = (0, 0)  # (done, total), replaced whole: one atomic write per report
    finished_at: float | None = None
    expires_at: float | None = None
    error: dict | None = None  # {"code", "message"}
    mp4_path: Path | None = None  # once completed: the MP4 and its first frame in the state folder
    thumbnail_path: Path | None = None
    seconds: str = "auto"  # until finished, what was asked; then the MP4's length
    size: str = "auto"
    attempts: int = 0  # runs started: 2 once made again after a restart
    owner: str | None = None  # a digest of the API key that made it (`VideoStore.owner_of`); None: everyone's
    # the URLs behind its `url:` ids, signatures and all: what fetches them again after a restart
    urls: dict[str, str] = field(default_factory=dict)
    webhook_url: str | None = None  # called once when it ends (`webhooks`); checked before it was made
    task: asyncio.Task | None = field(default=None, repr=False)

    def report_step(self, done: int, total: int) -> None:
        """The progress hook: `done` of `total` denoising steps are finished. Called by the
        engine from the GPU worker's thread, once per step."""
        self.steps = (done, total)

    @property
    def mp4(self) -> bytes | None:
        """The MP4's bytes, read from the state folder (blocking; never through a link)."""
        return read_plain_file(self.mp4_path) if self.mp4_path else None

    @property
    def thumbnail(self) -> Image.Image | None:
        """The first frame, read from the state folder (blocking; never through a link)."""
        if self.thumbnail_path is None:
            return None
        with Image.open(io.BytesIO(read_plain_file(self.thumbnail_path))) as image:
            return image.convert("RGB")

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    @property
    def status(self) -> VideoStatus:
        if self.finished:
            return VideoStatus.FAILED if self.error else VideoStatus.COMPLETED
        return VideoStatus.IN_PROGRESS if self.steps[1] else VideoStatus.QUEUED

    @property
    def progress(self) -> int:
        """Percent done: denoising steps until finished (at most 99: decoding and encoding
        follow the last step), 100 once completed."""
        if self.status is VideoStatus.COMPLETED:
            return 100
        done, total = self.steps
        return min(99, 100 * done // total) if total else 0

    def view(self, now: float | None = None) -> dict:
        """The job as the OpenAI Video object, with what a poller shows beside `progress`: the
        denoising `step` done of `total_steps` (None until the first step says), and
        `elapsed_s` since it was made (until it finished; `now`: the store's clock)."""
        def stamp(t: float | None) -> int | None:
            return None if t is None else int(t)

        step, total = self.steps
        until = self.finished_at if self.finished else (now if now is not None else self.created_at)
        return {"id": self.id, "object": "video", "model": self.model, "status": self.status.value,
                "progress": self.progress, "created_at": stamp(self.created_at),
                "completed_at": stamp(self.finished_at), "expires_at": stamp(self.expires_at),
                "error": self.error, "prompt": self.request.prompt, "seconds": self.seconds, "size": self.size,
                "remixed_from_video_id": None, "step": step, "total_steps": total or self.request.steps,
                "elapsed_s": round(max(0.0, until - self.created_at), 3)}

    def cancelled_view(self, now: float) -> dict:
        """The Video object of a job deleted before it finished, as its webhook sends it: failed,
        with the code `cancelled` (OpenAI's statuses have no other end)."""
        return {**self.view(now), "status": "failed", "completed_at": int(now), "expires_at": int(now),
                "error": {"code": "cancelled", "message": "the video was deleted before it finished"}}

    def failure(self, code: str, message: str) -> dict:
        """The error of this job failing now with `code`."""
        if self.attempts > 1:  # made again after a restart, and failed again
            return restarted(f"making it again failed: {message}")
        return {"code": code, "message": message}

    def row(self) -> dict:
        """The job as the state folder keeps it (`state.COLUMNS`): enough to make it again."""
        return {"id": self.id, "request": self.request.model_dump_json(exclude={"image", "mask"}),
                "model": self.model, "target": self.target, "fps": self.fps, "created_at": self.created_at,
                "finished_at": self.finished_at, "expires_at": self.expires_at,
                "error": json.dumps(self.error) if self.error else None, "seconds": self.seconds,
                "size": self.size, "attempts": self.attempts, "owner": self.owner,
                "urls": json.dumps(self.urls) if self.urls else None, "step": self.steps[0],
                "total_steps": self.steps[1], "webhook_url": self.webhook_url}

    @classmethod
    def from_row(cls, row: object) -> "VideoJob":
        """The job a row keeps; ValueError for a row that is not one (pydantic's ValidationError is one)."""
        checked = JobRow.model_validate(row)
        try:
            request = GenerateRequest.model_validate_json(checked.request)
        except LoraswapError as e:  # an adapter id no request could name: a row that is not one
            raise ValueError(str(e)) from None
        error = JobError.model_validate_json(checked.error).model_dump() if checked.error is not None else None
        urls = JobUrls.validate_json(checked.urls) if checked.urls is not None else {}
        fields = checked.model_dump(exclude={"step", "total_steps"})
        steps = (checked.step or 0, checked.total_steps or 0)
        return cls(**{**fields, "request": request, "error": error, "urls": urls, "steps": steps})


def restarted(why: str) -> dict:
    """The error of a job the server's restart cost."""
    return {"code": RESTARTED, "message": f"the server restarted while this video was being made, and {why}"}


def error_code(error: Exception) -> str:
    """The error's class as a code: AdapterNotFound -> adapter_not_found."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(error).__name__).lower()


FiniteTime = Annotated[float, Field(allow_inf_nan=False)]


JobUrls = TypeAdapter(dict[str, str])  # a job's `url:` ids and the URLs behind them


class JobError(BaseModel):
    """A failed job's error, as the Video object shows it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    code: str
    message: str


class JobRow(BaseModel):
    """A row as the state folder keeps it (`VideoJob.row`), each column of its own type
    (strict: no text read as a number, no number as text)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str
    request: str  # GenerateRequest as JSON
    model: str
    target: str | None
    fps: Annotated[int, Field(ge=1)] | None
    created_at: FiniteTime
    finished_at: FiniteTime | None
    expires_at: FiniteTime | None
    error: str | None  # JobError as JSON
    seconds: str
    size: str
    attempts: Annotated[int, Field(ge=0)]
    owner: str | None
    urls: str | None = None  # JobUrls as JSON
    step: Annotated[int, Field(ge=0)] | None = None  # steps done, of total_steps, when it was kept
    total_steps: Annotated[int, Field(ge=0)] | None = None
    webhook_url: str | None = None

    @field_validator("id")
    @classmethod
    def _a_video_id(cls, value: str) -> str:
        if not is_video_id(value):
            raise ValueError("not a video id (video_ and 32 hex digits)")
        return value

    @model_validator(mode="after")
    def _finished_whole(self):
        if (self.finished_at is None) != (self.expires_at is None):
            raise ValueError("finished_at and expires_at are set together")
        if self.error is not None and self.finished_at is None:
            raise ValueError("an unfinished job has no error")
        return self
