"""The HTTP routes, one module per API: module-level handlers on an `APIRouter` each, reaching
the backend, the configuration and the metrics through `request.app.state`."""

from loraswap.server.routes import a1111, admin, health, hf, image_files, models, openai, playground, videos

ROUTERS = (hf.router, openai.router, image_files.router, models.router, videos.router, a1111.router, admin.router,
           health.router, playground.router)
