"""OpenAI images API: `POST /v1/images/generations` and `POST /v1/images/edits`, images as
base64 PNG."""

import base64
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from ..auth import Access, require_api_key
from ..decode_budget import release_decoded
from ..generation import encode, generate, step_cache_headers
from ..openapi import LORA_HEADER, form_body, json_body
from ..requests import hold_named_urls, parse_request
from ..schemas import ApiBody, OpenAIEditRequest, OpenAIImageRequest

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
    # 2. generate each image in turn (seed, seed + 1, ...), 3. encode as PNG
    data, results = [], []
    for gen in parsed.per_image():
        result = await generate(request, route, gen, parsed.model)
        png, _ = await encode(result.image, "image/png")
        data.append({"b64_json": base64.b64encode(png).decode(), "revised_prompt": gen.prompt})
        results.append(result)
    return JSONResponse({"created": int(time.time()), "data": data}, headers=step_cache_headers(results))
