"""OpenAI videos API: `POST /v1/videos` starts a job, `GET /v1/videos` lists them,
`GET /v1/videos/{id}` polls one, `GET /v1/videos/{id}/content` downloads the MP4,
`DELETE /v1/videos/{id}` forgets (or cancels) it. The jobs live in `app.state.videos`
(`videos.VideoStore`); each belongs to the key that made it (another key's request is
answered 404, and its list leaves it out). A job may ask for a webhook (`webhooks`)."""

from typing import Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from loraswap.adapters.files.metadata import same_model
from loraswap.adapters.reference import AdapterRef
from loraswap.adapters.sources.choose import may_download
from loraswap.adapters.sources.download_locks import holding_downloads
from loraswap.engine.calls import check_size_multiple
from loraswap.errors import BadRequest, UnsupportedInput
from loraswap.server.auth import Access, key_owner, require_api_key
from loraswap.server.backend import not_ready
from loraswap.server.generation import encode
from loraswap.server.openapi import LORA_HEADER, form_body
from loraswap.server.requests.limits import check_model_size, check_model_step_cache
from loraswap.server.requests.parse import hold_named_urls, parse_request
from loraswap.server.requests.schemas import OpenAIVideoRequest
from loraswap.server.videos.ids import cursor_key, sort_key
from loraswap.server.videos.maker import ROUTE, video_maker
from loraswap.server.videos.store import VideoJob
from loraswap.server.videos.webhook_rules import check_webhook_url

router = APIRouter(tags=[Access.GENERATION.value], dependencies=[Depends(require_api_key),
                                                                 Depends(hold_named_urls)])

VIDEO_OPENAPI = {"requestBody": form_body(OpenAIVideoRequest.model_json_schema()), "parameters": [LORA_HEADER]}
# how long the openai client's `poll` waits between polls (its header); a video takes seconds at least
POLL_AFTER_MS = 1000
CONTENT_RESPONSES = {200: {"content": {"video/mp4": {}, "image/webp": {}}}}
LIST_LIMIT = (1, 100, 20)  # the fewest and most jobs a page of the list holds, and its default (OpenAI's)


@router.post(ROUTE, openapi_extra=VIDEO_OPENAPI)
async def create_video(request: Request):
    """OpenAI videos API, a multipart form as the openai client sends it: start a video and
    answer its job (`queued`). `model` is an adapter id (`id1:0.8, id2:0.5` to blend) or the
    base model (none: the hosted video model); `frames` (or `num_frames`), `fps`, `seed`,
    `negative_prompt`, `num_inference_steps` and `guidance_scale` are extensions. The job
    outlives the request."""
    state = request.app.state
    # 1. parse (the one parser of every generation route: limits, adapters, the engine's request)
    parsed = await parse_request(request, OpenAIVideoRequest)  # (a bad adapter name: 400 now, not a failed job later)
    info = state.backend.ready_info()
    if info is None:  # a job started now would only fail
        raise not_ready(state.backend.load_error)
    videos = {model: c for model, c in info["capabilities"].items() if c["output"] == "video"}
    target = _video_model(parsed.model, parsed.engine_request.loras, videos, info["models"])
    for model, capabilities in videos.items():  # refused now, not as a failed job later
        if target is None or same_model(model, target):
            check_size_multiple(parsed.engine_request.width, parsed.engine_request.height,
                                capabilities["size_multiple"], model)
            check_model_size(parsed.engine_request, capabilities, model)
            check_model_step_cache(parsed.engine_request, capabilities, model)
    await _check_adapters_make_videos(state, parsed.engine_request.loras, list(videos), target)
    webhook_url = getattr(parsed.body, "webhook_url", None)
    if webhook_url is not None:  # refused now (no secret, a host not allowed), not at the job's end
        check_webhook_url(webhook_url, state.config.webhooks)  # its text only: no DNS lookup
    # 2. start the job
    shown = parsed.model or _adapters_named(parsed.engine_request.loras) or target
    job = state.videos.submit(parsed.engine_request, shown, parsed.fps, video_maker(state), target,
                              owner=_owner(request), webhook_url=webhook_url)
    return job.view(state.videos.clock())


def _video_model(named: str | None, loras: list[AdapterRef], videos: dict, hosted: list[str]) -> str | None:
    """The hosted model a video goes to: the one named; else the hosted video model (with
    adapters, only when there is one: several leave it to the adapters' base model, None).
    422 at once when it would make images."""
    if not videos:
        raise UnsupportedInput(f"this server hosts no video model (hosted: {', '.join(hosted)}); a video needs a "
                               "video model (a Wan model)")
    if named is not None:
        if not any(same_model(model, named) for model in videos):
            raise UnsupportedInput(f"model {named!r} makes images, not videos: name a video model "
                                   f"({', '.join(videos)}) or an adapter of one")
        return named
    return next(iter(videos)) if len(videos) == 1 or not loras else None


