"""Video jobs: the OpenAI videos API answers at once with a job id, generates in the
background, and keeps the MP4 for a while, across restarts.

A job (`video_job.VideoJob`) outlives the request that made it. Nothing waits on it, so it
is never cancelled for a client that left; only `DELETE` (or the server stopping) cancels it.

`VideoStore` keeps the jobs: a finished one for `video_ttl_s` seconds (`sweep`, on every
call and every `SWEEP_EVERY_S` in the background), at most `max_video_jobs` in all (past
it the oldest finished job is dropped) and at most `max_video_jobs_pending` unfinished
(past it: 503), a deleted job still counted until its generation has stopped (on Ray:
until the replica has been told). Ids are random (`video_` and 32 hex digits), and a job
belongs to the API key that made it: another key is answered 404 as for an unknown id
(`owner_of`, when the server has API keys).

The jobs and their MP4s are kept in the state folder (`video_state.VideoState`, one row a
job, written before it runs and when it finishes). A new store on the folder finds them as
the last server left them: completed ones downloadable until they expire (the TTL counts
from completion, in wall-clock time), interrupted ones made again once the backend serves
(`resume`, at most once: a job that was being made at two restarts may be what kills the
server) or, with `resume_videos` off, failed with the code `server_restarted`.
"""

import asyncio
import hashlib
import hmac
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable

from fastapi.concurrency import run_in_threadpool
from PIL import Image

from ..engine.config import GenerateRequest
from ..engine.engine import GenerateResult
from ..errors import LoraswapError, Overloaded, UnsupportedInput
from ..media.mp4 import encode_mp4
from .backend import until_served
from .config import ServerConfig
from .video_job import VideoJob, VideoStatus
from .video_state import WRITE_ERRORS, VideoState

logger = logging.getLogger("loraswap.server")

SWEEP_EVERY_S = 30.0  # an idle server still frees expired videos this often
MAX_ATTEMPTS = 2  # a job is made again after one restart, not after a second
RESTARTED = "server_restarted"  # the error code of a job the server's restart cost


class VideoNotFound(LoraswapError):
    status = 404


class VideoNotReady(LoraswapError):
    """Content asked for before the job completed (or of a job that failed)."""

    status = 409


class StateWriteFailed(LoraswapError):
    """The job's MP4 could not be written to the state folder (a full disk)."""

    status = 507


MakeVideo = Callable[[VideoJob], Awaitable[GenerateResult]]  # generates the job's frames


