"""OpenAI images API: `POST /v1/images/generations` and `POST /v1/images/edits`, images as
base64 files (PNG, JPEG or WebP: `output_format`), or as URLs on this server
(`response_format: "url"`: `image_files.py`)."""

import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from loraswap.server.auth import Access, require_api_key
from loraswap.server.generation import encode, generate, step_cache_headers
from loraswap.server.images.output import record_for
from loraswap.server.openapi import LORA_HEADER, form_body, json_body
from loraswap.server.requests.decode_budget import release_decoded
from loraswap.server.requests.parse import hold_named_urls, parse_request
from loraswap.server.requests.schemas import ApiBody, OpenAIEditRequest, OpenAIImageRequest
from loraswap.server.routes.image_files import check_url_room, forget_kept, image_data
from loraswap.server.streaming.openai import openai_stream_asked, stream_openai

router = APIRouter(tags=[Access.GENERATION.value], dependencies=[Depends(require_api_key), Depends(release_decoded),
                                                                 Depends(hold_named_urls)])

OPENAI_OPENAPI = {"requestBody": json_body(OpenAIImageRequest.model_json_schema()), "parameters": [LORA_HEADER]}
EDITS_OPENAPI = {"requestBody": form_body(OpenAIEditRequest.model_json_schema()), "parameters": [LORA_HEADER]}


@router.post("/v1/images/generations", openapi_extra=OPENAI_OPENAPI)
async def generate_openai(request: Request):
    """OpenAI images API: `model` is an adapter id (`id1:0.8, id2:0.5` to blend) or the base model."""
    return await _images(request, "/v1/images/generations", OpenAIImageRequest)


@router.post("/v1/images/edits", openapi_extra=EDITS_OPENAPI)
async def edit_openai(request: Request):
    """OpenAI images API edits: image-to-image, or inpainting with a mask; `model` as in generations."""
    return await _images(request, "/v1/images/edits", OpenAIEditRequest)


async def _images(request: Request, route: str, api: type[ApiBody]) -> JSONResponse:
    # 1. parse (the body is read after the key check: no work for a request without a key)
    parsed = await parse_request(request, api)
    if openai_stream_asked(parsed):  # `stream: true`: server-sent events in OpenAI's shapes
        return await stream_openai(request, route, parsed)
    # 2. generate each image in turn (seed, seed + 1, ...), 3. encode as `output_format` asks (PNG by
    #    default) with its record, 4. answered inline or by URL
    await check_url_room(request, parsed.response_format)
    data, results = [], []
    try:
        for gen in parsed.per_image():
            result = await generate(request, route, gen, parsed.model)
            record = await record_for(request, parsed.output, gen, result)
            file, media = await encode(result.image, parsed.output.accept("image/png"), record=record,
                                       quality=parsed.output.quality)
            data.append({**await image_data(request, parsed.response_format, file, media),
                         "revised_prompt": gen.prompt})
            results.append(result)
    except Exception:
        await forget_kept(request, data)  # a failed request leaves no image behind for URLs it never answered
        raise
    return JSONResponse({"created": int(time.time()), "data": data}, headers=step_cache_headers(results))