async def _check_adapters_make_videos(state, loras: list[AdapterRef], videos: list[str],
                                      target: str | None) -> None:
    """422 now, not a failed job later, for an adapter that routing sends to a model making
    images (its declared base model, its family, its layers), or to another video model than
    `target` (`Deployment.check_video_adapters`). Checked where this process hosts the models
    (not a Ray ingress), for adapters whose files are here: one still to download is checked
    by its job, which fetches it."""
    deployment = getattr(state, "deployment", None)  # this process's engines (`backend.LocalBackend`)
    if not loras or deployment is None or not deployment.hosted:
        return
    sources = deployment.hosted[0].engine.adapters.source
    if any(may_download(sources, ref) for ref in loras):
        return
    hosted_target = next((model for model in videos if same_model(model, target)), None) if target else None

    def check() -> None:
        with holding_downloads():  # a downloaded file stays while its header is read
            deployment.check_video_adapters(loras, videos, hosted_target)

    await run_in_threadpool(check)


def _owner(request: Request) -> str | None:
    """Whose video jobs this request may see: its API key's (everyone's, without keys)."""
    return key_owner(request)


def _adapters_named(loras: list[AdapterRef]) -> str:
    """The adapters as a request names them: `id`, or `id1:0.8, id2:0.5`."""
    return ", ".join(r.adapter_id if r.scale == 1 else f"{r.adapter_id}:{r.scale:g}" for r in loras)


@router.get(ROUTE)
async def list_videos(request: Request, after: str | None = Query(None, max_length=80),
                      limit: int = Query(LIST_LIMIT[2], ge=LIST_LIMIT[0], le=LIST_LIMIT[1]),
                      order: Literal["asc", "desc"] = Query("desc")):
    """This API key's jobs (without keys: every job), newest first (`order=asc`: oldest), a
    page of at most `limit` after the job `after` (the `last_id` of the page before, placed by
    the time its id carries even once that job is gone), as OpenAI lists: `{"object": "list",
    "data", "first_id", "last_id", "has_more"}`. 400 for an `after` that is no video id."""
    videos = request.app.state.videos
    now = videos.clock()
    jobs = videos.visible(_owner(request))
    if order == "desc":
        jobs.reverse()
    if after is not None:
        jobs = _after(jobs, after, order, now)
    page = [job.view(now) for job in jobs[:limit]]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(jobs) > limit}


def _after(jobs: list[VideoJob], after: str, order: str, now: float) -> list[VideoJob]:
    """The jobs (in `order`) that follow the job `after`: found among them, or, gone since (expired,
    deleted), placed by its id (`videos/ids.py:cursor_key`), so a client paging through the list
    loses no page to a job that went meanwhile."""
    at = next((i for i, job in enumerate(jobs) if job.id == after), None)
    if at is not None:
        return jobs[at + 1:]
    placed = cursor_key(after, now)
    if placed is None:
        raise BadRequest(f"after: {after!r} is no video id of this server's (video_ and 32 hex digits, the "
                         "last_id of a page); list again without after")
    follows = (lambda key: key > placed) if order == "asc" else (lambda key: key < placed)
    return [job for job in jobs if follows(sort_key(job.id, job.created_at))]


@router.get(ROUTE + "/{video_id}")
async def retrieve_video(video_id: str, request: Request):
    """The job: `status` (queued, in_progress, completed, failed), `progress` (percent), the
    denoising `step` of `total_steps` and `elapsed_s`, `error` once failed; 404 for an
    unknown or expired id."""
    videos = request.app.state.videos
    job = videos.get(video_id, _owner(request))
    return JSONResponse(job.view(videos.clock()), headers={"openai-poll-after-ms": str(POLL_AFTER_MS)})


@router.get(ROUTE + "/{video_id}/content", response_class=Response, responses=CONTENT_RESPONSES)
async def download_video(video_id: str, request: Request,
                         variant: Literal["video", "thumbnail"] = Query("video")) -> Response:
    """The MP4 (H.264), or with `variant=thumbnail` the first frame as WebP; 409 before the
    job completed (or when it failed)."""
    job = request.app.state.videos.completed(video_id, _owner(request))
    if variant == "thumbnail":
        data, media = await encode(await run_in_threadpool(lambda: job.thumbnail), "image/webp")
        return Response(data, media_type=media)
    return Response(await run_in_threadpool(lambda: job.mp4), media_type="video/mp4",
                    headers={"content-disposition": f'attachment; filename="{video_id}.mp4"'})


@router.delete(ROUTE + "/{video_id}")
async def delete_video(video_id: str, request: Request):
    """Forget the video and remove its files (an unfinished one is cancelled); 404 for an unknown id."""
    job = request.app.state.videos.delete(video_id, _owner(request))
    return {"id": job.id, "object": "video.deleted", "deleted": True}
