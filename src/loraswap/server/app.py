"""The HTTP edge: Hugging Face Inference API, OpenAI images API, health, metrics, adapters.

Handlers validate and answer; a backend (`backend.py`) routes and generates: the GPU
workers of this process (`LocalBackend`), or model replicas on Ray Serve
(`cluster.ingress.RayBackend`). Handlers never run the pipeline. Known errors map to
their status with `{"error": ...}`; anything else is logged with its traceback and
answered with a plain 500.
"""

import base64
import io
import json
import logging
import time
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.config import GenerateRequest
from ..engine.engine import Engine, GenerateResult
from ..errors import BadRequest, LoraswapError, Overloaded
from .backend import Backend, ClientGone, LocalBackend
from .config import ServerConfig
from .metrics import Metrics
from .schemas import HFRequest, OpenAIImageRequest, parse_lora_header, parse_size

logger = logging.getLogger("loraswap.server")

IMAGE_FORMATS = (("image/png", "PNG"), ("image/webp", "WEBP"), ("image/jpeg", "JPEG"))


def create_app(config: ServerConfig, engine_factory=Engine, backend: Backend | None = None) -> FastAPI:
    """The HTTP app over `backend`: by default the engines of this process (`LocalBackend`)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await app.state.backend.start()
        yield
        await app.state.backend.stop()

    app = FastAPI(title="loraswap", version="0.1.0", lifespan=lifespan,
                  description="Thousands of LoRA adapters on warm, compiled diffusion models.")
    app.state.config = config
    app.state.backend = backend or LocalBackend(app.state, config, engine_factory)
    app.state.metrics = Metrics()
    _add_error_handlers(app)
    _add_routes(app, config)
    _document_api(app, config)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(LoraswapError)
    async def known_error(request: Request, exc: LoraswapError):
        headers = {"Retry-After": str(app.state.config.retry_after_s)} if isinstance(exc, Overloaded) else None
        return JSONResponse({"error": exc.message}, status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        return JSONResponse({"error": _describe(exc.errors())}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse({"error": "internal server error"}, status_code=500)


def _describe(errors) -> str:
    parts = []
    for err in errors:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "invalid request: " + "; ".join(parts)


def _add_routes(app: FastAPI, config: ServerConfig) -> None:
    state = app.state
    backend: Backend = state.backend

    async def read_json(request: Request):
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > config.max_body_bytes:
            raise BadRequest(f"the body is {declared} bytes; the limit is {config.max_body_bytes}")
        body = await request.body()
        if len(body) > config.max_body_bytes:
            raise BadRequest(f"the body is {len(body)} bytes; the limit is {config.max_body_bytes}")
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest('the body must be JSON: {"inputs": "a prompt", "parameters": {...}}') from None

    def build_request(prompt, loras, negative_prompt=None, steps=None, guidance=None, width=None, height=None,
                      seed=None) -> GenerateRequest:
        if not prompt or not prompt.strip():
            raise BadRequest("the prompt is empty")
        if len(prompt) > config.max_prompt_chars:
            raise BadRequest(f"the prompt has {len(prompt)} characters; the limit is {config.max_prompt_chars}")
        if negative_prompt is not None and len(negative_prompt) > config.max_prompt_chars:
            raise BadRequest(f"the negative prompt is over {config.max_prompt_chars} characters")
        for name, value, limit in (("width", width, config.max_width), ("height", height, config.max_height)):
            if value is not None and (value < 8 or value > limit or value % 8):
                raise BadRequest(f"{name} {value} must be a multiple of 8 between 8 and {limit}")
        if steps is not None and not 1 <= steps <= config.max_steps:
            raise BadRequest(f"num_inference_steps {steps} must be between 1 and {config.max_steps}")
        try:  # bounds of guidance and seed: GenerateRequest's; the blend: the engine's
            return GenerateRequest(prompt=prompt, negative_prompt=negative_prompt, steps=steps, guidance=guidance,
                                   width=width, height=height, seed=seed, loras=loras)
        except ValidationError as e:
            raise BadRequest(_describe(e.errors())) from None

    async def run(request: Request, route: str, gen: GenerateRequest, model: str | None = None) -> GenerateResult:
        started = time.perf_counter()
        status = 500
        result = None
        try:
            # routed to the engine hosting the adapters' base model, generated on its GPU worker
            result = await backend.generate(gen, model, request.is_disconnected)
            status = 200
            return result
        except torch.OutOfMemoryError:
            status = 503
            raise Overloaded("the GPU ran out of memory for this request; retry, or ask for a smaller image")
        except ClientGone:
            status = 499
            raise
        except LoraswapError as e:
            status = e.status
            raise
        finally:
            state.metrics.requests.labels(route, str(status)).inc()
            if result is not None:
                if result.swap_seconds:
                    state.metrics.swap_seconds.observe(result.swap_seconds)
                state.metrics.generate_seconds.observe(result.generate_seconds)
            logger.info("%s adapters=%s swap=%.1fms generate=%.2fs total=%.2fs status=%d", route,
                        ",".join(f"{a}:{w:g}" for a, w in gen.loras) or "-",
                        result.swap_seconds * 1e3 if result else 0.0, result.generate_seconds if result else 0.0,
                        time.perf_counter() - started, status)

    async def encode(image, accept: str) -> tuple[bytes, str]:
        media, fmt = next(((m, f) for m, f in IMAGE_FORMATS if m in accept), ("image/jpeg", "JPEG"))

        def save():
            buffer = io.BytesIO()
            image.save(buffer, format=fmt, **({"quality": 95} if fmt in ("JPEG", "WEBP") else {}))
            return buffer.getvalue()

        return await run_in_threadpool(save), media

    async def hf_generate(request: Request, route: str, path_model: str | None) -> Response:
        # 1. parse the body: {"inputs": ..., "parameters": {...}} or a bare JSON string
        body = await read_json(request)
        try:
            hf = HFRequest(inputs=body) if isinstance(body, str) else HFRequest.model_validate(body)
        except ValidationError as e:
            raise BadRequest(_describe(e.errors())) from None
        # 2. adapters: the `lora` header, and the path's model id when it names an adapter
        loras = parse_lora_header(request.headers.get("lora"))
        model = None
        if path_model and backend.is_model(path_model):
            model = path_model  # the path names a hosted base model
        elif path_model and path_model not in dict(loras):
            loras = [(path_model, 1.0), *loras]  # the path names an adapter
        p = hf.parameters
        if p.target_size and (p.width is not None or p.height is not None):
            raise BadRequest("parameters give both width/height and target_size: give one of them")
        width, height = (p.target_size.width, p.target_size.height) if p.target_size else (p.width, p.height)
        gen = build_request(hf.inputs, loras, p.negative_prompt, p.num_inference_steps, p.guidance_scale,
                            width, height, p.seed)
        # 3. generate on the GPU worker, 4. encode as the client accepts
        result = await run(request, route, gen, model)
        data, media = await encode(result.image, request.headers.get("accept", ""))
        total = result.swap_seconds + result.generate_seconds
        return Response(data, media_type=media, headers={"x-compute-time": f"{total:.4f}",
                                                         "x-swap-ms": f"{result.swap_seconds * 1e3:.2f}",
                                                         "x-seed": str(result.seed)})

    hf_extra = _hf_openapi()

    @app.post("/", openapi_extra=hf_extra, response_class=Response,
              responses={200: {"content": {"image/jpeg": {}, "image/png": {}, "image/webp": {}}}})
    async def generate_root(request: Request):
        """Hugging Face Inference API text-to-image; adapter from the `lora` header."""
        return await hf_generate(request, "/", None)

    @app.post("/models/{model_id:path}", openapi_extra=hf_extra, response_class=Response,
              responses={200: {"content": {"image/jpeg": {}, "image/png": {}, "image/webp": {}}}})
    async def generate_model(model_id: str, request: Request):
        """As `POST /`; `model_id` is the base model's name or an adapter id."""
        return await hf_generate(request, "/models", model_id)

    @app.post("/v1/images/generations", openapi_extra={"parameters": hf_extra["parameters"]})
    async def openai_generate(body: OpenAIImageRequest, request: Request):
        """OpenAI images API: `model` is an adapter id (`id1:0.8, id2:0.5` to blend) or the base model."""
        if body.response_format != "b64_json":
            raise BadRequest("response_format must be 'b64_json'; this server does not host image URLs")
        if not 1 <= body.n <= config.max_images:
            raise BadRequest(f"n must be between 1 and {config.max_images}")
        loras = parse_lora_header(request.headers.get("lora"))
        model = None
        if body.model and backend.is_model(body.model):
            model = body.model
        elif body.model:
            loras = parse_lora_header(body.model) + loras
        width, height = parse_size(body.size)
        data = []
        for i in range(body.n):
            seed = None if body.seed is None else body.seed + i
            gen = build_request(body.prompt, loras, body.negative_prompt, body.num_inference_steps,
                                body.guidance_scale, width, height, seed)
            result = await run(request, "/v1/images/generations", gen, model)
            png, _ = await encode(result.image, "image/png")
            data.append({"b64_json": base64.b64encode(png).decode(), "revised_prompt": body.prompt})
        return {"created": int(time.time()), "data": data}

    @app.get("/health")
    async def health():
        """The process is alive."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        """200 once the model is warm and serving; 503 while loading (or if loading failed)."""
        info = backend.ready_info()
        if info is None:
            return JSONResponse({"error": backend.load_error or "loading"}, status_code=503,
                                headers={"Retry-After": str(config.retry_after_s)})
        return {"status": "ready", **info}

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics():
        """Prometheus text format."""
        return Response(state.metrics.render(await backend.figures()), media_type=CONTENT_TYPE_LATEST)

    @app.get("/adapters")
    async def list_adapters():
        """Every adapter: id, base model, rank, bytes, where cached."""
        return await backend.list_adapters()

    @app.post("/adapters/{adapter_id:path}/load")
    async def load_adapter(adapter_id: str):
        """Read the adapter into host RAM now and pin it there."""
        return {"id": adapter_id, "cached": "host", "pinned": True, **await backend.pin_adapter(adapter_id)}

    @app.delete("/adapters/{adapter_id:path}")
    async def evict_adapter(adapter_id: str):
        """Unpin the adapter and drop it from host RAM."""
        await backend.unpin_adapter(adapter_id)
        return {"id": adapter_id, "cached": "disk", "pinned": False}


def _hf_openapi() -> dict:
    params = HFRequest.model_json_schema()
    defs = params.pop("$defs", {})

    def inline(schema):
        if isinstance(schema, dict):
            if "$ref" in schema:
                return inline(defs[schema["$ref"].rsplit("/", 1)[-1]])
            return {k: inline(v) for k, v in schema.items()}
        if isinstance(schema, list):
            return [inline(v) for v in schema]
        return schema

    body = {"anyOf": [{"type": "string"}, inline(params)]}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "parameters": [{"name": "lora", "in": "header", "required": False, "schema": {"type": "string"},
                            "description": "Adapter id, or several with weights: `id1:0.8, id2:0.5`."}]}


# Statuses each route answers besides 200, as {"error": ...}; FastAPI's own 422 (a `detail`
# list) never reaches a client: request validation errors are answered 400.
_ERRORS_GENERATE = ("400", "403", "404", "422", "503")
_ERRORS = {"/": _ERRORS_GENERATE, "/models/{model_id}": _ERRORS_GENERATE,
           "/v1/images/generations": _ERRORS_GENERATE, "/ready": ("503",), "/adapters": ("503",),
           "/adapters/{adapter_id}/load": ("400", "403", "404", "422", "503"),
           "/adapters/{adapter_id}": ("400", "403", "404", "503")}
_ERROR_TEXT = {"400": "Bad request: the message says what to fix.", "403": "Hub adapter refused by allow/deny.",
               "404": "Unknown adapter.", "422": "The adapter does not fit the hosted base model.",
               "503": "Queue full, model loading, shutting down or out of memory; retry after Retry-After."}


def _document_api(app: FastAPI, config: ServerConfig) -> None:
    """The OpenAPI schema with this server's limits on each field and the `{"error": ...}`
    answers each route really gives, so that clients (and the fuzz test) see the contract."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.pop("HTTPValidationError", None)
            components.pop("ValidationError", None)
            components["Error"] = {"type": "object", "properties": {"error": {"type": "string"}},
                                   "required": ["error"]}
            ref = {"$ref": "#/components/schemas/Error"}
            for path, operations in schema["paths"].items():
                for operation in operations.values():
                    responses = operation.setdefault("responses", {})
                    responses.pop("422", None)
                    for status in _ERRORS.get(path, ()):
                        responses[status] = {"description": _ERROR_TEXT[status],
                                             "content": {"application/json": {"schema": ref}}}
                        if status == "503":
                            responses[status]["headers"] = {"Retry-After": {"schema": {"type": "string"}}}
            _constrain(schema, _limits(config))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _limits(config: ServerConfig) -> dict[str, dict]:
    """Bounds by field name, as `build_request`, `GenerateRequest` and the OpenAI handler check them."""
    prompt = {"minLength": 1, "maxLength": config.max_prompt_chars, "pattern": r"\S"}
    return {"inputs": prompt, "prompt": prompt, "negative_prompt": {"maxLength": config.max_prompt_chars},
            "num_inference_steps": {"minimum": 1, "maximum": config.max_steps},
            "guidance_scale": {"minimum": 0, "maximum": 50},
            "width": {"minimum": 8, "maximum": config.max_width, "multipleOf": 8},
            "height": {"minimum": 8, "maximum": config.max_height, "multipleOf": 8},
            "seed": {"minimum": 0, "maximum": 2**63 - 1}, "n": {"minimum": 1, "maximum": config.max_images},
            "response_format": {"enum": ["b64_json"]}, "size": {"pattern": r"^(auto|\d{1,5}x\d{1,5})$"}}


def _constrain(node, limits: dict[str, dict]) -> None:
    """Add `limits` to every property of those names (the non-null branch of an optional one)."""
    if isinstance(node, list):
        for item in node:
            _constrain(item, limits)
        return
    if not isinstance(node, dict):
        return
    for name, prop in (node.get("properties") or {}).items():
        if name in limits and isinstance(prop, dict):
            for branch in prop.get("anyOf", [prop]):
                if branch.get("type") != "null":
                    branch.update(limits[name])
    for value in node.values():
        _constrain(value, limits)
