"""How many video jobs a server keeps, and whose finished jobs a new one may drop to make room.

Caps in total (`max_video_jobs` kept, `max_video_jobs_pending` unfinished) and per API key
(`max_video_jobs_per_key`, `max_video_jobs_pending_per_key`; without API keys every job is
everyone's, and the totals alone count). A new job may drop its own key's finished jobs
(the oldest first), and everyone's, but never another key's finished job before it expires:
when the server keeps all it may and none of them is the key's to drop, the new job is
refused (503) with a Retry-After of when the first of them expires. An unfinished job is
never dropped.
"""

import math

from loraswap.errors import Overloaded
from loraswap.server.config import ServerConfig
from loraswap.server.videos.job import VideoJob


class VideoJobsFull(Overloaded):
    """503: no room for another video job now; `retry_after_s` says when there may be (None: the server's
    --retry-after-s)."""

    def __init__(self, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def room_for(owner: str | None, jobs: list[VideoJob], stopping: list[str | None], config: ServerConfig,
             now: float) -> list[VideoJob]:
    """The finished jobs to drop, oldest first, so that `owner` may start one more. `jobs`: those
    kept, oldest first; `stopping`: the owners of deleted jobs whose generation has not stopped
    yet (they are still being made). VideoJobsFull, with nothing dropped, when there is no room."""
    pending = [job.owner for job in jobs if not job.finished] + stopping
    if len(pending) >= config.max_video_jobs_pending:
        raise VideoJobsFull(f"{len(pending)} videos are being made, the most this server makes at once; retry later")
    drop = []
    if owner is not None:
        if (own_pending := pending.count(owner)) >= config.max_video_jobs_pending_per_key:
            raise VideoJobsFull(f"this API key has {own_pending} videos being made, the most one key may have at "
                                "once (--max-video-jobs-pending-per-key); retry when one has finished")
        own = [job for job in jobs if job.owner == owner]
        # there are enough: ServerConfig keeps max_video_jobs_per_key >= max_video_jobs_pending_per_key
        drop = [job for job in own if job.finished][:max(0, len(own) - config.max_video_jobs_per_key + 1)]
    over = len(jobs) - len(drop) - config.max_video_jobs + 1
    if over > 0:
        droppable = [job for job in jobs if job.finished and job.owner in (None, owner) and job not in drop]
        if len(droppable) < over:
            raise _full(jobs, config, now)
        drop += droppable[:over]
    return drop


def _full(jobs: list[VideoJob], config: ServerConfig, now: float) -> VideoJobsFull:
    """The server keeps all it may, and the finished jobs are other keys' until they expire."""
    expiries = [job.expires_at for job in jobs if job.expires_at is not None]
    wait = max(1, math.ceil(min(expiries) - now)) if expiries else None
    when = f"the first of them expires in {wait} s" if wait else "one expires"
    return VideoJobsFull(f"this server keeps {len(jobs)} videos, the most it keeps (--max-video-jobs), and those "
                         f"finished are other API keys' until they expire or are deleted; retry when {when}", wait)
