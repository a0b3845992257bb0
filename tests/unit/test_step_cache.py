"""Step caching in the engine: settings and their bounds; the cache off is bitwise the uncached
image, before and after cached requests with other adapters and methods, and after a call
stopped halfway; no hook of a call stays on the denoiser; which models take which methods;
the methods a server allows; MagCache's calibration, measured or read; batching; compile."""

import contextlib
import json
from concurrent.futures import Future, wait
from types import SimpleNamespace

import pytest
import torch
from diffusers.hooks.mag_cache import nearest_interp
from pydantic import ValidationError

from loraswap.engine.calls import Stopped
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.config.scheduling import SchedulerConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest
from loraswap.engine.step_cache import METHODS, PROMPT, StepCache, StepCaching, attach, canonical, parse_step_cache
from loraswap.engine.step_cache.calibration import BadCalibration
from loraswap.engine.step_cache.hooks import COMPUTED, FIRST_INPUT, PASS_NAMES
from loraswap.engine.worker import GpuWorker, Job
from loraswap.errors import BadRequest, UnsupportedInput
from loraswap.models import denoiser_names, load_pipeline

STEPS = 4
REQUEST = dict(prompt="a red circle", seed=3, steps=STEPS, width=64, height=64)
LORAS = {"base": [], "a": [("a", 1.0)], "blend": [("a", 0.5), ("b", 0.7)]}
# settings that skip some steps of tiny-flux at STEPS, never all
CACHED = ["first-block:threshold=0.5", "taylorseer:interval=2,warmup=1", "magcache:threshold=0.5"]
OURS = {*attach.HOOKS, PASS_NAMES, COMPUTED, FIRST_INPUT}


# ---------------------------------------------------------------- settings
@pytest.mark.parametrize(("texts", "expected"), [
    (["first-block", " First-Block: threshold=0.08 ", "first-block:threshold=8e-2,"], "first-block:threshold=0.08"),
    (["taylorseer:order=2", "taylorseer:warmup=3, order=2 ,interval=4"], "taylorseer:interval=4,order=2,warmup=3"),
    (["magcache:max-skip=2", "magcache:retention=0.2,max_skip=2,threshold=0.06"],
     "magcache:threshold=0.06,max_skip=2,retention=0.2"),
    (["off", " OFF "], "off")])
def test_one_setting_written_several_ways_is_one_canonical_text(texts, expected):
    assert {canonical(text) for text in texts} == {expected}
    assert canonical(None) is None, "None stays the server's default"
    setting = parse_step_cache(texts[0])
    if setting is not None:
        assert [key for key, _ in setting.options] == list(METHODS[setting.method]), "every option, defaults filled"
        assert parse_step_cache(str(setting)) == setting


@pytest.mark.parametrize(("text", "named"), [
    ("teacache:threshold=0.1", ["unknown step cache 'teacache'", "off, first-block, taylorseer, magcache"]),
    ("first-block:interval=2", ["first-block takes threshold=", "'interval=2'"]),
    ("taylorseer:threshold", ["taylorseer takes interval=, order=, warmup="]),
    ("first-block:threshold=1.5", ["threshold must be between 0 and 1, not 1.5"]),
    ("first-block:threshold=nan", ["threshold must be between 0 and 1"]),
    ("magcache:max_skip=0", ["max_skip must be between 1 and 20, not 0"]),
    ("taylorseer:interval=2.5", ["interval must be a whole number, not '2.5'"]),
    ("magcache:threshold=low", ["threshold must be a number, not 'low'"])])
def test_a_bad_setting_is_refused_naming_the_fix(text, named):
    with pytest.raises(BadRequest) as refused:
        canonical(text)
    assert all(words in refused.value.message for words in named), refused.value.message


def test_the_engine_config_refuses_a_bad_default_and_unknown_methods():
    assert EngineConfig(step_cache="First-Block").step_caching.step_cache == "first-block:threshold=0.08"
    with pytest.raises(ValidationError, match="between 0 and 1"):
        EngineConfig(step_cache="first-block:threshold=-1")
    with pytest.raises(ValidationError, match="unknown step cache teacache: use first-block, taylorseer, magcache"):
        EngineConfig(step_cache_allow=["first-block", "teacache"])


