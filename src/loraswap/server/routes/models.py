"""OpenAI models API: `GET /v1/models` lists what a request's `model` may name, as
`client.models.list()` reads it; `GET /v1/models/{id}` is one of them (`.retrieve`).

The hosted base models, and with `--list-adapters-as-models` the adapters the server may
serve (those of the folder, downloaded or cached; a file elsewhere as `GET /adapters` lists
it: `auth.visible_adapter_rows`). A model card has OpenAI's fields (`id`, `object`,
`created`, `owned_by`) and, as vLLM gives its LoRA modules, `root` and `parent`: an
adapter's parent is its base model once read (else the hosted model holding it, else null).
"""

from typing import ClassVar

from fastapi import APIRouter, Depends, Request

from loraswap.errors import LoraswapError
from loraswap.server.auth import Access, require_api_key, visible_adapter_rows
from loraswap.server.backend import not_ready

router = APIRouter(tags=[Access.GENERATION.value], dependencies=[Depends(require_api_key)])

OWNER = "loraswap"


class ModelNotFound(LoraswapError):
    status = 404
    code: ClassVar[str | None] = "model_not_found"


@router.get("/v1/models")
async def list_models(request: Request):
    """The hosted models (and, with --list-adapters-as-models, the adapters), as OpenAI's list."""
    return {"object": "list", "data": await _cards(request)}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request):
    """One model of the list; 404 for any other name."""
    for card in await _cards(request):
        if card["id"] == model_id:
            return card
    adapters = " or an adapter" if request.app.state.config.list_adapters_as_models else ""
    raise ModelNotFound(f"the model {model_id[:200]!r} does not exist: GET /v1/models lists the hosted models"
                        f"{adapters}")


async def _cards(request: Request) -> list[dict]:
    state = request.app.state
    info = state.backend.ready_info()
    if info is None:
        raise not_ready(state.backend.load_error)
    created = state.started_at
    cards = [_card(model, created, None) for model in info["models"]]
    if state.config.list_adapters_as_models:
        hosted = set(info["models"])
        for row in visible_adapter_rows(request, (await state.backend.list_adapters())["adapters"]):
            if row["id"] not in hosted:
                cards.append(_card(row["id"], created, row.get("base_model") or row.get("model")))
    return cards


def _card(model_id: str, created: int, parent: str | None) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": OWNER, "root": model_id,
            "parent": parent}

