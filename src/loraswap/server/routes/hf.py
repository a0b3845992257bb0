"""Hugging Face Inference API text-to-image and image-to-image: `POST /` and
`POST /models/{model_id}`."""

import time

from fastapi import APIRouter, Depends, Request, Response

from loraswap.server.auth import Access, require_api_key
from loraswap.server.generation import IMAGE_RESPONSES, encode, generate, server_timing, step_cache_headers
from loraswap.server.images.output import record_for
from loraswap.server.openapi import LORA_HEADER, json_body
from loraswap.server.requests.decode_budget import release_decoded
from loraswap.server.requests.parse import hold_named_urls, parse_request
from loraswap.server.requests.schemas import HFRequest
from loraswap.server.streaming.events import hf_stream_asked, stream_hf

router = APIRouter(tags=[Access.GENERATION.value], dependencies=[Depends(require_api_key), Depends(release_decoded),
                                                                 Depends(hold_named_urls)])

# the body is read by the handler (after the key check), so FastAPI does not document it
HF_OPENAPI = {"requestBody": json_body({"anyOf": [{"type": "string"}, HFRequest.model_json_schema()]}),
              "parameters": [LORA_HEADER]}


@router.post("/", openapi_extra=HF_OPENAPI, response_class=Response, responses=IMAGE_RESPONSES)
async def generate_root(request: Request) -> Response:
    """Hugging Face Inference API text-to-image, or image-to-image (`inputs`: a base64 image,
    `parameters.prompt`: the prompt); adapter from the `lora` header."""
    return await generate_hf(request, "/", None)


@router.post("/models/{model_id:path}", openapi_extra=HF_OPENAPI, response_class=Response,
             responses=IMAGE_RESPONSES)
async def generate_model(model_id: str, request: Request) -> Response:
    """As `POST /`; `model_id` is the base model's name or an adapter id."""
    return await generate_hf(request, "/models", model_id)


async def generate_hf(request: Request, route: str, path_model: str | None) -> Response:
    # 1. parse: {"inputs": ..., "parameters": {...}} or a bare JSON string (image-to-image:
    #    a base64 image in `inputs`, decoded and checked); the adapters from the `lora` header,
    #    and the path's model id when it names an adapter
    started = time.perf_counter()
    parsed = await parse_request(request, HFRequest, path_model)
    if hf_stream_asked(request, parsed):  # server-sent events: progress, previews, then the image
        return await stream_hf(request, route, parsed, started)
    parsed_at = time.perf_counter()
    # 2. generate on the GPU worker, 3. encode as the client accepts, with the image's record
    result = await generate(request, route, parsed.engine_request, parsed.model)
    generated_at = time.perf_counter()
    record = await record_for(request, parsed.output, parsed.engine_request, result)
    data, media = await encode(result.image, request.headers.get("accept", ""), record=record)
    total = result.swap_seconds + result.generate_seconds
    timing = server_timing(result, parse=parsed_at - started, encode=time.perf_counter() - generated_at)
    return Response(data, media_type=media, headers={"x-compute-time": f"{total:.4f}",
                                                     "x-swap-ms": f"{result.swap_seconds * 1e3:.2f}",
                                                     "x-seed": str(result.seed), "server-timing": timing,
                                                     **step_cache_headers([result])})
