"""The HTTP edge: Hugging Face Inference API, OpenAI images and videos APIs, health, metrics,
adapters.

`create_app` assembles it: the routers of `routes/` (module-level handlers that reach
everything through `request.app.state`: `config`, `backend`, `metrics`, `keys`, `urls`,
`videos`, `kept`, `kept_images`), the
error answers and the OpenAPI document. A backend (`backend.py`) routes and generates:
the GPU workers of this process (`LocalBackend`), or model replicas on Ray Serve
(`cluster.ingress.RayBackend`); handlers never run the pipeline. Known errors map to
their status with an error body (`error_bodies.py`: OpenAI's shape on `/v1/*`,
`{"error": ...}` elsewhere); anything else is logged with its traceback and answered with
a plain 500.
"""

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from loraswap.engine.engine import Engine
from loraswap.errors import LoraswapError
from loraswap.server.a1111.loras import LoraListing
from loraswap.server.access_log import loggable_path
from loraswap.server.auth import Keys, maybe_warn_open
from loraswap.server.backend import Backend, ClientGone, LocalBackend
from loraswap.server.config import ServerConfig
from loraswap.server.error_bodies import error_code, error_response, invalid_param
from loraswap.server.images.kept import KeptImages
from loraswap.server.kept_adapters import KeptAdapters
from loraswap.server.metrics import Metrics
from loraswap.server.openapi import document_api
from loraswap.server.request_ids import RequestIds
from loraswap.server.requests.decode_budget import DecodeBudget
from loraswap.server.requests.schemas import invalid_request_message
from loraswap.server.routes import ROUTERS
from loraswap.server.streaming.progress_board import ProgressBoard
from loraswap.server.url_book import UrlBook
from loraswap.server.videos.maker import video_maker
from loraswap.server.videos.store import VideoStore

logger = logging.getLogger("loraswap.server")


@asynccontextmanager
async def _lifespan(app: FastAPI):
    await app.state.backend.start()
    # video jobs a restart interrupted are made again, and kept adapters kept again, once the
    # backend serves; /ready does not wait on them
    app.state.videos.start(video_maker(app.state), app.state.backend)
    keeping = asyncio.get_running_loop().create_task(app.state.kept.keep_again(app.state.backend))
    sweeping = asyncio.get_running_loop().create_task(app.state.kept_images.sweep_every())  # expired image URLs
    yield
    keeping.cancel()
    sweeping.cancel()
    await app.state.videos.stop()  # unfinished videos are cancelled; the state folder keeps them for the next start
    await app.state.backend.stop()


def create_app(config: ServerConfig, engine_factory=Engine, backend: Backend | None = None) -> FastAPI:
    """The HTTP app over `backend`: by default the engines of this process (`LocalBackend`)."""
    keys = Keys.from_config(config)  # a bad keys file stops the start here, before any model loads
    maybe_warn_open(config, keys)
    app = FastAPI(title="loraswap", version="0.1.0", lifespan=_lifespan,
                  description="Thousands of LoRA adapters on warm, compiled diffusion models.")
    app.state.config = config
    app.state.keys = keys
    app.state.backend = backend or LocalBackend(app.state, config, engine_factory)
    app.state.urls = UrlBook()  # the URLs behind `url:` ids, and which keys named each (`url_book.py`)
    app.state.metrics = Metrics(app.state.urls)
    app.state.progress = ProgressBoard()  # the generations in flight, their steps and latest previews
    app.state.shutting_down = False  # set by `shutdown.start_draining` at SIGTERM
    app.state.decode_budget = DecodeBudget(config.max_decode_bytes)
    app.state.videos = VideoStore(config)
    app.state.kept = KeptAdapters(app.state.videos.state.folder)  # the same claimed state folder
    app.state.owner_secret = app.state.videos.state.owner_secret  # what keys are recorded under (`auth.key_digest`)
    app.state.a1111_loras = LoraListing(config)  # GET /sdapi/v1/loras
    app.state.kept_images = KeptImages(app.state.videos.state.folder, config.image_url_ttl_s,
                                       config.image_url_disk_bytes)
    app.state.started_at = int(time.time())  # the `created` of GET /v1/models
    _add_error_handlers(app)
    app.add_middleware(ContainUnexpected)
    app.add_middleware(RequestIds)  # outermost: its id and span cover everything the request causes
    for router in ROUTERS:
        app.include_router(router)
    document_api(app, config, keys)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(LoraswapError, _known_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(StarletteHTTPException, _http_error)


async def _known_error(request: Request, exc: LoraswapError):
    retry = exc.status == 503  # busy, or (an adapter changed while read) worth asking again
    retry_after = getattr(exc, "retry_after_s", None) or request.app.state.config.retry_after_s  # the error's own
    headers = ({"Retry-After": str(retry_after)} if retry else {}) | getattr(exc, "headers", {})  # (its own too)
    return error_response(request, exc.status, exc.message, headers or None, code=error_code(exc),
                          param=getattr(exc, "param", None))


async def _invalid_request(request: Request, exc: RequestValidationError):
    errors = exc.errors()
    return error_response(request, 400, invalid_request_message(errors), param=invalid_param(errors))


async def _http_error(request: Request, exc: StarletteHTTPException):
    # 404 for an unknown route, 405, and the 401 of a missing key (with WWW-Authenticate)
    return error_response(request, exc.status_code, str(exc.detail), exc.headers, code=getattr(exc, "code", None))


class ContainUnexpected:
    """Any other exception: logged once with its traceback and answered with a plain 500, the
    connection kept usable; a client that left is logged in a line. (An exception handler
    for `Exception` would not do: Starlette re-raises after answering, so uvicorn logs it a
    second time and drops the keep-alive connection without a `Connection: close`.) One
    raised after its response has started cannot be answered: uvicorn logs it and closes
    the connection."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            # uvicorn cancels what is left when its shutdown has waited long enough (`shutdown.py`):
            # answered as any request the shutdown stopped, not a traceback and a plain-text 500
            if not scope["app"].state.shutting_down:
                raise
            logger.info("%s %s: cancelled by the shutdown", scope["method"], loggable_path(scope["path"]))
            if not started:
                await error_response(scope, 503, "the server is shutting down; retry",
                                     {"Retry-After": str(scope["app"].state.config.retry_after_s)})(
                    scope, receive, send)
        except (ClientGone, ClientDisconnect):  # nobody to answer: no error of ours
            logger.info("%s %s: the client left", scope["method"], loggable_path(scope["path"]))
            if not started:
                await error_response(scope, 499, "the client closed the request")(scope, receive, send)
        except Exception as exc:
            if started:
                raise
            logger.error("unhandled error on %s %s", scope["method"], loggable_path(scope["path"]), exc_info=exc)
            await error_response(scope, 500, "internal server error")(scope, receive, send)
