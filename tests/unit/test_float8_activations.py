"""`--quantize fp8`'s activations scaled in one pass (`engine/quantize/float8_activations.py`), run by
Triton's interpreter on CPU tensors, against torchao's own row-wise scaling.

torchao refuses float8 activations without a GPU of compute capability 8.9; its hardware
check is switched off here so that its configuration builds the same weights it builds on
a GPU, and its CPU path (`Float8Tensor.from_hp` in torch ops, then `torch._scaled_mm`) is
the reference. On a GPU, `tools/bench/float8_rows_bench.py` checks the compiled kernel against
torchao at FLUX.1's shapes."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton", reason="the test extra pins triton for the CPU interpreter")
pytest.importorskip("torchao", reason="the test extra pins torchao")

from torchao.quantization import Float8Tensor, PerRow  # noqa: E402

from loraswap.engine.config.engine import EngineConfig  # noqa: E402
from loraswap.engine.engine import Engine  # noqa: E402
from loraswap.engine.kernels.float8_rounding import float8_rounding  # noqa: E402
from loraswap.engine.quantize import float8_activations  # noqa: E402
from loraswap.engine.quantize.float8_activations import (  # noqa: E402
    Float8RowsLinear,
    use_float8_gelu_rows,
    use_float8_rows,
)
from loraswap.engine.quantize.weights import quantize_module  # noqa: E402
from loraswap.engine.request import GenerateRequest
from loraswap.models import denoiser_name  # noqa: E402
from loraswap.models.presets import build_preset  # noqa: E402


@pytest.fixture
def interpreted(monkeypatch):
    """The kernel built for Triton's interpreter, and torchao's float8 activations allowed on CPU."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr("torchao.quantization.quant_api._check_hardware_support", lambda granularity: None)
    kernels = (float8_activations.rows_kernel, float8_rounding)
    for built in kernels:
        built.cache_clear()
    yield
    for built in kernels:
        built.cache_clear()


@pytest.fixture
def launches(interpreted, monkeypatch) -> list:
    """The grids the activation kernel is launched on, from now on (its compiled layers are
    otherwise indistinguishable from torchao's path: the results are the same)."""
    grids, built = [], float8_activations.rows_kernel

    class Counted:
        def __getitem__(self, grid):
            grids.append(grid)
            return built()[grid]

    monkeypatch.setattr(float8_activations, "rows_kernel", Counted)
    return grids


