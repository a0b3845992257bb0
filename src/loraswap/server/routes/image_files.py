"""Images answered by URL: `image_data` keeps an image of `POST /v1/images/generations` (or
edits) asked with `response_format: "url"` and answers its URL on this server;
`GET /v1/images/files/{name}` serves it to the key that made it, until its TTL
(`images/kept.py:KeptImages`)."""

import base64

from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool

from loraswap.server.auth import Access, key_owner, require_api_key
from loraswap.server.generation import IMAGE_RESPONSES
from loraswap.server.images.kept import EXTENSIONS

router = APIRouter(tags=[Access.GENERATION.value], dependencies=[Depends(require_api_key)])


async def image_data(request: Request, response_format: str, data: bytes, media: str) -> dict:
    """One item of an OpenAI images answer: `{"url": ...}`, the image kept for the request's
    key, or `{"b64_json": ...}`."""
    if response_format != "url":
        return {"b64_json": base64.b64encode(data).decode()}
    kept = request.app.state.kept_images
    name = await run_in_threadpool(kept.keep, data, EXTENSIONS[media], _owner(request))
    return {"url": str(request.url_for("image_file", name=name))}  # the host and scheme the client used


async def check_url_room(request: Request, response_format: str) -> None:
    """For a request answered by URL: 507 before anything is generated when its images could
    not be kept (`KeptImages.check_room`)."""
    if response_format == "url":
        await run_in_threadpool(request.app.state.kept_images.check_room)


async def forget_kept(request: Request, items: list[dict]) -> None:
    """Delete the images kept for `items` (of a request that then failed: no one has their URLs)."""
    names = [item["url"].rsplit("/", 1)[-1] for item in items if "url" in item]
    if names:
        kept, owner = request.app.state.kept_images, _owner(request)
        await run_in_threadpool(lambda: [kept.discard(name, owner) for name in names])


@router.get("/v1/images/files/{name}", response_class=Response, responses=IMAGE_RESPONSES)
async def image_file(name: str, request: Request) -> Response:
    """An image answered by URL, to the API key that made it (another key: 404) until it
    expires (`--image-url-ttl-s`)."""
    data, media, left_s = await run_in_threadpool(request.app.state.kept_images.read, name, _owner(request))
    return Response(data, media_type=media, headers={"cache-control": f"private, max-age={int(left_s)}"})


def _owner(request: Request) -> str | None:
    """Whose images this request reaches: its API key's (everyone's, without keys), named as
    video jobs name it (a digest under the state folder's secret, never the key)."""
    return key_owner(request)
