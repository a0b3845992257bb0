"""Real servers for tests: a loraswap process on 127.0.0.1, a free port, Ray's environment."""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from loraswap.bench.serve import RAY_ENV
from loraswap.engine.parallel.processes import free_port  # noqa: F401  (the tests' too)


def form(**fields) -> dict:
    """A multipart form as the openai client sends it: every field as text (httpx's `files=`)."""
    return {name: (None, str(value)) for name, value in fields.items()}


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, env: dict | None = None, command: str = "serve",
                 port: int | None = None):
        """`loraswap serve --port PORT ARGS`, or `loraswap COMMAND ARGS` listening on `port`; a
        state folder of its own beside its log unless ARGS or `env` name one."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("w")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if "--state-dir" not in args and "LORASWAP_STATE_DIR" not in full_env:  # never the user's, nor shared
            full_env["LORASWAP_STATE_DIR"] = tempfile.mkdtemp(prefix=log_path.stem + "-state-", dir=log_path.parent)
        argv = ["serve", "--port", str(self.port), *args] if command == "serve" else [command, *args]
        self.proc = subprocess.Popen([sys.executable, "-m", "loraswap", *argv],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=full_env)

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def metric(self, name: str, labels: str = "") -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + labels + " ") or (not labels and line.startswith(name + " ")):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # never leave a server behind to slow the tests after this one
            self.proc.wait(30)
            raise
        finally:
            self._log.close()


def ray_env() -> dict:
    """Environment of a process that starts its own local Ray cluster (never joins another)."""
    return dict(RAY_ENV)


def wait_ready(client, timeout: float = 120.0) -> None:
    """Until an in-process app (a started `TestClient`) answers /ready with 200: its models loaded."""
    deadline = time.monotonic() + timeout
    while client.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, f"not ready in {timeout} s"
        time.sleep(0.05)
