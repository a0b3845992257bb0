"""A backend with no engine, for tests of the HTTP edge alone (auth, limits, parsing): it
hosts one model, "fake", and records every call; and a real server over it on loopback."""

import asyncio
import threading
import time
from contextlib import contextmanager
from hashlib import sha256

import uvicorn
from PIL import Image

from loraswap.adapters.files.hashes import FileDigest
from loraswap.engine.calls import AdapterRan, Ran
from loraswap.engine.engine import GenerateResult
from loraswap.engine.request import GenerateRequest
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig
from loraswap.server.metrics import EngineFigures
from support.servers import free_port


def made_up_digest(adapter_id: str) -> FileDigest:
    """The digests a fake adapter's file reports (no file behind it): of its name."""
    return FileDigest(sha256(adapter_id.encode()).hexdigest(), sha256(b"tensors " + adapter_id.encode()).hexdigest())


def frame_red(i: int) -> int:
    """The red level of a fake video's frame i: far enough apart to survive H.264."""
    return (30 + 40 * i) % 256


class FakeBackend:
    load_error = None

    def __init__(self):
        self.generated: list[tuple[GenerateRequest, str | None]] = []
        self.kept: list[str] = []
        self.evicted: list[str] = []
        # videos: a request with `frames` gets that many frames (frame i: red level `frame_red(i)`),
        # reporting each of its steps to `on_step`; a test may hold it before a step
        self.video_fps = 8
        self.hold_before_step: int | None = None
        self.resume = threading.Event()
        self.client_gone_seen: list[bool] = []  # what `is_disconnected` said at each step

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def ready_info(self) -> dict:
        # it makes an image or a video, whichever is asked: declared a video model, as only the
        # videos route reads `output`
        return {"model": "fake", "models": ["fake"], "compiled": False,
                "capabilities": {"fake": {"image_input": "variants", "masks": True, "output": "video", "defaults": {},
                                          "size_multiple": 8, "sampler": "EulerDiscreteScheduler"}}}

    def is_model(self, name: str) -> bool:
        return name == "fake"

    async def generate(self, request: GenerateRequest, model, is_disconnected, on_step=None) -> GenerateResult:
        self.generated.append((request, model))
        for text in (request.prompt, request.negative_prompt or ""):
            text.encode("utf-8")  # as a tokenizer reads it: text that is not Unicode raises here
        if request.frames is None:
            ran = Ran("fake", "EulerDiscreteScheduler", request.steps or 2, request.guidance, request.strength,
                      tuple(AdapterRan(ref.adapter_id, ref.scale, None, made_up_digest(ref.adapter_id))
                            for ref in request.loras))
            return GenerateResult(Image.new("RGB", (8, 8), (200, 10, 10)), request.seed or 0, 0.0, 0.01, ran=ran)
        steps = request.steps or 2
        for step in range(steps):
            while step == self.hold_before_step and not self.resume.is_set():
                await asyncio.sleep(0.01)
            self.client_gone_seen.append(bool(is_disconnected and await is_disconnected()))
            if on_step is not None:
                on_step(step + 1, steps)
        size = (request.width or 16, request.height or 16)
        frames = [Image.new("RGB", size, (frame_red(i), 120, 60)) for i in range(request.frames)]
        return GenerateResult(frames[0], request.seed or 0, 0.0, 0.01, frames=frames, fps=self.video_fps)

    async def list_adapters(self) -> dict:
        return {"model": "fake", "models": ["fake"], "adapters": []}

    async def keep_adapter(self, ref) -> dict:
        self.kept.append(ref.adapter_id)
        return {"bytes": 10, "layers": 1, "model": "fake"}

    async def evict_adapter(self, ref) -> None:
        self.evicted.append(ref.adapter_id)

    async def figures(self) -> EngineFigures:
        return EngineFigures(ready=True)


def fake_app(**config):
    """(app, backend): the HTTP app over a FakeBackend, with these ServerConfig fields."""
    backend = FakeBackend()
    return create_app(ServerConfig(**config), backend=backend), backend


def start_on_thread(server: uvicorn.Server) -> threading.Thread:
    """`server` run on a thread of this process; returns once it has started (its thread)."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.02)
    return thread


@contextmanager
def serve_on_loopback(app):
    """The app served by uvicorn on a thread of this process, on 127.0.0.1: yields its URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = start_on_thread(server)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(10)


class SteppingEngine:
    """Stands in for `Engine` in the GPU worker: `steps` steps calling `on_step` after each (as
    the pipeline's step callback does), holding at step 2 until `gate` opens."""

    applied_ids = ()
    stoppable = True

    def __init__(self, lender, steps: int):
        self.lender, self.steps = lender, steps
        self.gate, self.started = threading.Event(), threading.Event()
        self.steps_run = 0

    def when_lost(self, answer) -> None:
        """Never lost: one process."""

    def generate_batch(self, requests, lease, on_step=None, on_latents=None):
        for step in range(1, self.steps + 1):
            self.steps_run = step
            if step == 2:
                self.started.set()
                self.gate.wait(30)
            on_step(step, self.steps)
        return [GenerateResult(Image.new("RGB", (8, 8)), 0, 0.0, 0.0) for _ in requests]
