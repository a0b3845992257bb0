"""What of a request's path a log line may show: no query string, and nothing after a `?`
that a path carries %-encoded (`/adapters/http%3A%2F%2Fh%2Fa.safetensors%3FX-Amz-Signature%3D.../load`
names a signed URL in the path itself), nor the user and password of a URL in it. A key sent
as `?api_key=...`, or a signed URL's signature, never reaches a log line, whether or not the
request is refused. The routes read nothing from a query but `/v1/videos/{id}/content`'s
`variant`, so little is lost.

uvicorn's access log goes through `HideQuery`; the app's own lines about a request
(`app.ContainUnexpected`) and its span (`request_ids.py`) through `loggable_path`."""

import copy
import logging
import re
from urllib.parse import quote, unquote

from loraswap.logs import formatter

HIDDEN = "?(query hidden)"
MAX_DECODES = 4  # %-encoding of %-encoding of ...: a path is decoded until it stops changing, at most this often
USERINFO = re.compile(r"(?i)(https?:/+)[^/@]*@")


def loggable_path(path: str) -> str:
    """`path` (raw or decoded, with or without its query) as a log line may show it: decoded,
    cut at its first `?`, a URL's user and password dropped, and %-encoded again where a log
    line would be misread (spaces, control characters)."""
    text = path
    for _ in range(MAX_DECODES):
        decoded = unquote(text)
        if decoded == text:
            break
        text = decoded
    text, query, _ = text.partition("?")
    if "%" in text:  # still encoded after MAX_DECODES: nothing after its first escape is shown
        text, query = text.partition("%")[0], "?"
    text = USERINFO.sub(r"\1", text)
    return quote(text, safe="/:@!$&'()*+,;=-._~") + (HIDDEN if query else "")


class HideQuery(logging.Filter):
    """Rewrites uvicorn's access record (client, method, path with query, version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) > 2 and isinstance(args[2], str):
            record.args = (*args[:2], loggable_path(args[2]), *args[3:])
        return True


def log_config(fmt: str = "text") -> dict:
    """uvicorn's default logging config, its lines in the server's format (`logs.formatter`:
    "text" or "json"; its access lines with its parts as fields) and at the server's level,
    its access handler filtered by `HideQuery`."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["formatters"] = {"default": {"()": formatter, "fmt": fmt},
                            "access": {"()": formatter, "fmt": fmt, "access": True}}
    for logger in config["loggers"].values():
        logger.pop("level", None)  # the server's level (`logs.configure_logging`), not INFO always
    config.setdefault("filters", {})["hide_query"] = {"()": HideQuery}
    config["handlers"]["access"]["filters"] = ["hide_query"]
    return config