class VideoStore:
    """The video jobs of this server, owned by the app (`app.state.videos`), kept in the state
    folder (`video_state.VideoState`): made again or failed after a restart (`resume`)."""

    def __init__(self, config: ServerConfig, clock: Callable[[], float] = time.time):
        self.config = config
        self.clock = clock  # wall-clock seconds: the Video object's timestamps are Unix times, kept across restarts
        self._jobs: dict[str, VideoJob] = {}  # in creation order
        self._interrupted: list[VideoJob] = []  # queued or in progress when the last server stopped
        self._tasks: list[asyncio.Task] = []  # the sweeper, the resumer
        self._stopping: set[asyncio.Task] = set()  # deleted jobs whose generation has not stopped yet
        self.state = VideoState(config.state_dir)
        self._load()

    # ---------------------------------------------------------------- jobs
    def submit(self, request: GenerateRequest, model: str, fps: int | None, make: MakeVideo,
               target: str | None = None, owner: str | None = None) -> VideoJob:
        """A new job of `owner`'s, started now on the running event loop; `make(job)` generates
        its frames. Overloaded (503) while `max_video_jobs_pending` jobs are unfinished."""
        # 1. forget expired jobs; refuse past the cap on unfinished ones (deleted ones still stopping too)
        self.sweep()
        pending = sum(1 for job in self._jobs.values() if not job.finished) + len(self._stopping)
        if pending >= self.config.max_video_jobs_pending:
            raise Overloaded(f"{pending} videos are being made, the most this server makes at once; retry later")
        # 2. make room: the oldest finished job goes (ServerConfig keeps max_video_jobs >=
        #    max_video_jobs_pending, so there is one)
        while len(self._jobs) >= self.config.max_video_jobs:
            oldest = next(job for job in self._jobs.values() if job.finished)
            logger.info("dropping video %s: %d jobs kept, the most", oldest.id, len(self._jobs))
            self._forget(oldest.id)
        # 3. start it; nothing waits on it, so it runs whether or not its client stays
        job = VideoJob("video_" + secrets.token_hex(16), request, model, fps, self.clock(), target, owner=owner)
        job.size = f"{request.width}x{request.height}" if request.width and request.height else "auto"
        if request.frames and fps:  # the length is known now only when the rate it plays at is
            job.seconds = f"{request.frames / fps:g}"
        self._jobs[job.id] = job
        self._start(job, make)
        return job

    def _start(self, job: VideoJob, make: MakeVideo) -> None:
        """Run the job (kept first, so a crash from now on leaves it to the next start)."""
        job.attempts += 1
        job.steps = (0, 0)
        self._save(job)
        job.task = asyncio.get_running_loop().create_task(self._run(job, make), name=f"loraswap-{job.id}")

    async def _run(self, job: VideoJob, make: MakeVideo) -> None:
        """Generate, encode, keep the files, and record the MP4 or the error (a cancelled job
        is already gone)."""
        try:
            result = await make(job)
            if not result.frames:
                raise UnsupportedInput("the model this request went to makes images, not videos: name a video "
                                       "model (a Wan model) or an adapter of one as `model`")
            fps = job.fps or result.fps or self.config.video_fps
            mp4 = await run_in_threadpool(encode_mp4, result.frames, fps)
            await self._keep_files(job, mp4, result.frames[0])
            job.seconds = f"{len(result.frames) / fps:g}"
            job.size = "{}x{}".format(*result.frames[0].size)
            self._finish(job)
        except LoraswapError as e:  # refused (bad adapter, not a video model, ...), overloaded, disk full
            self._finish(job, _error(job, _code(e), e.message))
        except Exception:
            logger.exception("video %s failed", job.id)
            self._finish(job, _error(job, "internal_error", "internal server error"))

    async def _keep_files(self, job: VideoJob, mp4: bytes, thumbnail: Image.Image) -> None:
        try:
            await run_in_threadpool(self.state.write_files, job.id, mp4, thumbnail)
        except OSError as e:
            logger.error("video %s failed: writing its MP4 to %s failed: %s", job.id, self.state.files, e)
            raise StateWriteFailed(f"the server could not keep this video: writing it to its state folder failed "
                                   f"({e})") from None
        job.mp4_path, job.thumbnail_path = self.state.mp4_path(job.id), self.state.thumbnail_path(job.id)

    def _finish(self, job: VideoJob, error: dict | None = None) -> None:
        """Completed (no error) or failed, now: it expires `video_ttl_s` from now."""
        job.error = error
        job.finished_at = self.clock()
        job.expires_at = job.finished_at + self.config.video_ttl_s
        self._save(job)

    def _save(self, job: VideoJob) -> None:
        try:
            self.state.save(job.row())
        except WRITE_ERRORS as e:  # the job goes on; it is only not kept across a restart
            logger.error("video %s is not kept across a restart: writing its row failed: %s", job.id, e)

    def owner_of(self, key: bytes | None) -> str | None:
        """The owner a job made with API key `key` records (an HMAC under the state folder's
        secret: never the key); None without API keys (the job is everyone's)."""
        if key is None:
            return None
        return hmac.new(self.state.owner_secret, key, hashlib.sha256).hexdigest()[:32]

    def get(self, video_id: str, owner: str | None = None) -> VideoJob:
        """The job, if `owner`'s (or everyone's); VideoNotFound (404) otherwise."""
        self.sweep()
        job = self._jobs.get(video_id)
        if job is None or job.owner not in (None, owner):
            raise VideoNotFound(f"no video {video_id!r}: unknown, deleted, or expired (videos are kept "
                                f"{self.config.video_ttl_s:g} s after they finish)")
        return job

    def completed(self, video_id: str, owner: str | None = None) -> VideoJob:
        """The job, once completed; VideoNotReady (409) before, or when it failed."""
        job = self.get(video_id, owner)
        if job.status is VideoStatus.COMPLETED:
            self._check_files(job)
        if job.status is VideoStatus.FAILED:
            raise VideoNotReady(f"video {video_id} failed, so it has no content: {job.error['message']}")
        if job.status is not VideoStatus.COMPLETED:
            raise VideoNotReady(f"video {video_id} is {job.status.value} ({job.progress}%); its content is "
                                f"ready when its status is completed: poll GET /v1/videos/{video_id}")
        return job

    def delete(self, video_id: str, owner: str | None = None) -> VideoJob:
        """Forget the job and remove its files; an unfinished one is cancelled: a queued one
        costs no GPU work, a running one stops at its next denoising step."""
        job = self.get(video_id, owner)
        self._forget(video_id)
        if job.task is not None and not job.task.done():
            job.task.cancel()
            self._stopping.add(job.task)
            job.task.add_done_callback(self._stopping.discard)
        return job

    def _forget(self, video_id: str) -> None:
        del self._jobs[video_id]
        self._remove_kept(video_id)

    def _remove_kept(self, video_id: str) -> None:
        """Remove the job's row and files from the state folder."""
        try:
            self.state.remove(video_id)
        except WRITE_ERRORS as e:  # the next start or sweep removes what is left
            logger.error("video %s: removing its files and row failed: %s", video_id, e)

    def sweep(self) -> list[str]:
        """Forget every job finished more than `video_ttl_s` ago, removing its files; their ids."""
        now = self.clock()
        expired = [job.id for job in self._jobs.values() if job.expires_at is not None and now >= job.expires_at]
        for video_id in expired:
            self._forget(video_id)
        return expired

    def __len__(self) -> int:
        return len(self._jobs)

    # ---------------------------------------------------------------- after a restart
    def _load(self) -> None:
        """The jobs the state folder keeps: expired ones and files of no job removed, a completed
        job whose MP4 is gone failed, an interrupted one failed or left to `resume`."""
        try:
            rows = self.state.rows()
        except WRITE_ERRORS as e:  # read once through when opened: only a disk failing since
            logger.error("starting with no videos: reading them from %s failed: %s", self.state.folder, e)
            rows = []
        for row in rows:
            self._load_row(row)
        self.sweep()
        kept = {job.id for job in self._jobs.values() if job.status is VideoStatus.COMPLETED}
        try:
            if removed := self.state.remove_orphans(kept, at_start=True):
                logger.info("removed %d files of no video from %s", len(removed), self.state.files)
        except OSError as e:
            logger.error("removing files of no video from %s failed: %s", self.state.files, e)
        if not self.config.resume_videos:
            self._fail_interrupted("resuming is off (--no-resume-videos)")
        for job in [job for job in self._interrupted if job.attempts >= MAX_ATTEMPTS]:
            self._interrupted.remove(job)
            self._finish(job, _restarted("it was being made again after an earlier restart; it is not made a "
                                         "third time"))

    def _load_row(self, row: dict) -> None:
        try:
            job = VideoJob.from_row(row)
        except (ValueError, TypeError, KeyError) as e:
            logger.error("dropping video %s: its row in the state folder cannot be read: %s", row["id"], e)
            self._remove_kept(row["id"])
            return
        self._jobs[job.id] = job
        if job.status is VideoStatus.COMPLETED:
            self._check_files(job)
        elif not job.finished:
            self._interrupted.append(job)

    def _check_files(self, job: VideoJob) -> None:
        """A completed job whose MP4 is gone from the state folder is failed."""
        job.mp4_path, job.thumbnail_path = self.state.mp4_path(job.id), self.state.thumbnail_path(job.id)
        if job.mp4_path.is_file() and job.thumbnail_path.is_file():
            return
        logger.error("video %s failed: its MP4 is missing from %s", job.id, self.state.files)
        job.mp4_path = job.thumbnail_path = None
        self._finish(job, {"code": "video_lost", "message": "this video's MP4 is missing from the server's state "
                                                           "folder; create the video again"})

    def _fail_interrupted(self, why: str) -> None:
        for job in self._interrupted:
            if self._jobs.get(job.id) is job:
                self._finish(job, _restarted(why))
        self._interrupted = []

    async def resume(self, make: MakeVideo, backend=None) -> None:
        """Make again the jobs interrupted by the restart, once `backend` serves (before, they
        would only fail); failed, saying why, if its model failed to load."""
        if backend is not None and not await until_served(backend):
            self._fail_interrupted(f"the model failed to load: {backend.load_error}")
            return
        for job in self._interrupted:
            if self._jobs.get(job.id) is job:  # not deleted meanwhile
                logger.info("making video %s again: the server restarted while it was being made", job.id)
                self._start(job, make)
        self._interrupted = []

    # ---------------------------------------------------------------- lifespan
    def start(self, make: MakeVideo | None = None, backend=None) -> None:
        """Sweep in the background too, so an idle server frees expired videos; with `make`,
        resume the interrupted jobs once `backend` serves."""
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._sweep_forever(), name="loraswap-video-sweeper"))
        if make is not None and self._interrupted:
            self._tasks.append(loop.create_task(self.resume(make, backend), name="loraswap-video-resume"))

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            try:
                self.sweep()
                self.state.remove_orphans(set(self._jobs))
            except Exception:  # the sweeper goes on: the next tick may succeed
                logger.exception("sweeping the videos failed")

    async def stop(self) -> None:
        """Cancel the background tasks and the unfinished jobs (a generating one stops at its
        next step; the state folder keeps them for the next start), then close the state folder."""
        running = [job for job in self._jobs.values() if job.task is not None and not job.task.done()]
        for job in running:
            logger.info("video %s: stopping it for the server's shutdown; its row stays for the next start", job.id)
        tasks = [job.task for job in running] + self._tasks + list(self._stopping)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.state.close()


def _error(job: VideoJob, code: str, message: str) -> dict:
    if job.attempts > 1:  # made again after a restart, and failed again
        return _restarted(f"making it again failed: {message}")
    return {"code": code, "message": message}


def _restarted(why: str) -> dict:
    return {"code": RESTARTED, "message": f"the server restarted while this video was being made, and {why}"}


def _code(error: LoraswapError) -> str:
    """The error's class as a code: AdapterNotFound -> adapter_not_found."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(error).__name__).lower()
