"""The adapter admin routes: list, load (and keep) and evict. On a server hosting several
models, each goes to the model the adapter's declared base model routes to."""

from fastapi import APIRouter, Depends, Request

from ...adapters.references import adapter_id_of
from ..auth import Access, require_admin_key

router = APIRouter(tags=[Access.ADMIN.value], dependencies=[Depends(require_admin_key)])


@router.get("/adapters")
async def list_adapters(request: Request):
    """Every adapter in the folder, downloaded or in a cache tier: id, `source` (folder, hub,
    url, civitai), where cached, whether kept and applied, and once read its base model, rank
    and size; `model` names the model holding it."""
    return await request.app.state.backend.list_adapters()


@router.post("/adapters/{adapter_id:path}/load")
async def load_adapter(adapter_id: str, request: Request):
    """Read the adapter into host RAM now (fetched first, when it is a URL or a Civitai AIR)
    and keep it cached until `DELETE`, across restarts too (the state folder records it); the
    answer's `id` is the one it is served under."""
    adapter_id = adapter_id_of(adapter_id)
    kept = await request.app.state.backend.keep_adapter(adapter_id)
    request.app.state.kept.add(adapter_id)  # kept again after a restart
    return {"id": adapter_id, "cached": "host", "kept": True, **kept}


@router.delete("/adapters/{adapter_id:path}")
async def evict_adapter(adapter_id: str, request: Request):
    """Stop keeping the adapter and drop it from every cache tier, a download's file too (read,
    or fetched, again when next used)."""
    adapter_id = adapter_id_of(adapter_id)
    await request.app.state.backend.evict_adapter(adapter_id)
    request.app.state.kept.remove(adapter_id)
    return {"id": adapter_id, "cached": "disk", "kept": False}
