"""Video jobs: the OpenAI videos API answers at once with a job id, generates in the
background, and keeps the MP4 for a while, across restarts.

A job (`job.VideoJob`) outlives the request that made it. Nothing waits on it, so it
is never cancelled for a client that left; only `DELETE` (or the server stopping) cancels it.

`VideoStore` keeps the jobs: a finished one for `video_ttl_s` seconds (`sweep`, on every
call and every `SWEEP_EVERY_S` in the background), within caps in total and per API key
(`caps.py`: past them a key's own oldest finished job is dropped, never another key's,
or the new job is refused with 503), a deleted job still counted until its generation has
stopped (on Ray: until the replica has been told). Ids: `ids.py`. A job belongs to the
API key that made it: another key is answered 404 as for an unknown id (`owner_of`, when
the server has API keys), and lists only its own.

The jobs and their MP4s are kept in the state folder (`state.VideoState`, one row a
job and the same as a record beside its files, written before it runs and when it
finishes). A new store on the folder finds them as the last server left them: completed
ones downloadable until they expire (the TTL counts from completion, in wall-clock time),
interrupted ones made again once the backend serves (`resume`, at most once: a job that was
being made at two restarts may be what kills the server) or, with `resume_videos` off,
failed with the code `server_restarted`. A row the database lost, or that cannot be read, is
rebuilt from the job's record; files of no job are set aside, never deleted, at a start.

A job that gave a `webhook_url` holds a webhook's slot from when it is made (503 if none is
left) and owes it when it ends (completed, failed, or deleted unfinished): kept with its
final row, sent and retried by `webhooks.WebhookSender`.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from fastapi.concurrency import run_in_threadpool
from PIL import Image

from loraswap.engine.engine import GenerateResult
from loraswap.engine.request import GenerateRequest
from loraswap.errors import LoraswapError, UnsupportedInput
from loraswap.media.mp4 import encode_mp4
from loraswap.server.backend import until_served
from loraswap.server.config import ServerConfig
from loraswap.server.state_files import plain_file
from loraswap.server.videos.caps import room_for
from loraswap.server.videos.ids import is_video_id, new_video_id, sort_key
from loraswap.server.videos.job import VideoJob, VideoStatus, error_code, restarted
from loraswap.server.videos.state import MEDIA, ORPHANS, WRITE_ERRORS, VideoState
from loraswap.server.videos.webhooks import Delivery, WebhookSender, owed

logger = logging.getLogger("loraswap.server")

SWEEP_EVERY_S = 30.0  # an idle server still frees expired videos this often
MAX_ATTEMPTS = 2  # a job is made again after one restart, not after a second


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
    folder (`state.VideoState`): made again or failed after a restart (`resume`)."""

    def __init__(self, config: ServerConfig, clock: Callable[[], float] = time.time):
        self.config = config
        self.clock = clock  # wall-clock seconds: the Video object's timestamps are Unix times, kept across restarts
        self._jobs: dict[str, VideoJob] = {}  # in creation order
        self._interrupted: list[VideoJob] = []  # queued or in progress when the last server stopped
        self._tasks: list[asyncio.Task] = []  # the sweeper, the resumer
        self._stopping: dict[asyncio.Task, str | None] = {}  # deleted jobs not stopped yet, and their owners
        self.state = VideoState(config.state_dir)
        self.webhooks = WebhookSender(config.webhooks, self.state, clock)  # the webhooks jobs owe at their end
        self._load()

    # ---------------------------------------------------------------- jobs
    def submit(self, request: GenerateRequest, model: str, fps: int | None, make: MakeVideo,
               target: str | None = None, owner: str | None = None, webhook_url: str | None = None) -> VideoJob:
        """A new job of `owner`'s, started now on the running event loop; `make(job)` generates
        its frames; `webhook_url` (checked) is called when it ends. 503 when the caps leave no
        room (`caps.room_for`) or no webhook may be owed (`WebhookSender.reserve`)."""
        # 1. its webhook's slot; forget expired jobs; make room, dropping only finished jobs this key may drop
        now = self.clock()
        video_id = new_video_id(now)
        self.sweep()
        with self.webhooks.reserving(video_id, owner, webhook_url is not None):
            dropped = room_for(owner, list(self._jobs.values()), list(self._stopping.values()), self.config, now)
        for old in dropped:
            logger.info("dropping video %s to make room for a new one: %d jobs kept", old.id, len(self._jobs))
            self._forget(old.id)
        # 2. start it; nothing waits on it, so it runs whether or not its client stays
        job = VideoJob(video_id, request, model, fps, now, target, owner=owner,
                       urls={ref.adapter_id: ref.url for ref in request.loras if ref.url is not None},
                       webhook_url=webhook_url)
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
            self._finish(job, job.failure(error_code(e), e.message))
        except Exception:
            logger.exception("video %s failed", job.id)
            self._finish(job, job.failure("internal_error", "internal server error"))

    async def _keep_files(self, job: VideoJob, mp4: bytes, thumbnail: Image.Image) -> None:
        try:
            await run_in_threadpool(self.state.write_files, job.id, mp4, thumbnail)
        except asyncio.CancelledError:  # deleted (or the server stopping) while they were written: none stays
            with contextlib.suppress(OSError):
                self.state.remove_files(job.id, MEDIA)
            raise
        except OSError as e:
            logger.error("video %s failed: writing its MP4 to %s failed: %s", job.id, self.state.files, e)
            raise StateWriteFailed(f"the server could not keep this video: writing it to its state folder failed "
                                   f"({e})") from None
        job.mp4_path, job.thumbnail_path = self.state.mp4_path(job.id), self.state.thumbnail_path(job.id)

    def _finish(self, job: VideoJob, error: dict | None = None) -> None:
        """Completed (no error) or failed, now: it expires `video_ttl_s` from now; its webhook,
        if any, is owed from the same write on."""
        job.error = error
        job.finished_at = self.clock()
        job.expires_at = job.finished_at + self.config.video_ttl_s
        if job.webhook_url is None:
            self._save(job)
            return
        delivery = owed(job.id, job.webhook_url, job.view(), job.finished_at, job.owner)
        self.webhooks.send(delivery, kept=self._save(job, delivery))

    def _save(self, job: VideoJob, delivery: Delivery | None = None) -> bool:
        """Whether the job's row (and `delivery`'s, in the same transaction) was written."""
        try:
            if delivery is None:
                self.state.save(job.row())
            else:
                self.state.save(job.row(), delivery.model_dump())
        except WRITE_ERRORS as e:  # the job goes on; it is only not kept across a restart
            logger.error("video %s is not kept across a restart: writing its row failed: %s", job.id, e)
            return False
        return True

    def get(self, video_id: str, owner: str | None = None) -> VideoJob:
        """The job, if `owner`'s (or everyone's); VideoNotFound (404) otherwise."""
        self.sweep()
        job = self._jobs.get(video_id) if is_video_id(video_id) else None
        if job is None or job.owner not in (None, owner):
            raise VideoNotFound(f"no video {video_id[:80]!r}: unknown, deleted, or expired (videos are kept "
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
        if not job.finished and job.webhook_url is not None:
            now = self.clock()
            self.webhooks.send(owed(job.id, job.webhook_url, job.cancelled_view(now), now, job.owner))
        if job.task is not None and not job.task.done():
            job.task.cancel()
            self._stopping[job.task] = job.owner
            job.task.add_done_callback(lambda task: self._stopping.pop(task, None))
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

    def visible(self, owner: str | None = None) -> list[VideoJob]:
        """`owner`'s jobs, oldest first (`ids.sort_key`); without API keys, every job."""
        self.sweep()
        return sorted((job for job in self._jobs.values() if job.owner == owner or owner is None),
                      key=lambda job: sort_key(job.id, job.created_at))

    def __len__(self) -> int:
        return len(self._jobs)

    # ---------------------------------------------------------------- after a restart
    def _load(self) -> None:
        """The jobs the state folder keeps: a row that cannot be read dropped, a job whose row is
        lost rebuilt from its record, expired ones removed, files of no job set aside, a
        completed job whose MP4 is gone failed, an interrupted one failed or left to `resume`."""
        try:
            rows = self.state.rows()
        except WRITE_ERRORS as e:  # read once through when opened: only a disk failing since
            logger.error("reading the videos from %s failed, so they are rebuilt from their records: %s",
                         self.state.folder, e)
            rows = []
        for row in rows:
            self._load_row(row)
        self._rebuild()
        self.sweep()
        self._sort_out_files()
        if not self.config.resume_videos:
            self._fail_interrupted("resuming is off (--no-resume-videos)")
        for job in [job for job in self._interrupted if job.attempts >= MAX_ATTEMPTS]:
            self._interrupted.remove(job)
            self._finish(job, restarted("it was being made again after an earlier restart; it is not made a "
                                        "third time"))

    def _load_row(self, row: dict) -> None:
        try:
            job = VideoJob.from_row(row)
        except ValueError as e:  # changed by hand, or damaged: its record (if any) rebuilds it
            logger.error("dropping video %.80r: its row in the state folder cannot be read: %s", row["id"], e)
            try:
                self.state.remove_row(row["id"])
            except WRITE_ERRORS as e:
                logger.error("removing that row failed: %s", e)
            return
        if not plain_file(self.state.record_path(job.id)):  # kept by an earlier version: no record yet
            self._save(job)
        self._add_loaded(job)

    def _add_loaded(self, job: VideoJob) -> None:
        self._jobs[job.id] = job
        if job.status is VideoStatus.COMPLETED:
            self._check_files(job)
        elif not job.finished:
            self._interrupted.append(job)
            _recall_urls(job)  # its refs carry their URLs again
            if job.webhook_url is not None:  # owed when it ends, past the caps or not
                self.webhooks.reserve(job.id, job.owner, capped=False)

    def _rebuild(self) -> None:
        """The jobs whose row the database lost (moved aside, replaced, a row dropped), made again
        from their records; a record that cannot be read leaves its files to be set aside."""
        rebuilt = []
        for video_id in sorted(self.state.record_ids() - set(self._jobs)):
            try:
                job = VideoJob.from_row(self.state.read_record(video_id))
                if job.id != video_id:
                    raise ValueError(f"it is the record of {job.id}")
            except (OSError, ValueError) as e:
                logger.error("video %s: its record cannot be read, so its files are set aside: %s", video_id, e)
                continue
            self._save(job)  # its row again
            self._add_loaded(job)
            rebuilt.append(video_id)
        if rebuilt:
            logger.warning("rebuilt %d videos from their records in %s (the database had no row for them): %s",
                           len(rebuilt), self.state.files, ", ".join(rebuilt))

    def _sort_out_files(self) -> None:
        completed = {job.id for job in self._jobs.values() if job.status is VideoStatus.COMPLETED}
        try:
            removed, moved = self.state.sort_out_at_start(completed, set(self._jobs))
        except OSError as e:
            logger.error("sorting out the files of %s failed: %s", self.state.files, e)
            return
        if removed:
            logger.info("removed %d unfinished files from %s", len(removed), self.state.files)
        if moved:
            logger.warning("moved %d files of no video from %s to %s, kept for a look (delete them when done): "
                           "%s", len(moved), self.state.files, self.state.folder / ORPHANS, ", ".join(moved))

    def _check_files(self, job: VideoJob) -> None:
        """A completed job whose MP4 is gone from the state folder (or is a link) is failed."""
        job.mp4_path, job.thumbnail_path = self.state.mp4_path(job.id), self.state.thumbnail_path(job.id)
        if plain_file(job.mp4_path) and plain_file(job.thumbnail_path):
            return
        logger.error("video %s failed: its MP4 is missing from %s", job.id, self.state.files)
        job.mp4_path = job.thumbnail_path = None
        self._finish(job, {"code": "video_lost", "message": "this video's MP4 is missing from the server's state "
                                                           "folder; create the video again"})

    def _fail_interrupted(self, why: str) -> None:
        for job in self._interrupted:
            if self._jobs.get(job.id) is job:
                self._finish(job, restarted(why))
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
        self.webhooks.start()
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
        await self.webhooks.stop()  # what they owe stays in the state folder
        self.state.close()


def _recall_urls(job: VideoJob) -> None:
    """An interrupted job's `url:` adapter refs rebuilt with the URLs its row keeps: made again,
    it fetches a download the restart cut short (or one evicted since) as it did the first time."""
    try:
        job.request = job.request.with_loras([ref.with_url(job.urls.get(ref.adapter_id))
                                              for ref in job.request.loras])
    except LoraswapError as e:  # a row changed by hand: the job fails then, naming its adapter
        logger.error("video %s: the URLs of its adapters cannot be used: %s", job.id, e)
