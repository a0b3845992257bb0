"""The GPU worker: one thread per engine, and the scheduler in front of it.

The event loop never runs the pipeline: handlers `submit` a request and await its
future. The worker alone holds adapters for requests: `submit` takes a lease of the
request's adapters from the engine's lender (read on the store's threads while earlier
requests generate), and every way a job ends (served, failed, cancelled, refused) gives
it back (`_give_back`). A full queue refuses at once
(`Overloaded`, answered 503 + Retry-After). A request cancelled (its client went away, its
video job deleted) while queued is skipped, so it costs no GPU work; while it generates,
it stops at the next denoising step (`JobFuture.cancel`), unless another request in its
batch still wants the images or the engine cannot stop mid-image (`Engine.stoppable`).
Should the engine be lost for good (`Engine.when_lost`), every request held, queued or
generating, and each new one, is failed at once with its error (a 503), before the process
exits for a restart.
A server shutting down `drain`s its worker (each queued request answered 503 now, new ones
refused) and, once its drain time is up, `halt`s it (the running batch stops at its next step).

Scheduling, among queued requests whose adapters are ready:
1. a request waiting longer than `max_wait_s`, or passed over `max_skips` times, goes
   first (the fairness bound) as soon as its adapters are in;
2. otherwise a request for the adapters already fused goes first (no swap at all);
3. otherwise the oldest ready request.
The chosen request takes along up to `max_batch - 1` ready requests with the same
adapters and parameters, asking for the same kind of step pictures (none, sketches, or the
VAE's, which would slow the others' steps): one pipeline call for all of them.
"""

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from loraswap.engine.calls import Stopped
from loraswap.engine.config.scheduling import SchedulerConfig
from loraswap.engine.engine import Engine, GenerateResult
from loraswap.engine.request import GenerateRequest
from loraswap.engine.step_listener import pictures_asked, previews_hook, tell_places
from loraswap.errors import LoraswapError, Overloaded
from loraswap.tracing import RequestContext

logger = logging.getLogger(__name__)


class ShuttingDown(Overloaded):
    """503: the server is shutting down; the request was queued, or stopped at a step once the
    drain time was up."""


class JobFuture(Future):
    """A job's future: `cancel()` cancels it while queued, and asks a running job to stop."""

    def __init__(self):
        super().__init__()
        self.stop_asked = threading.Event()

    def cancel(self) -> bool:
        self.stop_asked.set()
        return super().cancel()


@dataclass
class Job:
    request: GenerateRequest
    lease: Future  # -> the Lease of the request's adapters, once they are read
    enqueued: float  # when it was queued (the worker's clock)
    future: JobFuture = field(default_factory=JobFuture)
    skips: int = 0
    on_step: Callable[[int, int], None] | None = None  # progress: (steps done, steps in all); a StepListener hears more
    read_at: float | None = None  # when its adapters were in (the worker's clock)
    # its request's id and span, entered on this thread while it is served (its log lines, its spans)
    context: RequestContext = field(default_factory=RequestContext.capture)

    @property
    def batch_key(self) -> tuple:
        r = self.request
        # requests with an image input run alone, and those with First-Block Cache, whose
        # decision to skip a step reads the whole batch's residuals
        alone = id(r) if r.image is not None or (r.step_cache or "").startswith("first-block") else None
        return (tuple(r.loras), r.steps, r.guidance, r.width, r.height, r.strength, r.frames, r.step_cache, alone,
                pictures_asked(self.on_step))


