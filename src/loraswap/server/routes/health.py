"""Liveness, readiness and Prometheus metrics (open unless `auth_health`)."""

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from loraswap.server.auth import Access, require_health_key

router = APIRouter(tags=[Access.HEALTH.value], dependencies=[Depends(require_health_key)])


@router.get("/health")
async def health():
    """The process is alive."""
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request):
    """200 once the model is warm and serving; 503 while loading (or if loading failed)."""
    backend = request.app.state.backend
    info = backend.ready_info()
    if info is None:
        return JSONResponse({"error": backend.load_error or "loading"}, status_code=503,
                            headers={"Retry-After": str(request.app.state.config.retry_after_s)})
    return {"status": "ready", **info}


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def metrics(request: Request) -> Response:
    """Prometheus text format."""
    state = request.app.state
    return Response(state.metrics.render(await state.backend.figures()), media_type=CONTENT_TYPE_LATEST)
