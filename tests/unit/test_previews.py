"""Pictures of an image's steps: each family's latents become what its VAE decodes, op for op
(the full picture of the last step is the image, bitwise); the linear sketch is fitted to the
demo's VAE well enough to be the picture; the step's estimate of the final latents; which steps
get pictures; an image made with previews is bitwise the one made without, and nothing is
computed for a request that asks for none; batches; the worker's queue places."""

import math
import threading
from concurrent.futures import Future

import pytest
import torch
import torch.nn.functional as F

from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.config.scheduling import SchedulerConfig
from loraswap.engine.engine import Engine
from loraswap.engine.previews import LatentPreviews, StepLatents, decode, sigmas_of, token_grid, vae_latents
from loraswap.engine.request import GenerateRequest
from loraswap.engine.step_listener import StepListener, every_steps, previews_hook, spread_steps
from loraswap.engine.worker import GpuWorker
from loraswap.models import load_pipeline

DEMO_PROMPTS = ["a red circle at the left on white", "a blue square at the right on black",
                "a green triangle at the center on gray"]


def _run(pipeline, prompts, size, steps=3):
    """(the output images as 8-bit (batch, 3, h, w), the latents after each step)."""
    steps_latents = []

    def keep(pipe, step, timestep, tensors):
        steps_latents.append(tensors["latents"].clone())
        return tensors

    width, height = size
    output = pipeline(prompt=prompts, generator=[torch.Generator("cpu").manual_seed(i) for i in range(len(prompts))],
                      num_inference_steps=steps, width=width, height=height, output_type="pt",
                      callback_on_step_end=keep)
    return (output.images.float() * 255).round().to(torch.uint8), steps_latents


@pytest.mark.parametrize("model", ["demo", "tiny-sdxl", "tiny-flux", "tiny-flux2", "tiny-qwen-image", "tiny-sd3",
                                   "tiny-z-image"])
def test_the_vae_decodes_the_last_steps_latents_into_the_image_bitwise(model):
    # spatial, FLUX.1's and Qwen-Image's packed patches, FLUX.2's batch-normed patch tokens, a
    # non-square size (which way the tokens unpack)
    pipeline = load_pipeline(model)
    size = (32, 32) if model == "demo" else (64, 48)
    images, steps_latents = _run(pipeline, ["a red circle", "a blue square"], size)
    with torch.inference_mode():
        pictures = (decode(pipeline.vae, vae_latents(pipeline, steps_latents[-1], size)).float() * 255).round()
    assert torch.equal(pictures.to(torch.uint8), images), "the pipeline's own decode, op for op"


def test_the_demo_sketch_shows_the_image_and_the_steps_estimate_sharpens_it():
    pipeline = load_pipeline("demo")
    previews = LatentPreviews(pipeline)
    images, steps_latents = _run(pipeline, DEMO_PROMPTS, (32, 32), steps=20)
    target = F.avg_pool2d(images.float() / 255, 2)  # a latent spans 2x2 pixels on the demo

    def error(step: StepLatents) -> float:
        sketch = torch.stack([p.pixels for p in step.pictures([0, 1, 2], full=False)]).float() / 255
        return (sketch - target).pow(2).mean().sqrt().item()

    final = error(StepLatents(previews, steps_latents[-1], (32, 32)))
    grey = (target - 0.5).pow(2).mean().sqrt().item()
    assert final < 0.3 < grey, (final, grey)  # measured 0.21; a linear map of this small VAE is no better than ~0.19
    # halfway, the noisy latents hide the picture; the estimate of the final latents shows it
    scheduler = pipeline.scheduler
    scheduler._step_index = 10
    middle = StepLatents(previews, steps_latents[9], (32, 32), steps_latents[8], sigmas_of(scheduler))
    noisy = StepLatents(previews, steps_latents[9], (32, 32))
    assert error(middle) < 0.35 < error(noisy), (error(middle), error(noisy))


