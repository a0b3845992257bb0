"""How a video job generates, for a new job and for one made again after a restart."""

from loraswap.engine.engine import GenerateResult
from loraswap.server.generation import run_generation
from loraswap.server.videos.store import MakeVideo, VideoJob

ROUTE = "/v1/videos"  # the route a job's generation is counted and logged under


def video_maker(state) -> MakeVideo:
    """Through the backend (`state.backend`) as an image request does, to the model the job
    named (`target`), with nobody waiting on it (a client that leaves cancels nothing) and the
    job's progress hook."""
    async def make(job: VideoJob) -> GenerateResult:
        return await run_generation(state, ROUTE, job.request, job.target, None, on_step=job.report_step)

    return make
