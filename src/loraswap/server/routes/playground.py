"""`GET /playground`: a page to try the server from a browser (plain HTML and JavaScript,
no build step, nothing fetched from elsewhere). The page is open, as `/docs` is: it holds
no secret, and sends the key typed into it with each call, so the API routes check it.

It is sent with a Content-Security-Policy that runs only its own inline script and style
(by their hashes), talks only to this server, and lets no other site frame it."""

import base64
import hashlib
import re
from functools import cache
from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(include_in_schema=False)

PAGE = files("loraswap.server").joinpath("static/playground.html")


def _hashes(page: str, tag: str) -> str:
    """CSP sources allowing exactly the page's inline `<tag>` blocks (what a browser hashes:
    the text between the tags), whatever attributes the tag has."""
    blocks = re.findall(rf"<{tag}(?:\s[^>]*)?>(.*?)</{tag}>", page, re.DOTALL)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks)


@cache
def _page() -> tuple[str, dict[str, str]]:
    page = PAGE.read_text(encoding="utf-8")
    policy = (f"default-src 'none'; script-src {_hashes(page, 'script')}; style-src {_hashes(page, 'style')}; "
              "img-src 'self' blob: data:; media-src 'self' blob:; connect-src 'self'; base-uri 'none'; "
              "form-action 'none'; frame-ancestors 'none'")
    return page, {"Cache-Control": "no-cache", "Content-Security-Policy": policy, "X-Frame-Options": "DENY",
                  "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


@router.get("/playground", response_class=HTMLResponse)
async def playground() -> HTMLResponse:
    page, headers = _page()
    return HTMLResponse(page, headers=headers)