def test_the_estimate_at_the_last_step_is_the_final_latents():
    previews = LatentPreviews(load_pipeline("demo"))
    before, after = torch.randn(1, 4, 16, 16) * 3, torch.randn(1, 4, 16, 16)
    seen = []
    previews.pictures = lambda latents, full, size: seen.append(latents) or []
    StepLatents(previews, after, (32, 32), before, (1.7, 0.0)).pictures([0], full=False)
    torch.testing.assert_close(seen[0], after, rtol=0, atol=1e-5)  # float rounding of 3x


def test_a_fit_that_fails_leaves_no_sketches_and_is_tried_once(caplog):
    previews = LatentPreviews(load_pipeline("demo"))
    calls = []
    previews.pipeline.vae.encode = lambda *a, **k: calls.append(1) or 1 / 0
    for _ in range(2):
        assert previews.pictures(torch.zeros(1, 4, 16, 16), full=False, size=(32, 32)) == []
    assert len(calls) == 1 and "could not be fitted" in caplog.text
    assert len(previews.pictures(torch.zeros(1, 4, 16, 16), full=True, size=(32, 32))) == 1, "full pictures still"


@pytest.mark.parametrize(("tokens", "size", "expected"), [
    (16 * 12, (256, 192), (12, 16)), (64, (None, None), (8, 8)), (12 * 16, (200, 300), (16, 12)),
    (7, (64, 64), (1, 7))])
def test_a_token_sequence_unpacks_to_the_images_shape(tokens, size, expected):
    assert token_grid(tokens, size, 16) == expected


def test_which_steps_get_pictures():
    assert [d for d in range(1, 21) if every_steps(5, d, 20)] == [5, 10, 15], "none after the last step"
    assert [d for d in range(1, 21) if spread_steps(2, d, 20)] == [6, 13]
    assert [d for d in range(1, 21) if spread_steps(3, d, 20)] == [5, 10, 15]
    assert [d for d in range(1, 3) if spread_steps(3, d, 2)] == [1], "fewer when the steps are too few"
    assert not any(spread_steps(0, d, 20) for d in range(1, 21))


# ---------------------------------------------------------------- through the engine
class Pictures(StepListener):
    asks_previews = True

    def __init__(self, every: int, full: bool = False):
        self.every, self.preview_full = every, full
        self.steps, self.pictures = [], []

    def __call__(self, done, total):
        self.steps.append(done)

    def wants_preview(self, done, total):
        return every_steps(self.every, done, total)

    def preview(self, done, total, picture):
        self.pictures.append((done, picture.image()))


def _values(image) -> torch.Tensor:
    return torch.tensor(list(image.getdata())).float()


@pytest.fixture(scope="module")
def demo():
    return Engine(EngineConfig(model="demo", device="cpu", compile=False, warmup=False))


def _generate(engine, requests, listeners=()):
    with engine.lender.lease_now([]) as lease:
        hook = previews_hook(list(listeners))
        steps = [listener for listener in listeners if listener is not None]
        return engine.generate_batch(requests, lease, on_step=lambda d, t: [s(d, t) for s in steps],
                                     **({"on_latents": hook} if hook else {}))


def test_an_image_with_previews_is_bitwise_the_image_without(demo):
    request = GenerateRequest(prompt=DEMO_PROMPTS[0], seed=7)
    plain = _generate(demo, [request])[0].image
    sketched, full = Pictures(every=1), Pictures(every=4, full=True)
    for listener in (sketched, full):
        image = _generate(demo, [request], [listener])[0].image
        assert image.tobytes() == plain.tobytes()
    assert [d for d, _ in sketched.pictures] == list(range(1, 20)) and [d for d, _ in full.pictures] == [4, 8, 12, 16]
    assert {p.size for _, p in sketched.pictures + full.pictures} == {(32, 32)}, "at the image's size"
    # the full picture of step 16 of 20 is nearly the image
    assert (_values(full.pictures[-1][1]) - _values(plain)).abs().mean() < 8


