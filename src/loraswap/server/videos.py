"""Video jobs: the OpenAI videos API answers at once with a job id, generates in the
background, and keeps the MP4 for a while.

A job (`VideoJob`) outlives the request that made it: its client may leave and poll later
with the id. Nothing waits on it, so it is never cancelled for a client that left; only
`DELETE` (or the server stopping) cancels it. Its status is derived from what it holds, so
the GPU worker's thread (which reports steps) and the event loop never race on it:
`queued` until a first denoising step is reported, `in_progress` after, then `completed`
with the MP4 or `failed` with an error.

The progress hook: `VideoJob.report_step(done, total)`, callable from any thread. The
backend receives it as `on_step` (`Backend.generate`); the engine is to call it from the
pipeline's `callback_on_step_end` once per denoising step.

`VideoStore` keeps the jobs: a finished one for `video_ttl_s` seconds (`sweep`, on every
call and every `SWEEP_EVERY_S` in the background), at most `max_video_jobs` in all (past
it the oldest finished job is dropped) and at most `max_video_jobs_pending` unfinished
(past it: 503). Ids are random (`video_` and 32 hex digits): an id is the only way to a job.
"""

import asyncio
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum

from fastapi.concurrency import run_in_threadpool
from PIL import Image

from ..engine.config import GenerateRequest
from ..engine.engine import GenerateResult
from ..errors import LoraswapError, Overloaded, UnsupportedInput
from ..media.mp4 import encode_mp4
from .config import ServerConfig

logger = logging.getLogger("loraswap.server")

SWEEP_EVERY_S = 30.0  # an idle server still frees expired videos this often


class VideoNotFound(LoraswapError):
    status = 404


class VideoNotReady(LoraswapError):
    """Content asked for before the job completed (or of a job that failed)."""

    status = 409


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
    steps: tuple[int, int] = (0, 0)  # (done, total), replaced whole: one atomic write per report
    finished_at: float | None = None
    expires_at: float | None = None
    error: dict | None = None  # {"code", "message"}
    mp4: bytes | None = None
    thumbnail: Image.Image | None = None  # the first frame
    seconds: str = "auto"  # until finished, what was asked; then the MP4's length
    size: str = "auto"
    task: asyncio.Task | None = field(default=None, repr=False)

    def report_step(self, done: int, total: int) -> None:
        """The progress hook: `done` of `total` denoising steps are finished. Called by the
        engine from the GPU worker's thread, once per step."""
        self.steps = (done, total)

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

    def view(self) -> dict:
        """The job as the OpenAI Video object."""
        def stamp(t: float | None) -> int | None:
            return None if t is None else int(t)

        return {"id": self.id, "object": "video", "model": self.model, "status": self.status.value,
                "progress": self.progress, "created_at": stamp(self.created_at),
                "completed_at": stamp(self.finished_at), "expires_at": stamp(self.expires_at),
                "error": self.error, "prompt": self.request.prompt, "seconds": self.seconds, "size": self.size,
                "remixed_from_video_id": None}


MakeVideo = Callable[[VideoJob], Awaitable[GenerateResult]]  # generates the job's frames