# ---------------------------------------------------------------- the engine
@contextlib.contextmanager
def _denoiser_outputs(engine):
    """The denoiser's output of every pass, as floats (stricter than the 8-bit image)."""
    outputs = []
    handle = engine.denoiser.register_forward_hook(lambda module, args, output: outputs.append(output[0].clone()))
    try:
        yield outputs
    finally:
        handle.remove()


def _run(engine, step_cache=None, loras=(), **params):
    with _denoiser_outputs(engine) as outputs:
        result = engine.generate(GenerateRequest(**{**REQUEST, **params}, loras=list(loras), step_cache=step_cache))
    return result, torch.stack(outputs)


def _assert_same(run, expected) -> None:
    (result, outputs), (expected_result, expected_outputs) = run, expected
    assert torch.equal(outputs, expected_outputs), (outputs - expected_outputs).abs().max()
    assert result.image.tobytes() == expected_result.image.tobytes()


def _assert_no_cache_hook(served) -> None:
    modules = dict(served.engine.denoiser.named_modules())
    left = [f"{name}: {hook}" for name, module in modules.items()
            for hook in getattr(getattr(module, "_diffusers_hook", None), "hooks", {}) if hook in OURS]
    assert not left, left
    changed = [name for name, module in modules.items() if getattr(module.forward, "__func__", None)
               is not type(module).forward]  # the class's own forward, as on a model never hooked
    assert not changed, f"forwards not restored: {changed[:3]}"


@pytest.fixture(scope="module")
def served(adapter_factory, tmp_path_factory):
    """An engine serving every method, and the images of an engine that never attached a cache."""
    folder = tmp_path_factory.mktemp("step-cache-adapters")
    for name, seed in (("a", 31), ("b", 32)):
        adapter_factory(name, "tiny-flux", rank=4, targets="all", fmt="kohya", seed=seed, dtype=torch.float32,
                        folder=folder)
    plain = Engine(EngineConfig(model="tiny-flux", adapters=folder, warmup=False, step_cache_allow=[]))
    uncached = {name: _run(plain, None, loras) for name, loras in LORAS.items()}
    engine = Engine(EngineConfig(model="tiny-flux", adapters=folder, warmup=False, step_cache_allow=list(METHODS)))
    first_cached = {}

    def cached(step_cache: str, name: str):
        """The first image of this setting and adapters: every later one must be the same."""
        if (step_cache, name) not in first_cached:
            first_cached[step_cache, name] = _run(engine, step_cache, LORAS[name])
        return first_cached[step_cache, name]

    return SimpleNamespace(engine=engine, uncached=uncached, cached=cached)


def test_the_cache_off_is_bitwise_the_uncached_image_before_and_after_cached_requests(served):
    engine = served.engine
    _assert_no_cache_hook(served)  # MagCache's calibration at start left none
    for (name, loras), off in zip(LORAS.items(), (None, "off", "off")):  # after MagCache's calibration at start
        _assert_same(_run(engine, off, loras), served.uncached[name])
    for step_cache, name in [(CACHED[0], "a"), (CACHED[1], "blend"), (CACHED[2], "base")]:
        result, outputs = served.cached(step_cache, name)
        assert 0 < result.steps_skipped < STEPS and result.steps_run == STEPS, (step_cache, result.steps_skipped)
        assert result.step_cache == canonical(step_cache)
        assert (outputs - served.uncached[name][1]).abs().max() > 1e-3, "the cache stood in for some blocks"
        _assert_no_cache_hook(served)
        off = _run(engine, "off", LORAS[name])
        assert (off[0].steps_skipped, off[0].steps_run, off[0].step_cache) == (None, None, None)
        _assert_same(off, served.uncached[name])
    _assert_same(_run(engine, CACHED[0], LORAS["a"]), served.cached(CACHED[0], "a"))  # nothing of the others left


