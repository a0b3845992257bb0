"""uvicorn's access log with every query string hidden: a key sent as `?api_key=...` (or a
signed URL's signature) never reaches a log line, whether or not the request is refused.
The routes read nothing from a query but `/v1/videos/{id}/content`'s `variant`, so little
is lost."""

import copy
import logging

HIDDEN = "?(query hidden)"


class HideQuery(logging.Filter):
    """Rewrites uvicorn's access record (client, method, path with query, version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) > 2 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].partition("?")[0] + HIDDEN, *args[3:])
        return True


def log_config() -> dict:
    """uvicorn's default logging config, its access handler filtered by `HideQuery`."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["hide_query"] = {"()": HideQuery}
    config["handlers"]["access"]["filters"] = ["hide_query"]
    return config
