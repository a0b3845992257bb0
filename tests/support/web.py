"""A scripted HTTP/1.1 server on 127.0.0.1 in a thread, with a log of what it was asked and sent.

Routes map a path (query string ignored) to a function of the request handler; the helpers
below answer with a body, a redirect or a stream. `log` holds every request (path with its
query, Host, headers); `streams` says, per path, how many body bytes went out and whether the
client hung up before the end.
"""

import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Route = Callable[[BaseHTTPRequestHandler], None]
CHUNK = 2**16


class Web:
    def __init__(self, routes: dict[str, Route], tls: ssl.SSLContext | None = None):
        """Plain HTTP, or HTTPS with `tls` (a server context; `sni` then logs the names clients sent)."""
        self.routes = routes
        self.scheme = "https" if tls else "http"
        self.sni: list[str | None] = []
        self.log: list[dict] = []
        self.streams: dict[str, dict] = {}
        self.stop = threading.Event()  # slow routes wait on it, so closing never waits for them
        web = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):  # noqa: N802 (http.server's name)
                path = self.path.split("?")[0]
                web.log.append({"path": self.path, "host": self.headers.get("Host"), "headers": dict(self.headers)})
                route = web.routes.get(path)
                if route is None:
                    send(self, 404, b"no such route")
                    return
                try:
                    route(self)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True

            def handle(self):
                try:
                    super().handle()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # a client that hung up (on purpose, in these tests) while the next request was awaited

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        if tls:
            tls.sni_callback = lambda sock, name, context: self.sni.append(name)
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self._thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"

    def paths(self) -> list[str]:
        return [entry["path"] for entry in self.log]

    def wait_stream(self, path: str, timeout: float = 5.0) -> dict:
        """The stream record of `path` once its handler has finished (hung up or not)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            record = self.streams.get(path)
            if record and record["done"]:
                return record
            time.sleep(0.01)
        raise TimeoutError(f"{path}: the stream did not finish in {timeout} s")

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


def send(handler: BaseHTTPRequestHandler, status: int, body: bytes = b"", headers: dict | None = None) -> None:
    handler.send_response(status)
    for key, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
        handler.send_header(key, value)
    handler.end_headers()
    handler.wfile.write(body)


def body(data: bytes, headers: dict | None = None) -> Route:
    return lambda handler: send(handler, 200, data, headers)


def status(code: int) -> Route:
    return lambda handler: send(handler, code, b"nope")


def redirect(location: str, code: int = 302) -> Route:
    return lambda handler: send(handler, code, headers={"Location": location})


def stream(web: Web, path: str, head: bytes, total: int, content_length: int | None = None) -> Route:
    """`head`, then zeros up to `total` bytes: chunked when `content_length` is None, else under
    that (possibly false) Content-Length. Records in `web.streams[path]` what went out."""
    def route(handler: BaseHTTPRequestHandler) -> None:
        record = web.streams[path] = {"sent": 0, "hung_up": False, "done": False}
        handler.send_response(200)
        chunked = content_length is None
        handler.send_header(*(("Transfer-Encoding", "chunked") if chunked else ("Content-Length", str(content_length))))
        handler.end_headers()
        try:
            for piece in _pieces(head, total):
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                record["sent"] += len(piece)
            if chunked:
                handler.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            record["hung_up"] = True
            handler.close_connection = True
        finally:
            record["done"] = True
    return route


def _pieces(head: bytes, total: int):
    yield head
    zeros = bytes(CHUNK)
    for start in range(len(head), total, CHUNK):
        yield zeros[:min(CHUNK, total - start)]


def slow(web: Web, seconds: float) -> Route:
    """Headers at once, then nothing for `seconds` (or until the server closes)."""
    def route(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", "10")
        handler.end_headers()
        handler.wfile.flush()
        web.stop.wait(seconds)
        handler.wfile.write(b"0123456789")
    return route


def drip(web: Web, head: bytes, total: int, every: float, headers_too: bool = False,
         stop: threading.Event | None = None) -> Route:
    """A whole answer (`head`, then zeros up to `total` bytes) one byte every `every` seconds:
    steady enough for any per-read timeout, never done (until `stop`, or the server's, is set:
    then it hangs up). The status line and headers drip too when `headers_too`, else they go
    at once."""
    stop = stop or web.stop

    def route(handler: BaseHTTPRequestHandler) -> None:
        header = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total
        handler.close_connection = True
        if not headers_too:
            handler.wfile.write(header)
        answer = (header if headers_too else b"") + head + bytes(total - len(head))
        try:
            for i in range(len(answer)):
                handler.wfile.write(answer[i:i + 1])
                handler.wfile.flush()
                if stop.wait(every) or web.stop.is_set():
                    return
        except (BrokenPipeError, ConnectionResetError):
            pass
    return route