@pytest.mark.parametrize("step_cache", CACHED)
def test_a_call_stopped_halfway_leaves_no_hook_and_the_next_calls_are_fresh(served, step_cache):
    engine = served.engine
    fresh = served.cached(step_cache, "a")

    def stop_at_step_2(done: int, total: int) -> None:
        if done == 2:
            raise Stopped()

    request = GenerateRequest(**REQUEST, loras=LORAS["a"], step_cache=step_cache)
    with engine.lender.lease_now(request.loras) as lease, pytest.raises(Stopped):
        engine.generate_batch([request], lease, on_step=stop_at_step_2)
    _assert_no_cache_hook(served)
    _assert_same(_run(engine, step_cache, LORAS["a"]), fresh)
    _assert_same(_run(engine, None, LORAS["a"]), served.uncached["a"])


def test_a_unet_model_refuses_a_step_cache_naming_the_families_that_take_it():
    engine = Engine(EngineConfig(model="tiny-sd", warmup=False))
    request = dict(prompt="a red circle", seed=1, steps=2, width=32, height=32)
    with pytest.raises(UnsupportedInput, match=r"tiny-sd takes no step cache: .*flux, .*wan\)") as refused:
        engine.generate(GenerateRequest(**request, step_cache="first-block"))
    assert "sd3" in refused.value.message and "ask for step_cache off" in refused.value.message
    off, default = (engine.generate(GenerateRequest(**request, step_cache=s)) for s in ("off", None))
    assert off.steps_skipped is None and off.image.tobytes() == default.image.tobytes()
    with pytest.raises(UnsupportedInput, match="step caching serves the transformer families"):
        Engine(EngineConfig(model="tiny-sd", warmup=False, step_cache="first-block"))


@pytest.mark.parametrize(("preset", "takes"), [("tiny-flux", METHODS), ("tiny-wan", ["first-block", "taylorseer"]),
                                               ("tiny-flux2", ["taylorseer", "magcache"]),
                                               ("tiny-sd3", ["magcache"]), ("tiny-z-image", ["magcache"])])
def test_each_model_takes_the_methods_its_blocks_allow(preset, takes):
    pipeline = load_pipeline(preset)
    cache = StepCache([getattr(pipeline, name) for name in denoiser_names(pipeline)], preset, None, list(METHODS))
    cache.ratios = [1.0, 0.9]
    for method in METHODS:
        if method in takes:
            assert cache.choose(method).method == method
        else:
            with pytest.raises(UnsupportedInput, match=f"{preset} cannot take {method}: .*; it takes "
                                                       f"{', '.join(takes)}$"):
                cache.choose(method)


def test_a_request_gets_the_methods_the_server_allows_and_its_default():
    transformer = load_pipeline("tiny-flux").transformer
    allowing = StepCache([transformer], "tiny-flux", None, ["first-block"])
    with pytest.raises(BadRequest, match="serves the step caches off, first-block, not taylorseer"):
        allowing.choose("taylorseer")
    assert allowing.choose("off") is None and allowing.choose(None) is None
    defaulting = StepCache([transformer], "tiny-flux", "taylorseer:interval=2", ["first-block"])
    assert str(defaulting.choose(None)) == "taylorseer:interval=2,order=1,warmup=3"
    assert defaulting.choose("taylorseer:interval=5")["interval"] == 5, "the default's method, other settings"
    assert defaulting.choose("first-block").method == "first-block" and defaulting.choose("off") is None
    with pytest.raises(BadRequest, match="tiny-flux has no MagCache calibration"):
        StepCache([transformer], "tiny-flux", None, list(METHODS)).choose("magcache")


# ---------------------------------------------------------------- MagCache's calibration
def test_magcache_ratios_are_measured_at_start(served):
    ratios = served.engine.step_cache.ratios
    assert len(ratios) == served.engine.calls.defaults["steps"] and ratios[0] == 1.0
    assert all(0 < r < 100 for r in ratios) and len(set(ratios)) > 1, ratios