def rows(count: int, k: int, seed: int) -> torch.Tensor:
    """Rows from 1e-4 to 1e4 in size (float8's subnormals and its largest values both occur)."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-4, 4, count)[torch.randperm(count, generator=g)]
    return (torch.randn(count, k, generator=g) * spread[:, None]).to(torch.bfloat16)


@pytest.mark.parametrize("count,k", [(7, 64), (33, 3000), (5, 4500)])  # one block, several, a ragged last one
def test_rows_are_scaled_and_rounded_as_torchao_does_bitwise(interpreted, count, k):
    x = rows(count, k, seed=k)
    values, scales = torch.ops.loraswap.float8_rows(x)
    reference = Float8Tensor.from_hp(x, granularity=PerRow())
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (count, 1)
    assert torch.equal(scales, reference.scale.reshape(count, 1))
    assert torch.equal(values.view(torch.uint8), reference.qdata.view(torch.uint8))


def test_an_all_zero_row_is_zeros_where_torchao_writes_nan(interpreted):
    x = rows(4, 300, seed=1)
    x[2] = 0
    values, scales = torch.ops.loraswap.float8_rows(x)
    assert scales[2].item() == 0.0 and not values[2].float().any()
    assert Float8Tensor.from_hp(x, granularity=PerRow()).qdata[2].float().isnan().all()  # what torchao does
    other = torch.ops.loraswap.float8_rows(x[[0, 1, 3]])
    assert torch.equal(values[[0, 1, 3]].view(torch.uint8), other[0].view(torch.uint8))


def test_rounding_to_bf16_keeps_every_nan_and_rounds_as_torch(interpreted):
    """The kernel's bf16 rounding, on NaNs of every payload (the GPU's own is 0x7FFFFFFF, which
    the rounding's carry would turn into -0.0) and on ties: torch's `.to(bfloat16)`."""
    import triton
    import triton.language as tl

    float8_activations.rows_kernel()  # defines the kernel's helpers

    @triton.jit
    def rounded(x_ptr, y_ptr, N: tl.constexpr):
        at = tl.arange(0, N)
        tl.store(y_ptr + at, float8_activations.to_bfloat16(tl.load(x_ptr + at)))

    bits = torch.tensor([0x7FFFFFFF, -1, 0x7FC00000, 0x7F800001, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF],
                        dtype=torch.int64).to(torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.randn(8)])
    y = torch.empty_like(x)
    rounded[(1,)](x, y, N=16)
    assert y[:4].isnan().all()
    assert torch.equal(y[4:], x[4:].to(torch.bfloat16).float())


def test_a_row_with_a_nan_has_torchaos_nan_scale(interpreted):
    """(Its values, NaN on a GPU as in torchao, are not: the interpreter casts NaN to float8 wrongly.)"""
    x = rows(4, 300, seed=7)
    x[1, 17] = float("nan")
    values, scales = torch.ops.loraswap.float8_rows(x)
    assert scales[1].isnan().all() and not scales[[0, 2, 3]].isnan().any()
    reference = Float8Tensor.from_hp(x, granularity=PerRow())
    assert torch.equal(values[[0, 2, 3]].view(torch.uint8), reference.qdata[[0, 2, 3]].view(torch.uint8))


def test_rows_of_a_strided_view_are_read_where_they_lie(interpreted):
    wide = rows(6, 512, seed=2)
    view = wide[:, 100:400]  # rows 512 apart
    values, scales = torch.ops.loraswap.float8_rows(view)
    reference = Float8Tensor.from_hp(view.contiguous(), granularity=PerRow())
    assert torch.equal(values.view(torch.uint8), reference.qdata.view(torch.uint8))
    assert torch.equal(scales, reference.scale.reshape(-1, 1))


class Block(nn.Module):
    """A norm feeding q and an MLP, whose output projections take the kernel."""

    def __init__(self):
        super().__init__()
        self.norm, self.to_q = nn.LayerNorm(96), nn.Linear(96, 96)
        self.ff = nn.Module()
        self.ff.net = nn.Sequential(nn.Linear(96, 256), nn.GELU(approximate="tanh"), nn.Linear(256, 80, bias=False))
        self.proj_out = nn.Linear(96 + 80, 64)

    def forward(self, x):
        x = self.norm(x)
        return self.proj_out(torch.cat([self.to_q(x), self.ff.net(x)], dim=-1))


def quantized_model() -> nn.Module:
    torch.manual_seed(0)
    model = Block().to(torch.bfloat16)
    quantize_module(model, "fp8")
    return model


def test_fp8_output_projections_scale_activations_in_one_pass_with_torchaos_result(launches):
    model = quantized_model()
    switched = {name for name, m in model.named_modules() if type(m) is Float8RowsLinear}
    assert switched == {"ff.net.2", "proj_out"}  # q and the MLP's first layer take a norm's output
    x = rows(2 * 9, 96, seed=3).reshape(2, 9, 96) / 100
    with torch.no_grad():
        ours = model(x)
        assert len(launches) == 2  # the kernel ran, once for each
        for layer in (model.ff.net[2], model.proj_out):
            layer.__class__ = nn.Linear  # torchao's own path through the same weights
        reference = model(x)
    assert ours.shape == (2, 9, 64) and torch.equal(ours, reference)


@pytest.mark.parametrize("preset, expected", [
    ("tiny-flux", {"attn.to_out.0", "attn.to_add_out", "ff.net.2", "ff_context.net.2", "proj_out"}),
    ("tiny-flux2", {"attn.to_out.0", "attn.to_add_out", "attn.to_out", "ff.linear_out", "ff_context.linear_out",
                    "proj_out"}),
    ("tiny-qwen-image", {"attn.to_out.0", "attn.to_add_out", "img_mlp.net.2", "txt_mlp.net.2", "proj_out"}),
    ("tiny-sd3", {"attn.to_out.0", "attn.to_add_out", "attn2.to_out.0", "ff.net.2", "ff_context.net.2", "proj_out"}),
])
def test_each_familys_attention_outputs_and_feed_forward_second_layers_take_the_kernel(interpreted, preset,
                                                                                         expected):
    """The layers whose input comes from attention or the feed-forward's activation, by each
    family's own names (FLUX.2's single blocks end in `attn.to_out`, its SwiGLU in
    `linear_out`); the layers fed by a norm (q, k, v, the MLPs' first layers) keep torchao's,
    but for the last `proj_out`, fed by the output norm alone (nothing to share). (The tiny
    Wan's layers are too small for torchao's float8; its `ffn.net.2` is measured on a GPU.)"""
    pipeline = build_preset(preset)
    denoiser = getattr(pipeline, denoiser_name(pipeline)).to(torch.bfloat16)
    quantize_module(denoiser, "fp8")
    switched = {name.split(".", 2)[-1] for name, m in denoiser.named_modules() if type(m) is Float8RowsLinear}
    assert switched == expected


def test_every_fp8_layer_can_take_the_kernel(launches):
    model = quantized_model()
    assert use_float8_rows(model, names=None) == 2  # the two not switched yet
    x = rows(5, 96, seed=5) / 100
    with torch.no_grad():
        ours = model(x)
        assert len(launches) == 4
        for layer in model.modules():
            if isinstance(layer, Float8RowsLinear):
                layer.__class__ = nn.Linear
        assert torch.equal(ours, model(x))


def test_a_feed_forwards_gelu_moves_into_its_second_layers_kernel(launches):
    """diffusers' FeedForward (tanh-GELU) with the GELU applied by the kernel as it reads the
    first layer's output: the same float8 values as torchao's scaling of torch's GELU output
    but where the two GELUs round apart, one float8 step at most."""
    from diffusers.models.activations import GELU
    from diffusers.models.attention import FeedForward

    torch.manual_seed(1)
    model = nn.Module()
    model.ff = FeedForward(96, dim_out=80, activation_fn="gelu-approximate").to(torch.bfloat16)
    quantize_module(model, "fp8")
    assert use_float8_gelu_rows(model) == 1 and type(model.ff.net[2]).__name__ == "Float8GeluRowsLinear"
    x = rows(40, 96, seed=6) / 100
    with torch.no_grad():
        hidden = model.ff.net[0](x)  # the first layer's output, before the GELU
        ours = torch.ops.loraswap.float8_rows(hidden, True)
        reference = Float8Tensor.from_hp(F.gelu(hidden, approximate="tanh"), granularity=PerRow())
        launched = len(launches)
        out = model.ff(x)
        assert len(launches) == launched + 1
        model.ff.net[0].__class__, model.ff.net[2].__class__ = GELU, nn.Linear
        expected = model.ff(x)
    differs = ours[0].view(torch.uint8) != reference.qdata.view(torch.uint8)
    assert differs.float().mean() < 0.01
    steps = (ours[0].float() - reference.qdata.float()).abs() / reference.qdata.float().abs().clamp(min=2**-9)
    assert (steps[differs] <= 2**-3 + 1e-6).all()
    assert ((out.float() - expected.float()).norm() / expected.float().norm()).item() < 0.01


def test_other_modes_and_dtypes_keep_torchaos_path(interpreted):
    model = nn.Sequential(nn.Linear(32, 32)).to(torch.bfloat16)
    quantize_module(model, "fp8-weight-only")
    assert type(model[0]) is nn.Linear
    model = quantized_model()
    with torch.no_grad():
        x = rows(3, 176, seed=4) / 100
        assert torch.equal(model.proj_out(x.float()), nn.Linear.forward(model.proj_out, x.float()))  # torchao's


@pytest.mark.slow
def test_an_fp8_engine_swaps_per_request_with_torchaos_images(launches, adapter_factory, tmp_path):
    """The tiny FLUX model in `fp8` with an adapter swapped in (the swap re-quantizes the
    weights the kernel's layers read): its image equals torchao's own path's, bitwise."""
    adapter_factory("strong", "tiny-flux", rank=8, targets="all", alpha=64.0, seed=70, folder=tmp_path)
    engine = Engine(EngineConfig(model="tiny-flux", adapters=tmp_path, compile=False, warmup=False, quantize="fp8",
                                 dtype="bfloat16"))
    switched = [m for m in engine.denoiser.modules() if isinstance(m, Float8RowsLinear)]
    assert switched and all(type(m) is Float8RowsLinear for m in switched)
    assert {name.rsplit(".", 1)[-1] for name, m in engine.denoiser.named_modules()
            if type(m) is Float8RowsLinear} >= {"proj_out", "0", "to_add_out", "2"}

    def image(loras) -> np.ndarray:
        request = GenerateRequest(prompt="a fox", seed=2, steps=1, width=32, height=32, loras=loras)
        return np.asarray(engine.generate(request).image)

    ours = image([("strong", 0.8)])
    assert len(launches) >= len(switched)  # every output projection through the kernel
    for module in switched:
        module.__class__ = nn.Linear
    assert np.array_equal(image([("strong", 0.8)]), ours)
    assert not np.array_equal(image([]), ours)  # the adapter is in it
