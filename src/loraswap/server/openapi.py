"""The OpenAPI document: each field with this server's limits (`limits.LIMITS`), the
error answers each route really gives (OpenAI's body on `/v1/*`, `{"error": ...}` elsewhere:
`error_bodies.py`), and the bearer key where a route needs one, so that clients (and the
fuzz test) see the contract."""

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from loraswap.server.auth import Access, Keys
from loraswap.server.config import ServerConfig
from loraswap.server.error_bodies import ERROR_SCHEMA, OPENAI_ERROR_SCHEMA, is_openai_path
from loraswap.server.requests.limits import constrain, schema_limits

LORA_HEADER = {"name": "lora", "in": "header", "required": False, "schema": {"type": "string"},
               "description": "Adapter id (or URL, Civitai AIR, s3://bucket/key), or several with weights: "
                              "`id1:0.8, id2:0.5`."}

# Statuses each route answers besides 200, with an error body; FastAPI's own 422 (a `detail`
# list) never reaches a client: request validation errors are answered 400.
_ERRORS_GENERATE = ("400", "403", "404", "422", "502", "503")
_ERRORS_IMAGES = (*_ERRORS_GENERATE, "507")  # 507: an image asked by URL that could not be kept
_ERRORS = {"/": _ERRORS_GENERATE, "/models/{model_id}": _ERRORS_GENERATE,
           "/v1/images/generations": _ERRORS_IMAGES, "/v1/images/edits": _ERRORS_IMAGES,
           "/v1/images/files/{name}": ("404",), "/v1/models": ("503",), "/v1/models/{model_id}": ("404", "503"),
           "/ready": ("503",), "/adapters": ("503",),
           "/adapters/{adapter_id}/load": _ERRORS_GENERATE,
           "/adapters/{adapter_id}": ("400", "403", "404", "422", "503"),
           "/v1/videos": ("400", "422", "503"), "/v1/videos/{video_id}": ("404",),
           "/v1/videos/{video_id}/content": ("400", "404", "409"),
           "/sdapi/v1/txt2img": _ERRORS_GENERATE, "/sdapi/v1/img2img": _ERRORS_GENERATE,
           "/sdapi/v1/sd-models": ("503",), "/sdapi/v1/progress": ("400",)}
_ERROR_TEXT = {"400": "Bad request: the message says what to fix.", "401": "No key, or a wrong one: send "
               "`Authorization: Bearer KEY`.",
               "403": "An adapter refused: a hub id by allow/deny, or a URL, Civitai AIR or bucket this server "
               "does not fetch from (the message names the flag).",
               "502": "An adapter named by URL, Civitai AIR or bucket could not be fetched: its host failed or did "
               "not answer in time.",
               "404": "Unknown adapter, model, or unknown (or expired) video or image.",
               "422": "The adapter does not fit the hosted base model, or that model "
               "takes no image (or no mask).",
               "409": "The video has not completed (or it failed): poll GET /v1/videos/{video_id}.",
               "507": "The image asked for by URL could not be kept in the state folder (its cap, a full disk): "
               "ask for response_format b64_json.",
               "503": "Queue full, model loading, shutting down, out of memory, or an adapter's file replaced while "
               "it was read; retry after Retry-After."}
BEARER = {"type": "http", "scheme": "bearer",
          "description": "An API key (generation routes) or an admin key (adapter routes), when the server has "
                         "keys: `Authorization: Bearer KEY`, as the openai client and huggingface_hub send it."}


def json_body(schema: dict) -> dict:
    """An OpenAPI request body of this JSON Schema, its `$defs` inlined."""
    return {"required": True, "content": {"application/json": {"schema": _inlined(schema)}}}


def form_body(schema: dict) -> dict:
    """An OpenAPI multipart/form-data body of this JSON Schema: a field is absent rather than
    null, and its `format: binary` fields are image files."""
    schema = _inlined(schema)
    for name, prop in schema["properties"].items():
        branches = [b for b in prop.pop("anyOf", []) if b.get("type") != "null"]
        prop.update(branches[0] if branches else {})
    files = [name for name, prop in schema["properties"].items() if prop.get("format") == "binary"]
    encoding = {name: {"contentType": "image/png, image/jpeg, image/webp"} for name in files}
    return {"required": True, "content": {"multipart/form-data": {"schema": schema, "encoding": encoding}}}


def _inlined(schema: dict) -> dict:
    """`schema` with its `$defs` put where they are referenced."""
    defs = {}

    def collect(node):
        if isinstance(node, dict):
            defs.update(node.pop("$defs", {}))
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for value in node:
                collect(value)

    def inline(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    collect(schema)
    return inline(schema)


def document_api(app: FastAPI, config: ServerConfig, keys: Keys) -> None:
    """Build the schema once, on first request of /openapi.json."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            components = schema.setdefault("components", {})
            components["securitySchemes"] = {"bearer": BEARER}
            schemas = components.setdefault("schemas", {})
            schemas.pop("HTTPValidationError", None)
            schemas.pop("ValidationError", None)
            schemas["Error"] = ERROR_SCHEMA
            schemas["OpenAIError"] = OPENAI_ERROR_SCHEMA
            for path, operations in schema["paths"].items():
                error = "OpenAIError" if is_openai_path(path) else "Error"
                for operation in operations.values():
                    _document_operation(operation, _ERRORS.get(path, ()), keys, error)
            constrain(schema, schema_limits(config))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _document_operation(operation: dict, statuses: tuple[str, ...], keys: Keys, error: str) -> None:
    """The operation's error answers, and its key when this server asks for one."""
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    tags = operation.get("tags") or []
    if any(keys.accepted(Access(tag)) for tag in tags if tag in {a.value for a in Access}):
        operation["security"] = [{"bearer": []}]
        statuses = ("401", *statuses)
    ref = {"$ref": f"#/components/schemas/{error}"}
    for status in statuses:
        responses[status] = {"description": _ERROR_TEXT[status], "content": {"application/json": {"schema": ref}}}
        if status == "503":
            responses[status]["headers"] = {"Retry-After": {"schema": {"type": "string"}}}
        if status == "401":
            responses[status]["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