def test_magcache_ratios_measured_on_request_are_the_start_ups_and_each_adapters_own(served):
    """`Engine.measure_magcache_ratios` (a tool compares the ratios of adapters): over the
    start-up's image, the start-up's ratios; with an adapter, others; no hook left on the model."""
    engine = served.engine
    base = engine.measure_magcache_ratios(GenerateRequest(prompt=PROMPT, seed=0))
    assert base == engine.step_cache.ratios
    with_adapter = engine.measure_magcache_ratios(GenerateRequest(prompt=PROMPT, seed=0, loras=[("a", 1.0)]))
    assert len(with_adapter) == len(base) and with_adapter != base
    _assert_no_cache_hook(served)
    _assert_same(_run(engine), served.uncached["base"])


def test_a_calibration_file_is_used_instead_of_measuring(tmp_path, monkeypatch):
    given = [1.0, 1.02, 0.95, 0.9, 0.8]
    (tmp_path / "ratios.json").write_text(json.dumps({"ratios": given}))
    monkeypatch.setattr(Engine, "generate", lambda *args, **kwargs: pytest.fail("measured at start"))
    engine = Engine(EngineConfig(model="tiny-flux", warmup=False, step_cache_allow=["magcache"],
                                 step_cache_calibration=tmp_path / "ratios.json"))
    monkeypatch.undo()
    assert engine.step_cache.ratios == given
    used = []
    apply = attach.APPLY["magcache"]
    monkeypatch.setitem(attach.APPLY, "magcache", lambda module, config: used.append(config) or apply(module, config))
    result = engine.generate(GenerateRequest(**REQUEST, step_cache="magcache"))
    assert result.steps_run == STEPS and result.steps_skipped is not None
    assert torch.equal(used[0].mag_ratios, nearest_interp(torch.tensor(given), STEPS)), "interpolated to the steps"


@pytest.mark.parametrize("text", ["[1.0, 0.9", "[1.0]", "[1.0, -0.5, 0.9]", "[1.0, true, 0.9]", '{"ratio": [1, 1]}'])
def test_a_bad_calibration_file_refuses_the_start_naming_it(tmp_path, text):
    (tmp_path / "bad.json").write_text(text)
    with pytest.raises(BadCalibration, match=f"--step-cache-calibration {tmp_path / 'bad.json'}: "):
        Engine(EngineConfig(model="tiny-flux", warmup=False, step_cache="magcache",
                            step_cache_calibration=tmp_path / "bad.json"))


def test_a_two_expert_model_refuses_magcache_and_is_not_calibrated():
    # diffusers' MagCache counts each expert's steps from 0: the second expert would read the
    # first steps' ratios, so Wan 2.2's pair takes the methods whose schedule needs no ratios
    engine = Engine(EngineConfig(model="tiny-wan", warmup=False, step_cache_allow=list(METHODS)))
    assert engine.step_cache.ratios is None
    with pytest.raises(UnsupportedInput, match="cannot take magcache: .*two experts.*it takes first-block, taylorseer"):
        engine.step_cache.choose("magcache")


# ---------------------------------------------------------------- what the engine holds
def _caching(allow: list[str], calibration=None) -> StepCaching:
    return StepCaching([load_pipeline("tiny-flux").transformer], "tiny-flux", torch.device("cpu"), "off", allow,
                       calibration)


def test_step_caching_reads_the_operators_ratios_without_generating(tmp_path):
    given = [1.0, 0.9, 0.8]
    (tmp_path / "ratios.json").write_text(json.dumps(given))
    caching = _caching(["magcache"], tmp_path / "ratios.json")
    caching.calibrate(lambda request: pytest.fail("measured"), lambda: pytest.fail("a warm-up request made"))
    assert caching.ratios == caching.cache.ratios == given
    assert caching.choose("magcache").method == "magcache"
    assert caching.capabilities() == {"step_caches": ["magcache"], "step_cache": "off"}


