"""The adapter admin routes: list, load (and keep) and evict. On a server hosting several
models, each goes to the model the adapter's declared base model routes to. An adapter
named by URL is scoped to the API keys that named its URL (`auth.py`): another key's
listing leaves it out, and its `url:` id is unknown (404) to that key's load and evict."""

from fastapi import APIRouter, Depends, Request

from loraswap.adapters.naming.references import adapter_id_of, pin_url, unpin_url
from loraswap.server.auth import Access, check_url_ids, require_admin_key, visible_adapter_rows
from loraswap.server.requests.parse import hold_named_urls, named_urls

router = APIRouter(tags=[Access.ADMIN.value], dependencies=[Depends(require_admin_key), Depends(hold_named_urls)])


@router.get("/adapters")
async def list_adapters(request: Request):
    """Every adapter in the folder, downloaded or in a cache tier: id, `source` (folder, hub,
    url, civitai), where cached, whether kept and applied, and once read its base model, rank
    and size; `model` names the model holding it. Files elsewhere: as `auth.visible_adapter_rows` says."""
    listing = await request.app.state.backend.list_adapters()
    listing["adapters"] = visible_adapter_rows(request, listing["adapters"])
    return listing


@router.post("/adapters/{adapter_id:path}/load")
async def load_adapter(adapter_id: str, request: Request):
    """Read the adapter into host RAM now (fetched first, when it is a URL or a Civitai AIR)
    and keep it cached until `DELETE`, across restarts too (the state folder records it); the
    answer's `id` is the one it is served under."""
    urls = named_urls(request)
    adapter_id = adapter_id_of(adapter_id, urls)
    check_url_ids(request, urls)
    kept = await request.app.state.backend.keep_adapter(adapter_id)
    pin_url(adapter_id)  # (a URL's: fetched again by it if its download is evicted while kept)
    request.app.state.kept.add(adapter_id)  # kept again after a restart
    return {"id": adapter_id, "cached": "host", "kept": True, **kept}


@router.delete("/adapters/{adapter_id:path}")
async def evict_adapter(adapter_id: str, request: Request):
    """Stop keeping the adapter and drop it from every tier, a download's file too (read,
    or fetched, again when next used)."""
    urls = named_urls(request)
    adapter_id = adapter_id_of(adapter_id, urls)
    check_url_ids(request, urls)
    await request.app.state.backend.evict_adapter(adapter_id)
    request.app.state.kept.remove(adapter_id)
    unpin_url(adapter_id)
    if urls is not None:
        urls.release(accepted=False)  # evicted: nothing to keep its URL for
    return {"id": adapter_id, "cached": "disk", "kept": False}
