"""One request type for both HTTP APIs: the engine's `GenerateRequest` plus the model the
route names, parsed from a Hugging Face or an OpenAI body by one function (`parse_request`).
"""

import json
from dataclasses import dataclass

from fastapi import Request
from pydantic import ValidationError

from ..engine.config import GenerateRequest
from ..errors import BadRequest
from .backend import Backend
from .limits import check_limits
from .schemas import ApiBody, describe, parse_lora_header, parse_size


@dataclass(frozen=True)
class ImageRequest:
    """What to generate, whichever API asked: the engine's request, the hosted base model the
    route names (None: the one the adapters route to) and how many images (OpenAI `n`)."""

    generate: GenerateRequest
    model: str | None = None
    count: int = 1

    def per_image(self) -> list[GenerateRequest]:
        """One request per image; with a seed, image i gets seed + i (checked at parse)."""
        seed = self.generate.seed
        if self.count == 1:
            return [self.generate]
        return [self.generate.model_copy(update={"seed": None if seed is None else seed + i})
                for i in range(self.count)]


async def read_json(request: Request, max_bytes: int, example: str):
    """The body as JSON, refused (400) past `max_bytes` before it is read when the client
    declares its length, and as soon as it is read otherwise."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise BadRequest(f"the body is {declared} bytes; the limit is {max_bytes}")
    body = await request.body()
    if len(body) > max_bytes:
        raise BadRequest(f"the body is {len(body)} bytes; the limit is {max_bytes}")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest(f"the body must be JSON: {example}") from None


async def parse_request(request: Request, api: type[ApiBody], path_model: str | None = None) -> ImageRequest:
    """The one parse of both APIs. `path_model`: the model id in the URL (HF `/models/{id}`)."""
    config, backend = request.app.state.config, request.app.state.backend
    # 1. the body, as the API's typed request
    body = api.parse(await read_json(request, config.max_body_bytes, api.example))
    fields = body.fields()
    named = path_model or fields.pop("model", None)
    # 2. every field within its bounds (one table: limits.LIMITS), and the values they give:
    #    OpenAI's size as a width and a height, the seed of the last of n images
    check_limits(fields, config)
    if fields.get("size"):
        fields["width"], fields["height"] = parse_size(fields["size"])
    count = fields.get("n") or 1
    last_seed = fields["seed"] + count - 1 if fields.get("seed") is not None else None
    check_limits({"width": fields.get("width"), "height": fields.get("height"), "seed": last_seed}, config)
    # 3. the name: a hosted base model, or adapters put before those of the `lora` header
    model, loras = _model_and_adapters(backend, named, api.names_blend, request.headers.get("lora"))
    # 4. the engine's request (its own checks too: the blend's are the engine's)
    try:
        generate = GenerateRequest(prompt=fields["prompt"], negative_prompt=fields.get("negative_prompt"),
                                   steps=fields.get("num_inference_steps"), guidance=fields.get("guidance_scale"),
                                   width=fields.get("width"), height=fields.get("height"), seed=fields.get("seed"),
                                   loras=loras)
    except ValidationError as e:
        raise BadRequest(describe(e.errors())) from None
    return ImageRequest(generate, model, count)


def _model_and_adapters(backend: Backend, named: str | None, blend: bool,
                        header: str | None) -> tuple[str | None, list[tuple[str, float]]]:
    """The hosted model `named` is, or the adapters it names (weight 1.0, or a blend when the API
    allows one) with the header's; an adapter in both takes the header's weight."""
    loras = parse_lora_header(header)
    if not named:
        return None, loras
    if backend.is_model(named):
        return named, loras
    by_name = parse_lora_header(named) if blend else [(named, 1.0)]
    in_header = {adapter_id for adapter_id, _ in loras}
    return None, [lora for lora in by_name if lora[0] not in in_header] + loras
