"""`--attention` and `--compile-mode`: what reaches the model, and what is refused."""

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from support.numerics import rel_err

from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest
from loraswap.engine.startup.compile import compile_pipeline


@pytest.fixture(autouse=True)
def restore_dispatcher_default():
    """diffusers keeps the last backend set as a process-wide default: put native back."""
    yield
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)


def image(model: str, attention: str | None) -> np.ndarray:
    engine = Engine(EngineConfig(model=model, compile=False, warmup=False, attention=attention))
    return engine, np.asarray(engine.generate(GenerateRequest(prompt="a fox", seed=4, steps=2)).image, dtype=float)


def test_unknown_backend_is_refused_with_the_known_ones():
    with pytest.raises(ValidationError, match="unknown attention backend 'flashy'.*_native_cudnn.*native"):
        EngineConfig(attention="flashy")
    assert EngineConfig(attention="_Native_Math").compilation.attention == "_native_math"


def test_dispatcher_models_get_the_backend_on_every_processor():
    engine, chosen = image("tiny-flux", "_native_math")
    processors = [m.processor for m in engine.components["transformer"].modules() if hasattr(m, "processor")]
    assert processors and all(str(p._attention_backend.value) == "_native_math" for p in processors)
    _, default = image("tiny-flux", None)
    assert rel_err(chosen, default) < 0.02  # the same attention, another kernel: 8-bit rounding apart


def test_unet_models_get_the_sdpa_kernel_and_refuse_other_backends(monkeypatch):
    import torch
    import torch.nn.functional as F

    # what SDPA was allowed to use, call by call, while the UNet ran
    seen, sdpa = [], F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append((torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    engine, chosen = image("tiny-sd", "_native_math")
    assert seen and all(flags == (False, True) for flags in seen)  # flash off, math on: the choice reached SDPA
    seen.clear()
    _, default = image("tiny-sd", None)
    assert seen and all(flags == (True, True) for flags in seen)  # and is undone after the call
    assert rel_err(chosen, default) < 0.02
    with pytest.raises(ValueError, match="'flash' does not apply to the unet.*choose native or one of _native_cudnn"):
        Engine(EngineConfig(model="tiny-sd", compile=False, warmup=False, attention="flash"))


@pytest.mark.parametrize("mode,regional", [("default", True), ("max-autotune-no-cudagraphs", True),
                                           ("reduce-overhead", False), ("max-autotune", False)])
def test_cuda_graph_modes_compile_the_whole_denoiser(monkeypatch, mode, regional):
    engine = Engine(EngineConfig(model="tiny-flux", compile=False, warmup=False, compile_mode=mode))
    calls = []
    denoiser = engine.denoiser
    # regional: each repeated block's forward compiled (`compile_blocks`); else the whole denoiser
    monkeypatch.setattr(torch, "compile", lambda forward, **kw: calls.append(("blocks", kw)) or forward)
    monkeypatch.setattr(denoiser, "compile", lambda **kw: calls.append(("whole", kw)))
    compile_pipeline(engine.pipeline, mode, compile_vae=False)
    expected_options = {} if mode == "default" else {"mode": mode}
    blocks = sum(type(m).__name__ in denoiser._repeated_blocks for m in denoiser.modules())
    expected = [("blocks", {"fullgraph": True, **expected_options})] * blocks if regional else [
        ("whole", {"fullgraph": False, **expected_options})]
    assert blocks > 1 and calls == expected


def test_bench_options_variants_are_checked_before_anything_is_built():
    from loraswap.bench.options import parse_variant

    assert parse_variant("_native_cudnn@reduce-overhead") == ("_native_cudnn", "reduce-overhead", "none")
    assert parse_variant("@max-autotune") == ("native", "max-autotune", "none")
    assert parse_variant("FLEX") == ("flex", "default", "none")
    assert parse_variant("native@@fp8-tensorwise") == ("native", "default", "fp8-tensorwise")
    assert parse_variant("native@reduce-overhead@fp8") == ("native", "reduce-overhead", "fp8")
    with pytest.raises(ValueError, match="unknown compile mode 'turbo'.*reduce-overhead"):
        parse_variant("native@turbo")
    with pytest.raises(ValueError, match="unknown quantization 'int4'.*fp8-tensorwise"):
        parse_variant("native@default@int4")
    with pytest.raises(ValueError, match="unknown attention backend 'fa9'"):
        parse_variant("fa9@default")
    from loraswap.bench.options import run_options_bench

    with pytest.raises(ValueError, match="one attention backend per run"):
        run_options_bench("sdxl", ("native@default", "_native_cudnn@reduce-overhead"))
