"""Swaps on a float8 base (`--quantize`): re-quantized from a pristine float8 copy.

CPU runs torchao's weight-only float8 (the dynamic-activation modes need a GPU of compute
capability 8.9+); the swap path is the same: `Float8Tensor.qdata` and `scale` rewritten.
`fp8-tensorwise` runs here as weight-only float8 with its one scale per tensor."""

import numpy as np
import pytest
import torch
from support.numerics import rel_err

pytest.importorskip("torchao", reason="the test extra pins torchao")

from loraswap.adapters.reference import AdapterRef
from loraswap.engine.config.engine import EngineConfig  # noqa: E402
from loraswap.engine.engine import Engine  # noqa: E402
from loraswap.engine.quantize import weights as quantize  # noqa: E402
from loraswap.engine.request import GenerateRequest


def float8_state(engine: Engine) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {name: (m.weight.qdata.clone(), m.weight.scale.clone()) for name, m in engine.denoiser.named_modules()
            if hasattr(getattr(m, "weight", None), "qdata")}


def assert_float8_unchanged(engine: Engine, before: dict) -> None:
    after = float8_state(engine)
    assert after.keys() == before.keys()
    changed = [n for n in before if not (torch.equal(before[n][0], after[n][0]) and
                                         torch.equal(before[n][1], after[n][1]))]
    assert not changed, f"{len(changed)} float8 weights changed, e.g. {changed[:3]}"


@pytest.fixture(params=["fp8-weight-only", "fp8-tensorwise"])
def engines(request, adapter_factory, tmp_path, monkeypatch):
    if request.param == "fp8-tensorwise":  # its weights (one scale per tensor) without its float8 activations
        from torchao.quantization import Float8WeightOnlyConfig, PerTensor

        monkeypatch.setattr(quantize, "float8_config", lambda mode: Float8WeightOnlyConfig(
            granularity=PerTensor(), set_inductor_config=False))
    adapter_factory("strong", "tiny-flux", rank=8, targets="all", alpha=64.0, seed=70, folder=tmp_path)
    adapter_factory("other", "tiny-flux", rank=4, targets="attn", alpha=8.0, seed=71, folder=tmp_path)
    common = dict(model="tiny-flux", adapters=tmp_path, compile=False, warmup=False)
    fp8 = Engine(EngineConfig(**common, quantize=request.param))
    scales = {m.weight.scale.numel() == 1 for m in fp8.denoiser.modules()
              if hasattr(getattr(m, "weight", None), "qdata")}
    assert scales == {request.param == "fp8-tensorwise"}  # one scale per tensor, or one per row
    return Engine(EngineConfig(**common)), fp8


def image(engine: Engine, loras) -> np.ndarray:
    return np.asarray(engine.generate(GenerateRequest(prompt="a fox", seed=2, steps=2, loras=loras)).image, float)


def test_fp8_swap_adds_the_adapter_and_no_error_beyond_quantization(engines):
    full, fp8 = engines
    assert len(float8_state(fp8)) > 20
    quantization = rel_err(image(fp8, []), image(full, []))
    with_adapter = rel_err(image(fp8, [("strong", 1.0)]), image(full, [("strong", 1.0)]))
    effect = rel_err(image(full, [("strong", 1.0)]), image(full, []))
    assert 0 < quantization < 0.05
    assert effect > 4 * quantization  # the adapter visibly changes the image ...
    assert with_adapter < 1.5 * quantization + 0.01  # ... and float8 costs no more with it than without


def test_fp8_weights_are_requantized_within_half_a_float8_step(engines):
    _, fp8 = engines
    before = float8_state(fp8)
    bound = fp8.adapters.read(AdapterRef("strong"))
    fp8.set_adapters([("strong", 1.0)])
    checked = 0
    for (component, param), layer in bound.layers.items():
        if (component, param) not in fp8.swapper.float8_layers:
            continue
        name = param.removesuffix(".weight")
        qdata, scale = before[name]
        exact = qdata.float() * scale.float() + layer.scale * (layer.up.float() @ layer.down.float())
        weight = fp8.denoiser.get_submodule(name).weight
        fused = weight.qdata.float() * weight.scale.float()
        # e4m3: each row's (or the tensor's) scale puts its largest value at 448; 3 mantissa bits
        per_tensor = weight.scale.numel() == 1
        bound = exact.abs().amax(dim=(0, 1) if per_tensor else 1, keepdim=True) * 2**-4 + 1e-6
        assert ((fused - exact).abs() <= bound).all(), name
        assert not torch.equal(weight.qdata, qdata)
        checked += 1
    assert checked > 20


def test_fp8_blends_failures_and_reset_leave_the_base_bitwise(engines, monkeypatch):
    _, fp8 = engines
    before = float8_state(fp8)
    blended = image(fp8, [("strong", 0.7), ("other", 0.5)])
    assert not np.array_equal(blended, image(fp8, []))
    assert_float8_unchanged(fp8, before)  # the base image above reset the weights

    from loraswap.engine.swap import fused as swap

    calls = {"n": 0}
    real_write = swap.Fp8Weight.write

    def failing_write(self, deltas, kernel=False):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected")
        real_write(self, deltas, kernel)

    monkeypatch.setattr(swap.Fp8Weight, "write", failing_write)
    with pytest.raises(RuntimeError, match="injected"):
        fp8.set_adapters([("strong", 1.0)])
    assert_float8_unchanged(fp8, before)
    monkeypatch.setattr(swap.Fp8Weight, "write", real_write)
    assert np.array_equal(image(fp8, [("strong", 0.7), ("other", 0.5)]), blended)


