"""A1111's API (stable-diffusion-webui, Forge, SD.Next), as the `webuiapi` client and the
front-ends that speak it call it: `POST /sdapi/v1/txt2img`, `POST /sdapi/v1/img2img`,
`GET /sdapi/v1/loras`, `GET /sdapi/v1/sd-models`, `GET /sdapi/v1/progress`, and `GET /sdapi/v1/scripts` (which webuiapi
asks for when it starts: no scripts here). The bodies and what each field means here:
`a1111/requests.py`; the answers: `a1111/answers.py`. Behind the API key, as every generation
route."""

import base64
from functools import partial

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool

from loraswap.errors import BadRequest
from loraswap.server.a1111.answers import fallback_record, images_answer, model_samplers, progress_answer, sd_models
from loraswap.server.a1111.requests import A1111Img2Img, A1111Txt2Img, check_sampler
from loraswap.server.auth import Access, key_owner, require_api_key
from loraswap.server.backend import not_ready
from loraswap.server.generation import encode, generate
from loraswap.server.images.output import ImageOutput, record_for
from loraswap.server.openapi import LORA_HEADER, json_body
from loraswap.server.requests.decode_budget import release_decoded
from loraswap.server.requests.parse import hold_named_urls, parse_request

router = APIRouter(tags=[Access.GENERATION.value], dependencies=[Depends(require_api_key), Depends(release_decoded),
                                                                 Depends(hold_named_urls)])

PREFIX = "/sdapi/v1"
TXT2IMG_OPENAPI = {"requestBody": json_body(A1111Txt2Img.model_json_schema()), "parameters": [LORA_HEADER]}
IMG2IMG_OPENAPI = {"requestBody": json_body(A1111Img2Img.model_json_schema()), "parameters": [LORA_HEADER]}


@router.post(PREFIX + "/txt2img", openapi_extra=TXT2IMG_OPENAPI)
async def txt2img(request: Request) -> dict:
    """A1111 text-to-image: `<lora:NAME:WEIGHT>` tags in the prompt name adapters (so does the
    `lora` header); `batch_size` x `n_iter` images, base64 PNG, and `info` (a JSON text) with the
    seeds, sampler, steps and model that made them."""
    return await _images(request, PREFIX + "/txt2img", A1111Txt2Img)


@router.post(PREFIX + "/img2img", openapi_extra=IMG2IMG_OPENAPI)
async def img2img(request: Request) -> dict:
    """A1111 image-to-image: one image in `init_images`, `denoising_strength`, and for inpainting
    a `mask` (white repaints); otherwise as txt2img."""
    return await _images(request, PREFIX + "/img2img", A1111Img2Img)


async def _images(request: Request, route: str, api: type[A1111Txt2Img]) -> dict:
    # 1. parse (the one parse of every API: limits, the prompt's tags, the image decoded), with
    #    what only A1111 says checked before any image is decoded: the model, and its sampler
    parsed = await parse_request(request, api, choose_model=partial(_chosen_model, request.app.state.backend))
    body: A1111Txt2Img = parsed.body
    # 2. generate each image in turn (seed, seed + 1, ...), 3. encode as PNG carrying its record
    gens = parsed.per_image()
    carried = request.app.state.config.image_metadata
    images, results, records = [], [], []
    for gen in gens:
        result = await generate(request, route, gen, parsed.model)
        record = await record_for(request, ImageOutput(metadata=True), gen, result) or fallback_record(gen, result)
        if body.send_images:
            png, _ = await encode(result.image, "image/png", record=record if carried else None)
            images.append(base64.b64encode(png).decode())
        results.append(result)
        records.append(record)
    return images_answer(body, images, gens, results, records)


def _chosen_model(backend, body: A1111Txt2Img, model: str | None, loras: list) -> str | None:
    """The model `override_settings.sd_model_checkpoint` names (a hosted model, else a 400: A1111
    would use the model loaded, whichever it is), else `model`; 400 for a sampler other than
    the one of the model the request goes to (that model; with adapters and no model named,
    any hosted one their base model may pick)."""
    name = body.checkpoint()
    info = backend.ready_info()
    if name is not None:
        if not isinstance(name, str) or not backend.is_model(name):
            hosted = ", ".join((info or {}).get("models", []))
            raise BadRequest(f"override_settings.sd_model_checkpoint {name!r} is not a model this server hosts "
                             f"({hosted}): GET /sdapi/v1/sd-models lists them")
        model = name
    if model is not None or info is None:  # (none while the models load: their samplers are not known yet)
        goes_to = [model] if model is not None else []
    else:  # the default model, or with adapters whichever their base model picks
        goes_to = info["models"] if loras else [info["model"]]
    check_sampler(body, model_samplers(info, goes_to))
    return model


@router.get(PREFIX + "/loras")
async def loras(request: Request) -> list[dict]:
    """The adapters of the adapter folders as A1111 lists its LoRAs: `name` (what a
    `<lora:NAME:WEIGHT>` tag takes), `alias`, `path` (under the folder) and `metadata`; with
    --list-adapters-as-models only (their metadata may name the trainer's paths), else none."""
    return await run_in_threadpool(request.app.state.a1111_loras.rows)


@router.get(PREFIX + "/sd-models")
async def models(request: Request) -> list[dict]:
    """The hosted models as A1111 lists its checkpoints; `title` is what
    `override_settings.sd_model_checkpoint` takes."""
    info = request.app.state.backend.ready_info()
    if info is None:
        raise not_ready(request.app.state.backend.load_error)
    return sd_models(info["models"])


@router.get(PREFIX + "/progress")
async def progress(request: Request, skip_current_image: bool = False) -> dict:
    """A1111's progress of the caller's oldest generation in flight: `progress` (0 to 1),
    `eta_relative` (seconds), `state.sampling_step` of `sampling_steps`, and `current_image`
    (base64 PNG) when that request streams previews (`current_image` is null otherwise)."""
    now = request.app.state.progress.current(key_owner(request))
    image = None
    if now is not None and now.preview is not None and not skip_current_image:
        picture = await run_in_threadpool(now.preview.image)  # it may wait for a copy from the GPU
        image = base64.b64encode((await encode(picture, "image/png"))[0]).decode()
    return progress_answer(now, image)


@router.get(PREFIX + "/scripts")
async def scripts() -> dict:
    """A1111's scripts and extensions: none here (webuiapi reads this when it starts)."""
    return {"txt2img": [], "img2img": []}
