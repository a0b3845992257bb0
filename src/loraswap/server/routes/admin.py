"""The adapter admin routes: list, load (and keep) and evict. On a server hosting several
models, each goes to the model the adapter's declared base model routes to. An adapter
named by URL is scoped to the API keys that named its URL (`auth.py`): another key's
listing leaves it out, and its `url:` id is unknown (404) to that key's load and evict."""

from fastapi import APIRouter, Depends, Request

from loraswap.adapters.reference import AdapterRef
from loraswap.server.auth import Access, require_admin_key, visible_adapter_rows
from loraswap.server.requests.parse import hold_named_urls, named_urls
from loraswap.server.url_book import scoped_refs

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
    ref = _named_ref(request, adapter_id)
    kept = await request.app.state.backend.keep_adapter(ref)
    request.app.state.urls.pin(ref.adapter_id)  # (a URL's: fetched again by it if its download is evicted while kept)
    request.app.state.kept.add(ref.adapter_id)  # kept again after a restart
    return {"id": ref.adapter_id, "cached": "host", "kept": True, **kept}


@router.delete("/adapters/{adapter_id:path}")
async def evict_adapter(adapter_id: str, request: Request):
    """Stop keeping the adapter and drop it from every tier, a download's file too (read,
    or fetched, again when next used)."""
    ref = _named_ref(request, adapter_id)
    await request.app.state.backend.evict_adapter(ref)
    request.app.state.kept.remove(ref.adapter_id)
    request.app.state.urls.unpin(ref.adapter_id)
    urls = named_urls(request)
    if urls is not None:
        urls.release(accepted=False)  # evicted: nothing to keep its URL for
    return {"id": ref.adapter_id, "cached": "disk", "kept": False}


def _named_ref(request: Request, name: str) -> AdapterRef:
    """The ref of the adapter the path names (an id, or a URL, AIR, s3:// reference), checked
    here once: a `url:` id within the key's scope, its URL filled in (`url_book.scoped_refs`)."""
    [[ref]] = scoped_refs(request, named_urls(request), [[AdapterRef.named(name)]])
    return ref
