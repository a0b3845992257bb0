"""Serving over HTTP until SIGTERM (or Ctrl-C), then a drained stop: `serve_http`.

uvicorn alone, on SIGTERM, waits for every open request to finish (past its graceful
timeout it cancels them: a traceback each, a plain-text 500) and only then runs the app's
shutdown. `DrainingServer` drains the app first: at the signal, requests queued for a GPU
worker are answered 503 (JSON, with Retry-After) and new ones refused (`LocalBackend.drain`);
the running ones have `--drain-s` to finish, then stop at their next denoising step, also
answered 503 (`LocalBackend.halt`). So the server stops within the drain time plus one
step. What uvicorn still cancels after `ANSWER_GRACE_S` more (a stuck upload) is answered
503 by `app.ContainUnexpected`, never a traceback.
"""

import asyncio
import logging
import socket
import sys

import uvicorn
from fastapi import FastAPI

from loraswap.server.config import ServerConfig

logger = logging.getLogger("loraswap.server")

# after the drain time, how long uvicorn waits more for the last answers (a running image
# stops at its next step; a step of a long video may take tens of seconds) before cancelling
ANSWER_GRACE_S = 30.0
STARTUP_FAILURE = 3  # uvicorn.run's exit code when the server could not start (a port in use)


def start_draining(app: FastAPI, drain_s: float) -> asyncio.TimerHandle:
    """Refuse new requests and answer the queued ones now; the running ones halted in `drain_s`
    (the handle: cancel it if everything ended before)."""
    app.state.shutting_down = True
    backend = app.state.backend
    logger.info("shutting down: queued requests answered 503, running ones have %g s to finish", drain_s)
    backend.drain()
    return asyncio.get_running_loop().call_later(drain_s, backend.halt)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown drains the app (`start_draining`) before it waits for
    the connections to close and runs the app's own shutdown (its lifespan)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_s: float):
        super().__init__(config)
        self.loraswap_app = app
        self.drain_s = drain_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        halting = start_draining(self.loraswap_app, self.drain_s)
        try:
            await super().shutdown(sockets)
        finally:
            halting.cancel()


def draining_server(app: FastAPI, config: ServerConfig, **uvicorn_options) -> DrainingServer:
    """The server of `app` (over a `LocalBackend`) on `config`'s host and port and drain time;
    `uvicorn_options`: the rest of `uvicorn.Config` (logging)."""
    options = {"host": config.host, "port": config.port, **uvicorn_options}
    return DrainingServer(uvicorn.Config(app, timeout_graceful_shutdown=config.drain_s + ANSWER_GRACE_S, **options),
                          app, config.drain_s)


def serve_http(app: FastAPI, config: ServerConfig, sockets: list[socket.socket] | None = None,
               **uvicorn_options) -> None:
    """Serve `app` (`draining_server`), on `sockets` if already bound, until SIGTERM or Ctrl-C,
    then stop drained. Exits 3, as `uvicorn.run`, when the server could not start."""
    server = draining_server(app, config, **uvicorn_options)
    try:
        server.run(sockets=sockets)  # a SIGTERM ends it with the signal raised again, once stopped
    except KeyboardInterrupt:  # a second Ctrl-C while stopping
        pass
    if not server.started:
        sys.exit(STARTUP_FAILURE)
