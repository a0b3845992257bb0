"""API keys, as OpenAI-compatible servers check them: `Authorization: Bearer KEY`.

That header is what the `openai` client (`api_key=`) and `huggingface_hub`'s
`InferenceClient(token=...)` send. Three kinds of route:

- generation (`POST /`, `/models/...`, `/v1/images/generations`, `/v1/images/edits`, and
  every `/v1/videos` route): an API key, or an admin key, once any API key is configured;
- adapter admin (`GET /adapters`, `POST /adapters/{id}/load`, `DELETE /adapters/{id}`):
  an admin key once any is configured, else as generation (an API key, if any);
- health (`/health`, `/ready`, `/metrics`): open, unless `auth_health` (then any key).

An adapter named by URL (a signed URL is one key's secret) is scoped to the API keys that
named its URL: another API key neither lists it (`GET /adapters`), nor evicts, keeps or
generates with it by its `url:` id; it may name the URL itself. An admin key, and every
client of a server without API keys, sees them all.

`/docs` and `/openapi.json` stay open: they describe the API, not what it serves.

A missing or wrong key is answered 401 with `WWW-Authenticate: Bearer` by a route
dependency, which runs before the handler reads the body, so it costs no parsing and no
GPU work. Keys are compared in constant time and never logged.
"""

import enum
import hashlib
import hmac
import ipaddress
import logging
from dataclasses import dataclass

from fastapi import HTTPException, Request

from loraswap.adapters.reference import is_remote
from loraswap.server.config import ServerConfig
from loraswap.server.error_bodies import INVALID_API_KEY

logger = logging.getLogger("loraswap.server")


class Access(str, enum.Enum):
    """Which keys a route takes; also the route's OpenAPI tag."""

    GENERATION = "generation"
    ADMIN = "adapters"
    HEALTH = "health"


@dataclass(frozen=True)
class Keys:
    api: tuple[bytes, ...] = ()
    admin: tuple[bytes, ...] = ()
    health: bool = False  # ask for a key on the health routes too

    def __repr__(self) -> str:  # never the keys themselves
        return f"Keys(api={len(self.api)}, admin={len(self.admin)}, health={self.health})"

    @classmethod
    def from_config(cls, config: ServerConfig) -> "Keys":
        """The configured keys, with those of `api_keys_file`; ValueError (naming no key) for a
        file that is missing or holds none, or for a key that a header cannot carry."""
        api = list(config.api_keys)
        if config.api_keys_file is not None:
            api += _read_keys_file(config)
        for kind, keys in (("api key", api), ("admin key", config.admin_keys)):
            for number, key in enumerate(keys, 1):
                if not key or any(c.isspace() or not c.isprintable() for c in key):
                    raise ValueError(f"{kind} {number} is empty or holds a space or a control character: "
                                     "an Authorization header cannot carry it")
        return cls(tuple(k.encode() for k in api), tuple(k.encode() for k in config.admin_keys),
                   config.auth_health)

    def accepted(self, access: Access) -> tuple[bytes, ...]:
        """The keys a route of this kind takes; () when it is open."""
        if access is Access.GENERATION:
            return self.api + self.admin if self.api else ()
        if access is Access.ADMIN:
            return self.admin or self.api
        return self.api + self.admin if self.health else ()


def _read_keys_file(config: ServerConfig) -> list[str]:
    path = config.api_keys_file
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"api_keys_file {path} cannot be read: {e.strerror}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"api_keys_file {path} holds no key (one key a line; # starts a comment)")
    return keys


def bearer_token(request: Request) -> bytes | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token.encode() if scheme.lower() == "bearer" and token else None


def matches(token: bytes, keys: tuple[bytes, ...]) -> bool:
    """Whether `token` is one of `keys`, compared with every key in constant time (no early
    exit: the time does not say which key came close)."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(token, key)
    return found


def _check(request: Request, access: Access) -> None:
    keys: Keys = request.app.state.keys
    accepted = keys.accepted(access)
    if not accepted:
        return
    token = bearer_token(request)
    if token is not None and matches(token, accepted):
        return
    what = "an admin key" if access is Access.ADMIN and keys.admin else "an API key"
    problem = "no key was sent" if token is None else "the key sent is not valid here"
    refused = HTTPException(401, detail=f"this route needs {what}: {problem}. Send the header "
                            "'Authorization: Bearer KEY'", headers={"WWW-Authenticate": "Bearer"})
    refused.code = None if token is None else INVALID_API_KEY  # as OpenAI answers: no code for a missing key
    raise refused


def request_key(request: Request) -> bytes | None:
    """The API key the request was made with (the route's dependency has checked it); None
    when the server runs without API keys."""
    if not request.app.state.keys.accepted(Access.GENERATION):
        return None
    return bearer_token(request) or b""


def key_digest(secret: bytes, key: bytes) -> str:
    """What the server records of an API key: an HMAC under the state folder's secret, never the
    key, the same after a restart (video jobs' rows and kept images' folders hold it)."""
    return hmac.new(secret, key, hashlib.sha256).hexdigest()[:32]


def key_owner(request: Request) -> str | None:
    """Whose what a request makes or names is (its video jobs, kept images, the URLs it names,
    its place on the progress board): its key's `key_digest`; None on a server without API
    keys, where every client is the same to the server."""
    key = request_key(request)
    return None if key is None else key_digest(request.app.state.owner_secret, key)


def sees_every_url_adapter(request: Request) -> bool:
    """Whether the request's key may list and use every adapter named by URL: an admin key, or
    any client of a server without API keys."""
    keys: Keys = request.app.state.keys
    token = bearer_token(request)
    return not keys.api or (token is not None and bool(keys.admin) and matches(token, keys.admin))


def may_use_url_id(request: Request, adapter_id: str) -> bool:
    """Whether the request's key may name the `url:` id `adapter_id` by its id (not its URL):
    one whose accepted request named the URL (the app's `url_book.UrlBook` remembers which)."""
    return sees_every_url_adapter(request) or request.app.state.urls.owned_by(adapter_id, key_owner(request))


def visible_adapter_rows(request: Request, rows: list[dict]) -> list[dict]:
    """The adapter rows (`id` each) a listing shows the request's key. Folder and hub adapters:
    to every key. A file elsewhere (`url:`, `civitai:`, `s3:`) is one key's business: an
    admin key (and any client of a server without API keys) sees them all; another key sees
    the `url:` ids whose URL it named, and no `civitai:` or `s3:` id (which key named those is
    not recorded: it names them again to use them)."""
    if sees_every_url_adapter(request):
        return rows
    return [row for row in rows if not is_remote(row["id"])
            or (row["id"].startswith("url:") and may_use_url_id(request, row["id"]))]


async def require_api_key(request: Request) -> None:
    """Route dependency of the generation routes."""
    _check(request, Access.GENERATION)


async def require_admin_key(request: Request) -> None:
    """Route dependency of the adapter admin routes."""
    _check(request, Access.ADMIN)


async def require_health_key(request: Request) -> None:
    """Route dependency of /health, /ready and /metrics (open unless `auth_health`)."""
    _check(request, Access.HEALTH)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def maybe_warn_open(config: ServerConfig, keys: Keys) -> None:
    """Warn when the server listens beyond loopback and anyone who reaches it may generate."""
    if not keys.api and not is_loopback(config.host):
        logger.warning("listening on %s without an API key: anyone who reaches the port can generate images%s. "
                       "Set --api-key (or --api-keys-file) and --admin-key", config.host,
                       "" if keys.admin else " and load, evict and list adapters")