def test_dynamic_fp8_is_refused_where_the_hardware_lacks_it():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="cannot run here.*use fp8-weight-only"):
        Engine(EngineConfig(model="tiny-flux", compile=False, warmup=False, quantize="fp8"))


def test_text_encoder_adapters_swap_onto_float8_text_encoders(adapter_factory, tmp_path):
    adapter_factory("te", "tiny-sdxl", rank=8, targets="attn", text_encoder=True, alpha=32.0, seed=72, folder=tmp_path)
    engine = Engine(EngineConfig(model="tiny-sdxl", adapters=tmp_path, compile=False, warmup=False,
                                 quantize_text_encoders="fp8-weight-only"))
    encoders = [engine.pipeline.text_encoder, engine.pipeline.text_encoder_2]
    state = lambda: [(m.weight.qdata.clone(), m.weight.scale.clone()) for e in encoders  # noqa: E731
                     for m in e.modules() if hasattr(getattr(m, "weight", None), "qdata")]
    before = state()
    assert len(before) > 10 and not any(hasattr(m.weight, "qdata") for m in engine.denoiser.modules()
                                        if isinstance(m, torch.nn.Linear))
    base = image(engine, [])
    with_adapter = image(engine, [("te", 1.0)])
    assert sum(c[0] == "text_encoder" for c in engine.swapper.float8_layers) > 5
    assert rel_err(with_adapter, base) > 0.01
    engine.set_adapters([])
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(before, state()))


def test_quantizing_leaves_inductor_settings_of_the_process_alone():
    """torchao's default switches on coordinate-descent tuning process-wide (minutes per
    FLUX.1 compile, warm cache or not); loraswap's quantization must not."""
    import torch._inductor.config as inductor_config

    from loraswap.engine.quantize.weights import quantize_module

    keys = ("coordinate_descent_tuning", "coordinate_descent_check_all_directions", "force_fuse_int_mm_with_mul")
    # off whatever ran before in this process, and back afterwards (Inductor's settings are not
    # plain attributes: monkeypatch's undo deletes them for the rest of the process)
    with inductor_config.patch(dict.fromkeys(keys, False)):
        module = torch.nn.Sequential(torch.nn.Linear(64, 64, dtype=torch.bfloat16))
        quantize_module(module, "fp8-weight-only")
        assert type(module[0].weight).__name__ == "Float8Tensor"
        assert {key: getattr(inductor_config, key) for key in keys} == dict.fromkeys(keys, False)


def test_fp8_modes_are_torchaos_dynamic_float8_per_row_or_per_tensor():
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor

    for mode, granularity in (("fp8", PerRow), ("fp8-tensorwise", PerTensor)):
        config = quantize.float8_config(mode)
        assert isinstance(config, Float8DynamicActivationFloat8WeightConfig)
        assert all(isinstance(g, granularity) for g in config.granularity) and not config.set_inductor_config
    with pytest.raises(ValueError, match="unknown quantization 'int4'; choose one of none, fp8, fp8-tensorwise"):
        quantize.float8_config("int4")


@pytest.mark.parametrize("device,index", [("cuda", 0), ("cuda:1", 1)])
def test_the_gpu_memory_cap_names_the_gpu_by_index(monkeypatch, device, index):
    """torch refuses a memory fraction for a device without an index (plain `cuda`, the
    default), which stopped `--max-gpu-memory-gb` on the H200 before anything loaded."""
    from types import SimpleNamespace

    from torch.cuda._utils import _get_device_index

    from loraswap.engine.process import cap_gpu_memory

    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=141 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, d: calls.append((fraction, _get_device_index(d))))  # torch's own check
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda settings: None)
    cap_gpu_memory(torch.device(device), 24)
    assert calls == [(pytest.approx(24 / 141), index)]
    cap_gpu_memory(torch.device(device), 200)
    assert calls[-1] == (1.0, index)


@pytest.mark.parametrize("env,expected", [
    ({}, ["expandable_segments:True"]),
    # the operator's other settings restated: torch's parser resets what a string leaves out
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, ["max_split_size_mb:512,expandable_segments:True"]),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, []),  # the operator's choice stands
    ({"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.8,expandable_segments:True"}, []),
])
def test_the_gpu_memory_cap_grows_expandable_segments(monkeypatch, env, expected):
    """Fixed segments held 2.2 GiB reserved beyond the allocated peak in the 24 GB mode on
    the H200; under a cap the allocator grows expandable segments instead, unless told."""
    from types import SimpleNamespace

    from loraswap.engine.process import cap_gpu_memory

    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", settings.append)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=141 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda fraction, d: None)
    cap_gpu_memory(torch.device("cuda:0"), 24)
    assert settings == expected
