"""The HTTP routes, one module per API: module-level handlers on an `APIRouter` each, reaching
the backend, the configuration and the metrics through `request.app.state`."""

from . import admin, health, hf, openai, playground, videos

ROUTERS = (hf.router, openai.router, videos.router, admin.router, health.router, playground.router)