def test_nothing_is_computed_for_a_request_that_asks_for_no_pictures(demo, monkeypatch):
    """Through the server's own wrapper (the progress board's `Tracked`), and in a batch of
    plain requests: no picture, no step asked about, no map fitted."""
    import loraswap.engine.previews as previews_module
    from loraswap.server.streaming.progress_board import Tracked

    fresh, fitted, fit = LatentPreviews(demo.pipeline), [], previews_module.fit_linear_map
    monkeypatch.setattr(demo, "previews", fresh)
    monkeypatch.setattr(fresh, "pictures", lambda *a, **k: pytest.fail("a picture was made"))
    monkeypatch.setattr(previews_module, "fit_linear_map", lambda *a: fitted.append(a) or fit(*a))
    assert previews_hook([None, lambda d, t: None, StepListener(), Tracked("/", None)]) is None
    listener = StepListener()
    listener.wants_preview = lambda d, t: pytest.fail("asked at a step")
    hooks = [Tracked("/", listener), Tracked("/", None), Tracked("/", lambda d, t: None)]
    worker = GpuWorker(demo, SchedulerConfig(max_batch=3))
    worker.start()
    held = Held()
    try:
        running = worker.submit(GenerateRequest(prompt="x", seed=9, steps=2), held)
        assert held.started.wait(30)  # the three below wait together, then run as one batch
        futures = [worker.submit(GenerateRequest(prompt=DEMO_PROMPTS[i], seed=i, steps=4), hook)
                   for i, hook in enumerate(hooks)]
        held.gate.set()
        for future in [running, *futures]:
            future.result(60)
    finally:
        worker.stop(10)
    assert worker.batches == 2 and all(hook.step == 4 for hook in hooks)
    assert fitted == [], "the sketch's map is fitted only when a sketch is asked for"


def test_requests_asking_for_full_pictures_are_batched_apart():
    """A full picture is a VAE decode of the whole batch's step: it would slow the plain requests."""
    from loraswap.engine.worker import Job
    from loraswap.server.streaming.progress_board import Tracked

    request = GenerateRequest(prompt="x", seed=1, steps=4)
    keys = [Job(request, Future(), 0.0, on_step=hook).batch_key for hook in
            (None, lambda d, t: None, Tracked("/", None), Pictures(every=2), Pictures(every=3),
             Tracked("/", Pictures(every=2, full=True)))]
    assert keys[0] == keys[1] == keys[2], "no pictures: one kind"
    assert keys[3] == keys[4], "sketches together, whatever their interval"
    assert len({keys[0], keys[3], keys[5]}) == 3


def test_the_estimate_is_made_only_after_an_euler_step(demo):
    """Another scheduler's step is not the one the estimate inverts: its pictures show the latents."""
    previews = LatentPreviews(demo.pipeline)
    seen = []
    previews.pictures = lambda latents, full, size: seen.append(latents) or []

    class DPMSolverMultistepScheduler:  # a scheduler with sigmas, stepped, not Euler
        sigmas, step_index = torch.tensor([2.0, 1.0, 0.0]), 1

    class EulerDiscreteScheduler(DPMSolverMultistepScheduler):
        pass

    before, after = torch.randn(1, 4, 16, 16), torch.randn(1, 4, 16, 16)
    for scheduler in (DPMSolverMultistepScheduler(), EulerDiscreteScheduler()):
        hook = previews.hook(lambda done, total, step: step.pictures([0], full=False), {"width": 32, "height": 32},
                             None)
        hook(1, 2, before, scheduler)
        hook(2, 2, after, scheduler)
    assert torch.equal(seen[1], after), "the latents as they are"
    assert not torch.allclose(seen[3], after), "Euler's estimate of the final latents"


def test_a_map_that_is_not_finite_leaves_no_sketches(monkeypatch, caplog):
    import loraswap.engine.previews as previews_module

    previews = LatentPreviews(load_pipeline("demo"))
    monkeypatch.setattr(previews_module, "fit_linear_map", lambda vae, scale: (torch.full((3, 4), math.nan),
                                                                                torch.zeros(3)))
    assert previews.pictures(torch.zeros(1, 4, 16, 16), full=False, size=(32, 32)) == []
    assert "could not be fitted" in caplog.text


