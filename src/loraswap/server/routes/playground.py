"""`GET /playground`: a page to try the server from a browser (plain HTML and JavaScript,
no build step, nothing fetched from elsewhere). The page is open, as `/docs` is: it holds
no secret, and sends the key typed into it with each call, so the API routes check it."""

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(include_in_schema=False)

PAGE = files("loraswap.server").joinpath("static/playground.html")


@router.get("/playground", response_class=HTMLResponse)
async def playground() -> HTMLResponse:
    return HTMLResponse(PAGE.read_text(encoding="utf-8"), headers={"Cache-Control": "no-cache"})