def test_step_caching_measures_the_ratios_once_through_the_engines_generate():
    """Without the operator's file, `calibrate` measures over the warm-up's image (the
    calibration prompt, the default steps) through the `generate` it is given; meanwhile every
    call records instead of caching, and says nothing of a step cache in its result."""
    caching = _caching(["first-block", "magcache"])
    made = []

    def generate(request: GenerateRequest) -> None:
        skips = caching.skips_for(request)
        assert skips is not None and skips.setting is None and caching.result_fields(skips) == {}
        skips.computed.append(SimpleNamespace(ratios=[1.0, 0.7]))  # what the hooks record over the image
        made.append(request)

    warm_up = GenerateRequest(prompt="warm-up", seed=0, steps=2, step_cache="first-block")
    caching.calibrate(generate, lambda: warm_up)
    caching.calibrate(generate, lambda: pytest.fail("a warm-up request made once calibrated"))
    assert [(r.prompt, r.steps, r.seed) for r in made] == [(PROMPT, None, 0)] and caching.ratios == [1.0, 0.7]
    assert caching.skips_for(warm_up).setting.method == "first-block", "recording ends with the measure"


def test_step_caching_off_leaves_a_call_as_it_is():
    caching = _caching(["first-block"])
    plain = GenerateRequest(prompt="x", step_cache="off")

    def on_step(done: int, total: int) -> None: ...

    assert caching.skips_for(plain) is None and caching.counting(None, on_step) is on_step
    assert isinstance(caching.for_attempt(None, {}, {}), contextlib.nullcontext) and caching.result_fields(None) == {}


# ---------------------------------------------------------------- batching, compile
def _served_by_a_worker(engine, requests: list[GenerateRequest]):
    """The requests queued before the worker starts (free to batch them): their results, and
    how many batches served them."""
    worker = GpuWorker(engine, SchedulerConfig(max_queue=8, max_batch=4))
    futures = [worker.submit(request) for request in requests]
    worker.start()
    wait(futures, timeout=120)
    worker.stop(30)
    return [future.result() for future in futures], worker.batches


def test_requests_differing_only_in_the_step_cache_are_not_one_batch(served):
    def request(step_cache, seed=3):
        return GenerateRequest(**{**REQUEST, "seed": seed}, step_cache=canonical(step_cache))

    same = [Job(request("taylorseer"), Future(), 0.0), Job(request("taylorseer:order=1", seed=4), Future(), 0.0)]
    assert same[0].batch_key == same[1].batch_key, "one setting written two ways"
    keys = {Job(request(s), Future(), 0.0).batch_key for s in (None, "off", "taylorseer", CACHED[1])}
    assert len(keys) == 4
    # TaylorSeer's steps follow from the step alone: a batch skips what each request would alone
    (first, off, second), batches = _served_by_a_worker(served.engine, [
        request(CACHED[1], 5), request("off", 6), request("taylorseer:warmup=1,order=1,interval=2", 7)])
    assert batches == 2, "the two TaylorSeer requests in one batch, the uncached one alone"
    assert first.steps_skipped == second.steps_skipped > 0 and off.steps_skipped is None


def test_a_first_block_request_skips_in_a_batch_what_it_skips_alone(served):
    # First-Block Cache decides from the whole batch's residuals, so its requests run alone
    requests = [GenerateRequest(**{**REQUEST, "prompt": prompt, "seed": seed, "steps": 6},
                                step_cache="first-block:threshold=0.33")
                for prompt, seed in (("a red circle", 5), ("a blue square on black", 11))]
    alone = [served.engine.generate(request) for request in requests]
    served_together, _ = _served_by_a_worker(served.engine, requests)
    assert [r.steps_skipped for r in served_together] == [r.steps_skipped for r in alone]


@pytest.mark.slow
def test_compiled_blocks_take_every_method_and_adapters_with_no_recompile(served):
    folder = served.engine.config.sources.adapters
    engine = Engine(EngineConfig(model="tiny-flux", adapters=folder, compile=True, warmup=True,
                                 step_cache_allow=list(METHODS)))
    before = engine.generate(GenerateRequest(**REQUEST))
    for step_cache, loras in zip(CACHED, (LORAS["a"], LORAS["blend"], LORAS["base"])):
        result = engine.generate(GenerateRequest(**REQUEST, loras=loras, step_cache=step_cache))
        assert result.steps_skipped > 0, step_cache
        assert engine.generate(GenerateRequest(**REQUEST, loras=loras, step_cache="off")).steps_skipped is None
    assert engine.generate(GenerateRequest(**REQUEST)).image.tobytes() == before.image.tobytes()
    assert engine.recompiles == 0