class GpuWorker:
    def __init__(self, engine: Engine, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.config = config
        self.clock = clock  # seconds, for the fairness bound and the timings (a test may drive it)
        self._jobs: list[Job] = []
        self._running: list[Job] = []  # the batch taken from the queue to generate
        self._cond = threading.Condition()
        self._stopping = False
        self._halting = False  # the running batch is to stop at its next step (`halt`)
        self._lost: LoraswapError | None = None  # the engine lost for good: every request fails with it
        engine.when_lost(self._fail_all)
        self._thread = threading.Thread(target=self._run, name="loraswap-gpu-worker", daemon=True)
        self.skipped_cancelled = 0  # jobs dropped because their client left while queued
        self.stopped = 0  # jobs stopped while they generated, every one of their batch cancelled
        # (`completed` counts every job that ran, however it ended: served, failed or stopped)
        self.completed = 0
        self.batches = 0

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerateRequest, on_step: Callable[[int, int], None] | None = None,
               located: dict | None = None) -> Future:
        """Queue a request and start reading its adapters; `on_step(done, total)` is called
        after each denoising step (a video job's progress; a `StepListener` also hears its place
        in the queue and gets the pictures of its steps it asks for). `located`: the adapters'
        files, by id, as routing found them (not located again)."""
        job = Job(request, self.engine.lender.lease(request.loras, located), self.clock(), on_step=on_step)
        with self._cond:
            if self._lost is not None:
                _give_back(job)
                raise type(self._lost)(self._lost.message)
            if self._stopping:
                _give_back(job)
                raise ShuttingDown("the server is shutting down; retry on another server, or once it is back")
            if len(self._jobs) >= self.config.max_queue:
                _give_back(job)
                raise Overloaded(f"the queue is full ({self.config.max_queue} requests waiting); retry shortly")
            self._jobs.append(job)
            self._tell_places()
            self._cond.notify_all()
        # bound methods, not closures over `job`: a future keeps its callbacks, and a cycle through
        # the job would keep its request's decoded images until the garbage collector ran
        job.lease.add_done_callback(self._adapters_read)
        job.future.add_done_callback(self._unqueue_if_cancelled)
        return job.future

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return len(self._jobs)

    @property
    def alive(self) -> bool:
        """Whether the worker's thread runs: started, and not yet ended by `stop`."""
        return self._thread.is_alive()

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new requests, finish the queued ones (none after `drain`), then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def drain(self) -> int:
        """Refuse new requests and answer each queued one now (`ShuttingDown`, a 503); the running
        batch goes on. How many were queued."""
        with self._cond:
            self._stopping = True
            queued, self._jobs = self._jobs, []
            self._cond.notify_all()
        for job in queued:
            _give_back(job)
            with contextlib.suppress(InvalidStateError):  # cancelled meanwhile: its client left
                job.future.set_exception(ShuttingDown("the server is shutting down and this request was still "
                                                      "queued; retry on another server, or once it is back"))
        return len(queued)

    def halt(self) -> int:
        """Stop the running batch at its next denoising step, answered `ShuttingDown` (unless the
        engine cannot stop mid-image: that batch finishes). How many it stops."""
        with self._cond:
            self._halting = True
            return len(self._running) if self.engine.stoppable else 0

    def _unqueue_if_cancelled(self, future: Future) -> None:
        """A job cancelled while queued (its client left) leaves the queue now, its adapters
        given back, rather than when the worker next looks (after the running batch)."""
        if not future.cancelled():
            return
        with self._cond:
            job = next((queued for queued in self._jobs if queued.future is future), None)
            if job is None:  # taken by the worker already, which skips it
                return
            self._jobs.remove(job)
            self.skipped_cancelled += 1
            self._tell_places()
        _give_back(job)

    def _tell_places(self) -> None:
        """The queue changed: each listening job waiting with its adapters read hears its place
        (under the lock). One whose adapters are still read, or failed, hears nothing yet."""
        tell_places([job.on_step if _read_fine(job.lease) else None for job in self._jobs])

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _adapters_read(self, lease: Future) -> None:
        with self._cond:
            for job in self._jobs:
                if job.lease is lease:
                    job.read_at = self.clock()
            self._tell_places()
            self._cond.notify_all()

    # ---------------------------------------------------------------- scheduling
    def _next_batch(self) -> list[Job] | None:
        with self._cond:
            while True:
                self._drop_cancelled()
                if not self._jobs and self._stopping:
                    return None
                batch = self._choose()
                if batch:
                    for job in batch:
                        self._jobs.remove(job)
                    self._tell_places()
                    self._running = batch
                    return batch
                self._cond.wait(timeout=0.05)

    def _drop_cancelled(self) -> None:
        cancelled = [j for j in self._jobs if j.future.cancelled()]
        for job in cancelled:
            self._jobs.remove(job)
            self.skipped_cancelled += 1
            _give_back(job)
        if cancelled:
            self._tell_places()

    def _choose(self) -> list[Job]:
        if not self._jobs:
            return []
        now = self.clock()
        oldest = self._jobs[0]
        ready = [j for j in self._jobs if j.lease.done()]
        if not ready:
            return []
        if now - oldest.enqueued >= self.config.max_wait_s or oldest.skips >= self.config.max_skips:
            # fairness: the overdue request goes first once its adapters are in; until then the
            # oldest ready request runs (no affinity), which also frees cache space it may wait for
            chosen = oldest if oldest.lease.done() else ready[0]
        else:
            applied = tuple(self.engine.applied_ids)
            chosen = next((j for j in ready if tuple((r.adapter_id, r.scale) for r in j.request.loras) == applied),
                          ready[0])
        for job in self._jobs:
            if job is chosen:
                break
            job.skips += 1
        batch = [chosen]
        for job in self._jobs:
            if len(batch) >= self.config.max_batch:
                break
            if job is not chosen and job.lease.done() and job.batch_key == chosen.batch_key:
                batch.append(job)
        return batch

    # ---------------------------------------------------------------- running
    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            running = [job for job in batch if _set_running(job.future)]
            self.skipped_cancelled += len(batch) - len(running)
            for job in batch:
                if job not in running:
                    _give_back(job)
            if running:
                with RequestContext.joined([job.context for job in running]).entered():
                    self._serve(running)

    def _serve(self, jobs: list[Job]) -> None:
        started = self.clock()
        leases, ready, answers = [], [], []  # answers: (job, result, error), sent once the leases are back
        for job in jobs:  # a request whose adapter failed to load fails alone; nothing was swapped
            try:
                leases.append(job.lease.result())
                ready.append(job)
            except BaseException as e:
                _answer([(job, None, e)])  # at once: a lease that failed holds nothing to give back
        try:
            if ready:
                pictures = previews_hook([job.on_step for job in ready])  # None: no job asks for previews
                results = self.engine.generate_batch([job.request for job in ready], leases[0],
                                                     on_step=self._step_hook(ready), on_latents=pictures)
                for job, result in zip(ready, results):
                    result.timings |= {"read": (job.read_at or started) - job.enqueued, "wait": started - job.enqueued}
                    answers.append((job, result, None))
        except BaseException as e:  # delivered to the waiting handlers
            if isinstance(e, Stopped):  # no traceback: its frames would keep the call's tensors alive
                e = ShuttingDown(f"the server is shutting down: this image was {e}; retry") if self._halting \
                    else Stopped(str(e))
            answers += [(job, None, e) for job in ready]
        finally:
            try:
                for job in jobs:
                    _give_back(job)
                self.completed += len(jobs)
                self.batches += 1
                self._running = []
            finally:
                _answer(answers)  # after the leases are given back: an answered request holds no adapter

    def _fail_all(self, error: LoraswapError) -> None:
        """The engine can make no more images (`Engine.when_lost`; the process exits for a
        restart): every request queued or generating gets `error` now, from this thread, as
        the worker's may be stuck; each new one gets it at `submit`."""
        with self._cond:
            self._lost = error
            queued, self._jobs = self._jobs, []
            held = queued + self._running
        for job in queued:
            _give_back(job)
        for job in held:
            with contextlib.suppress(InvalidStateError):  # done meanwhile (cancelled, or served)
                job.future.set_exception(type(error)(error.message))  # one each: each handler raises its own

    def _step_hook(self, jobs: list[Job]) -> Callable[[int, int], None]:
        """Called after each denoising step: the jobs' progress hooks, then `Stopped` once every
        job of the batch was cancelled (never where the engine cannot stop mid-image)."""
        hooks = [job.on_step for job in jobs if job.on_step]
        stoppable = self.engine.stoppable

        def step_ended(done: int, total: int) -> None:
            _report_progress(hooks, done, total)
            if stoppable and self._halting:
                raise Stopped(f"stopped at step {done} of {total}")
            if stoppable and all(job.future.stop_asked.is_set() for job in jobs):
                self.stopped += len(jobs)
                raise Stopped(f"cancelled at step {done} of {total}")

        return step_ended


