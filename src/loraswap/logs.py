"""Log lines an operator can search: plain text or one JSON object a line, every line a
request causes marked with its request id, and the libraries' start-up noise kept out.

- `configure_logging(level, fmt)`: one handler on the root logger, `TextFormatter` or
  `JsonFormatter`; `server/access_log.py:log_config` puts uvicorn's lines (the access log
  included) through the same formatters.
- The request id lives in a context variable (`request_id`), set by the HTTP edge
  (`server/request_ids.py`) and carried into the threads that work for the request
  (`tracing.RequestContext`); the formatters read it when a line is written, on whichever
  thread writes it.
- `hide_library_noise()`, called by the CLI before it imports torch, diffusers or
  transformers: their known start-up warnings (optional kernels that cannot load, a
  deprecation inside torchao, torchvision missing) are held back until the level is known,
  then shown at `debug` and dropped at any other level.
"""

import contextvars
import json
import logging
import sys
from datetime import datetime, timezone

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("loraswap_request_id", default=None)

# a record's own attributes, and what formatters add to it (uvicorn's coloured copy of the
# message, `TextFormatter`'s); any other was given as `extra=` and is a field of its JSON line
_NOT_FIELDS = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message", "asctime", "taskName", "color_message", "request", "logger"}

# uvicorn writes its general lines ("Started server process") as `uvicorn.error`: shown as
# `uvicorn`, so that a search for errors finds errors
SHOWN_NAMES = {"uvicorn.error": "uvicorn"}


class TextFormatter(logging.Formatter):
    """`time LEVEL logger [request id]: message`; the id only on a request's lines."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(logger)s%(request)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        rid = request_id.get()
        record.request = f" [{rid}]" if rid else ""
        record.logger = SHOWN_NAMES.get(record.name, record.name)
        return super().format(record)


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, thread,
    request_id when the line is a request's, the fields given as `extra=`, and a traceback
    as `exception`."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
                "level": record.levelname, "logger": SHOWN_NAMES.get(record.name, record.name),
                "message": record.getMessage(), "thread": record.threadName}
        rid = request_id.get()
        if rid:
            line["request_id"] = rid
        line |= self.fields(record)
        line |= {k: v for k, v in record.__dict__.items() if k not in _NOT_FIELDS and k not in line}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str, ensure_ascii=False)

    def fields(self, record: logging.LogRecord) -> dict:
        """Fields of this kind of record (none here; the access log's in `JsonAccessFormatter`)."""
        return {}


class JsonAccessFormatter(JsonFormatter):
    """uvicorn's access line, its parts as fields too: client, method, path (query hidden by
    `access_log.HideQuery`), http_version, status."""

    NAMES = ("client", "method", "path", "http_version", "status")

    def fields(self, record: logging.LogRecord) -> dict:
        args = record.args
        if isinstance(args, tuple) and len(args) == len(self.NAMES):
            return dict(zip(self.NAMES, args))
        return {}


def formatter(fmt: str, access: bool = False) -> logging.Formatter:
    """The formatter of `fmt` ("text" or "json"); `access`: for uvicorn's access log."""
    if fmt == "json":
        return JsonAccessFormatter() if access else JsonFormatter()
    return TextFormatter()


class StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a line is written (a test's capture, then the
    terminal again), as logging's own last-resort handler does."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """Every log line to stderr at `level` and above, as `fmt` says; the libraries' start-up
    noise held back so far shown (at debug) or dropped. Called again, it replaces its own
    handler; others' (a test's capture) stay."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, StderrHandler)]:
        root.removeHandler(old)
    handler = StderrHandler()
    handler.setFormatter(formatter(fmt))
    root.addHandler(handler)
    root.setLevel(level.upper())
    _NOISE.settle(level == "debug")


# (logger, text of the message): warnings the libraries write as they are imported or a model
# loads, about optional parts this server does not use; nothing a user can or need act on
LIBRARY_NOISE = (
    ("torchao", "Failed to load"),  # its optional kernels, built for another Python or GPU
    ("torch.utils._pytree", "register_constant()"),  # torchao registering its enums the old way
    ("diffusers.quantizers.torchao.torchao_quantizer", "Unable to import `torchao` Tensor objects"),
    ("transformers.utils.import_utils", "requires torchvision (not installed)"),
)
HELD_AT_MOST = 100  # records held before the level is known; more are dropped


class LibraryNoise(logging.Filter):
    """On each noisy logger: its known noise held back until `settle`, then shown (debug) or dropped."""

    def __init__(self):
        super().__init__()
        self.show: bool | None = None  # None: the level is not known yet
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if not any(record.name == name and text in record.getMessage() for name, text in LIBRARY_NOISE):
            return True
        if self.show is None:
            if len(self.held) < HELD_AT_MOST:
                self.held.append(record)
            return False
        return self.show

    def settle(self, show: bool) -> None:
        self.show = show
        held, self.held = self.held, []
        if show:
            for record in held:
                logging.getLogger(record.name).handle(record)


_NOISE = LibraryNoise()


def hide_library_noise() -> None:
    """Hold back the libraries' start-up noise (`LIBRARY_NOISE`) until `configure_logging`."""
    for name in dict(LIBRARY_NOISE):
        logger = logging.getLogger(name)
        if _NOISE not in logger.filters:
            logger.addFilter(_NOISE)