class VideoStore:
    """The video jobs of this server, owned by the app (`app.state.videos`)."""

    def __init__(self, config: ServerConfig, clock: Callable[[], float] = time.time):
        self.config = config
        self.clock = clock  # wall-clock seconds: the Video object's timestamps are Unix times
        self._jobs: dict[str, VideoJob] = {}  # in creation order
        self._sweeper: asyncio.Task | None = None

    # ---------------------------------------------------------------- jobs
    def submit(self, request: GenerateRequest, model: str, fps: int | None, make: MakeVideo) -> VideoJob:
        """A new job, started now on the running event loop; `make(job)` generates its frames.
        Overloaded (503) while `max_video_jobs_pending` jobs are unfinished."""
        # 1. forget expired jobs; refuse past the cap on unfinished ones
        self.sweep()
        pending = sum(1 for job in self._jobs.values() if not job.finished)
        if pending >= self.config.max_video_jobs_pending:
            raise Overloaded(f"{pending} videos are being made, the most this server makes at once; retry later")
        # 2. make room: the oldest finished job goes (ServerConfig keeps max_video_jobs >=
        #    max_video_jobs_pending, so there is one)
        while len(self._jobs) >= self.config.max_video_jobs:
            oldest = next(job for job in self._jobs.values() if job.finished)
            logger.info("dropping video %s: %d jobs kept, the most", oldest.id, len(self._jobs))
            del self._jobs[oldest.id]
        # 3. start it; nothing waits on it, so it runs whether or not its client stays
        job = VideoJob("video_" + secrets.token_hex(16), request, model, fps, self.clock())
        job.size = f"{request.width}x{request.height}" if request.width and request.height else "auto"
        if request.frames and fps:  # the length is known now only when the rate it plays at is
            job.seconds = f"{request.frames / fps:g}"
        self._jobs[job.id] = job
        job.task = asyncio.get_running_loop().create_task(self._run(job, make), name=f"loraswap-{job.id}")
        return job

    async def _run(self, job: VideoJob, make: MakeVideo) -> None:
        """Generate, encode, and record the MP4 or the error (a cancelled job is already gone)."""
        try:
            result = await make(job)
            if not result.frames:
                raise UnsupportedInput("the model this request went to makes images, not videos: name a video "
                                       "model (a Wan model) or an adapter of one as `model`")
            fps = job.fps or result.fps or self.config.video_fps
            job.mp4 = await run_in_threadpool(encode_mp4, result.frames, fps)
            job.thumbnail = result.frames[0]
            job.seconds = f"{len(result.frames) / fps:g}"
            job.size = "{}x{}".format(*result.frames[0].size)
            job.finished_at, job.expires_at = self._expiry()
        except LoraswapError as e:  # refused (bad adapter, not a video model, ...) or overloaded
            _fail(job, _code(e), e.message, self._expiry())
        except Exception:
            logger.exception("video %s failed", job.id)
            _fail(job, "internal_error", "internal server error", self._expiry())

    def _expiry(self) -> tuple[float, float]:
        """(now, when a job finished now expires)."""
        now = self.clock()
        return now, now + self.config.video_ttl_s

    def get(self, video_id: str) -> VideoJob:
        self.sweep()
        job = self._jobs.get(video_id)
        if job is None:
            raise VideoNotFound(f"no video {video_id!r}: unknown, deleted, or expired (videos are kept "
                                f"{self.config.video_ttl_s:g} s after they finish)")
        return job

    def completed(self, video_id: str) -> VideoJob:
        """The job, once completed; VideoNotReady (409) before, or when it failed."""
        job = self.get(video_id)
        if job.status is VideoStatus.FAILED:
            raise VideoNotReady(f"video {video_id} failed, so it has no content: {job.error['message']}")
        if job.status is not VideoStatus.COMPLETED:
            raise VideoNotReady(f"video {video_id} is {job.status.value} ({job.progress}%); its content is "
                                f"ready when its status is completed: poll GET /v1/videos/{video_id}")
        return job

    def delete(self, video_id: str) -> VideoJob:
        """Forget the job; an unfinished one is cancelled (a queued one costs no GPU work)."""
        job = self.get(video_id)
        del self._jobs[video_id]
        if job.task is not None and not job.task.done():
            job.task.cancel()
        return job

    def sweep(self) -> list[str]:
        """Forget every job finished more than `video_ttl_s` ago; their ids."""
        now = self.clock()
        expired = [job.id for job in self._jobs.values() if job.expires_at is not None and now >= job.expires_at]
        for video_id in expired:
            del self._jobs[video_id]
        return expired

    def __len__(self) -> int:
        return len(self._jobs)

    # ---------------------------------------------------------------- lifespan
    def start(self) -> None:
        """Sweep in the background too, so an idle server frees expired videos."""
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever(), name="loraswap-video-sweeper")

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            self.sweep()

    async def stop(self) -> None:
        """Cancel the sweeper and the unfinished jobs: their videos would die with the process."""
        tasks = [job.task for job in self._jobs.values() if job.task is not None and not job.task.done()]
        tasks += [self._sweeper] if self._sweeper is not None else []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _fail(job: VideoJob, code: str, message: str, expiry: tuple[float, float]) -> None:
    job.error = {"code": code, "message": message}
    job.finished_at, job.expires_at = expiry


def _code(error: LoraswapError) -> str:
    """The error's class as a code: AdapterNotFound -> adapter_not_found."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(error).__name__).lower()
