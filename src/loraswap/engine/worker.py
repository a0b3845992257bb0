"""The GPU worker: one thread per engine, fed by a bounded queue.

The event loop never runs the pipeline: handlers `submit` a request and await its
future. A full queue refuses at once (`Overloaded`, answered 503 + Retry-After). A
request whose client went away is cancelled while queued, and the worker skips it
(`Future.set_running_or_notify_cancel`), so it costs no GPU work.
"""

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..errors import Overloaded
from .config import GenerateRequest
from .engine import Engine, GenerateResult

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    request: GenerateRequest
    future: Future = field(default_factory=Future)


_STOP = object()


class GpuWorker:
    def __init__(self, engine: Engine, max_queue: int):
        self.engine = engine
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="loraswap-gpu-worker", daemon=True)
        self.skipped_cancelled = 0  # jobs dropped because their client left while queued
        self.completed = 0

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerateRequest) -> Future:
        job = _Job(request)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise Overloaded(f"the queue is full ({self._queue.maxsize} requests waiting); retry shortly") from None
        return job.future

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def stop(self, timeout: float | None = None) -> None:
        """Finish what is queued, then end the thread."""
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            if not job.future.set_running_or_notify_cancel():
                self.skipped_cancelled += 1
                continue
            try:
                result: GenerateResult = self.engine.generate(job.request)
            except BaseException as e:  # delivered to the waiting handler
                job.future.set_exception(e)
            else:
                job.future.set_result(result)
            self.completed += 1