def _set_running(future: JobFuture) -> bool:
    """Mark the job running; False if it is not to run: cancelled while queued, or already
    failed (`GpuWorker._fail_all`, between its leaving the queue and now)."""
    try:
        return future.set_running_or_notify_cancel()
    except RuntimeError:  # failed already: its client has its answer
        return False


def _read_fine(lease: Future) -> bool:
    """Whether a job's adapters are read and held (its lease came, no error)."""
    return lease.done() and not lease.cancelled() and lease.exception() is None


def _answer(answers: list[tuple[Job, GenerateResult | None, BaseException | None]]) -> None:
    """Each job's result or error, to its waiting handler (unless `_fail_all` answered it meanwhile,
    from another thread)."""
    for job, result, error in answers:
        with contextlib.suppress(InvalidStateError):
            if error is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(error)


def _give_back(job: Job) -> None:
    """Give back the job's lease, now or once its adapters are read (a lease is given back once)."""
    def release(future: Future) -> None:
        if not future.cancelled() and future.exception() is None:
            future.result().release()
    job.lease.add_done_callback(release)


def _report_progress(hooks: list[Callable[[int, int], None]], done: int, total: int) -> None:
    """Each job's progress hook; one that fails is logged, never the batch's failure."""
    for hook in hooks:
        try:
            hook(done, total)
        except Exception:
            logger.exception("a progress hook failed at step %d of %d", done, total)