def test_a_slow_reader_holds_the_latest_step_and_a_few_pictures(monkeypatch):
    """200 steps, each with a picture, none read: one progress event and `PENDING_PICTURES` pictures."""
    import asyncio

    from loraswap.engine.previews import Preview
    from loraswap.server.streaming.feed import PENDING_PICTURES, StreamFeed

    async def fed():
        feed = StreamFeed(lambda done, total: True)
        for step in range(1, 201):
            feed(step, 200)
            feed.preview(step, 200, Preview(torch.zeros(3, 4, 4, dtype=torch.uint8)))
        feed.queued(0)
        return feed.pending(), feed.take()

    pending, taken = asyncio.run(fed())
    assert pending == 2 + PENDING_PICTURES
    assert len(taken) == pending and [e.ahead for e in taken if e.kind == "queued"] == [0]
    assert [e.step for e in taken if e.kind == "preview"] == list(range(201 - PENDING_PICTURES, 201))
    assert [e.step for e in taken if e.kind == "progress"] == [200]


def test_in_a_batch_each_image_gets_its_own_pictures(demo):
    requests = [GenerateRequest(prompt=prompt, seed=i, steps=8) for i, prompt in enumerate(DEMO_PROMPTS[:2])]
    first, second = Pictures(every=2, full=True), Pictures(every=3, full=True)
    results = _generate(demo, requests, [first, None]) + _generate(demo, requests, [None, second])
    assert [d for d, _ in first.pictures] == [2, 4, 6] and [d for d, _ in second.pictures] == [3, 6]

    def distance(picture, image):
        return (_values(picture) - _values(image)).abs().mean()

    assert distance(first.pictures[-1][1], results[0].image) < distance(first.pictures[-1][1], results[1].image)
    assert distance(second.pictures[-1][1], results[3].image) < distance(second.pictures[-1][1], results[2].image)


class Held(StepListener):
    """Holds its job at its first step until `gate` opens."""

    def __init__(self):
        self.started, self.gate = threading.Event(), threading.Event()

    def __call__(self, done, total):
        self.started.set()
        self.gate.wait(30)


class Places(StepListener):
    def __init__(self):
        self.places, self.steps = [], 0

    def queued(self, ahead):
        self.places.append(ahead)

    def __call__(self, done, total):
        self.steps = done


def test_the_worker_tells_a_waiting_job_its_place(demo):
    held, waiting = Held(), [Places(), Places()]
    worker = GpuWorker(demo, SchedulerConfig(max_batch=1))
    worker.start()
    try:
        running = worker.submit(GenerateRequest(prompt="x", seed=1, steps=2), held)
        assert held.started.wait(30)
        futures: list[Future] = [worker.submit(GenerateRequest(prompt=DEMO_PROMPTS[i], seed=i, steps=2), listener)
                                 for i, listener in enumerate(waiting)]
        assert waiting[0].places == [0] and waiting[1].places == [1], "behind the running one: none, then one"
        held.gate.set()
        for future in [running, *futures]:
            future.result(60)
    finally:
        worker.stop(10)
    assert waiting[1].places == [1, 0], "told again as the queue moves"
    assert all(w.steps == 2 for w in waiting)


def test_the_progress_board_shows_a_key_only_its_own_requests():
    from loraswap.server.streaming.progress_board import ProgressBoard

    board = ProgressBoard()
    with board.tracking("/", None, owner="key-a") as a, board.tracking("/", None, owner="key-b"):
        a(3, 10)
        assert [p.owner for p in board.in_flight("key-a")] == ["key-a"]
        assert board.current("key-b").step == 0 and board.current("key-a").step == 3
        assert board.current("key-c") is None
        assert len(board.in_flight()) == 2, "a server without keys: everyone's"
    assert board.in_flight() == []
