"""`--quantize fp8`'s activations scaled in one pass (`engine/float8_activations.py`), run by
Triton's interpreter on CPU tensors, against torchao's own row-wise scaling.

torchao refuses float8 activations without a GPU of compute capability 8.9; its hardware
check is switched off here so that its configuration builds the same weights it builds on
a GPU, and its CPU path (`Float8Tensor.from_hp` in torch ops, then `torch._scaled_mm`) is
the reference. On a GPU, `scripts/float8_rows_bench.py` checks the compiled kernel against
torchao at FLUX.1's shapes."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton", reason="the test extra pins triton for the CPU interpreter")
pytest.importorskip("torchao", reason="the test extra pins torchao")

from torchao.quantization import Float8Tensor, PerRow  # noqa: E402

from loraswap.engine import float8_activations  # noqa: E402
from loraswap.engine.config import EngineConfig, GenerateRequest  # noqa: E402
from loraswap.engine.engine import Engine  # noqa: E402
from loraswap.engine.float8_activations import Float8RowsLinear, use_float8_rows  # noqa: E402
from loraswap.engine.float8_producers import Float8FeedForward, Float8SingleBlock, restore_producers  # noqa: E402
from loraswap.engine.float8_rounding import float8_rounding  # noqa: E402
from loraswap.engine.quantize import quantize_module  # noqa: E402


@pytest.fixture
def interpreted(monkeypatch):
    """The kernel built for Triton's interpreter, and torchao's float8 activations allowed on CPU."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr("torchao.quantization.quant_api._check_hardware_support", lambda granularity: None)
    kernels = (float8_activations._kernels, float8_rounding)
    for built in kernels:
        built.cache_clear()
    yield
    for built in kernels:
        built.cache_clear()


@pytest.fixture
def launches(interpreted, monkeypatch) -> list:
    """The activation kernels' launches from now on, as (kernel, grid) (its compiled layers
    are otherwise indistinguishable from torchao's path: the results are the same)."""
    grids, built = [], float8_activations._kernels

    class Counted:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            grids.append((self.name, grid))
            return built()[self.name][grid]

    monkeypatch.setattr(float8_activations, "_kernels", lambda: {name: Counted(name) for name in ("whole", "loop")})
    return grids


def rows(count: int, k: int, seed: int) -> torch.Tensor:
    """Rows from 1e-4 to 1e4 in size (float8's subnormals and its largest values both occur)."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-4, 4, count)[torch.randperm(count, generator=g)]
    return (torch.randn(count, k, generator=g) * spread[:, None]).to(torch.bfloat16)


@pytest.mark.parametrize("whole", [True, False], ids=["held whole", "looped over"])
@pytest.mark.parametrize("count,k", [(7, 64), (33, 3000), (5, 4500)])  # one block, several, a ragged last one
def test_rows_are_scaled_and_rounded_as_torchao_does_bitwise(interpreted, monkeypatch, count, k, whole):
    if not whole:
        monkeypatch.setattr(float8_activations, "WHOLE_ROW_VALUES", 32)
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


def assert_one_float8_step_at_most(ours: torch.Tensor, reference: torch.Tensor) -> None:
    """Float8 values equal but where the kernel's GELU rounds to another bf16 value than
    torch's (under 1% of them), and there one float8 step apart (an eighth of the value)."""
    differs = ours.view(torch.uint8) != reference.view(torch.uint8)
    assert differs.float().mean() < 0.01
    steps = (ours.float() - reference.float()).abs() / reference.float().abs().clamp(min=2**-9)
    assert (steps[differs] <= 2**-3 + 1e-6).all()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_a_feed_forwards_gelu_moves_into_its_second_layers_kernel(launches):
    """diffusers' FeedForward (tanh-GELU) with the GELU applied by the kernel as it reads the
    first layer's output: torchao's scaling of torch's GELU output, within a float8 step."""
    from diffusers.models.attention import FeedForward

    torch.manual_seed(1)
    model = nn.Module()
    model.ff = FeedForward(96, dim_out=80, activation_fn="gelu-approximate").to(torch.bfloat16)
    quantize_module(model, "fp8")  # `fp8` moves it
    assert type(model.ff) is Float8FeedForward and type(model.ff.net[2]) is Float8RowsLinear
    x = rows(40, 96, seed=6) / 100
    with torch.no_grad():
        hidden = model.ff.net[0](x)  # the first layer's output, before the GELU
        ours = torch.ops.loraswap.float8_rows(hidden, True)
        reference = Float8Tensor.from_hp(F.gelu(hidden, approximate="tanh"), granularity=PerRow())
        launched = len(launches)
        out = model.ff(x)
        assert len(launches) == launched + 1
        restore_producers(model)
        assert type(model.ff) is FeedForward
        expected = model.ff(x)
    assert_one_float8_step_at_most(ours[0], reference.qdata)
    assert relative(out, expected) < 0.01


def test_a_row_continued_by_a_gelud_tail_is_scaled_as_their_concatenation(interpreted, monkeypatch):
    head, tail = rows(70, 96, seed=8), rows(70, 300, seed=9) / 100
    head[3], tail[5] = 0, 0  # a row's largest value in its tail, and in its head
    values, scales = torch.ops.loraswap.float8_rows(head, False, tail, True)
    reference = Float8Tensor.from_hp(torch.cat([head, F.gelu(tail, approximate="tanh")], dim=1), granularity=PerRow())
    assert values.shape == (70, 396)
    assert (scales.reshape(-1) != reference.scale.reshape(-1)).float().mean() < 0.05  # where the largest is a GELU's
    assert_one_float8_step_at_most(values, reference.qdata)
    monkeypatch.setattr(float8_activations, "WHOLE_ROW_VALUES", 256)  # too long to hold: concatenated, looped over
    looped = torch.ops.loraswap.float8_rows(head, False, tail, True)
    assert torch.equal(looped[1], scales) and torch.equal(looped[0].view(torch.uint8), values.view(torch.uint8))


def test_flux_single_blocks_proj_out_reads_attention_and_the_mlp_where_they_lie(launches):
    """FLUX.1's single block in `fp8`: proj_out's kernel applies the MLP's GELU and scales
    the concatenation it never writes; the block's output is torchao's path's."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    torch.manual_seed(2)
    model = nn.Module()
    model.block = FluxSingleTransformerBlock(64, num_attention_heads=2, attention_head_dim=32).to(torch.bfloat16)
    quantize_module(model, "fp8")
    assert type(model.block) is Float8SingleBlock and type(model.block.proj_out) is Float8RowsLinear
    hidden, text = rows(2 * 24, 64, seed=10).reshape(2, 24, 64) / 100, rows(2 * 6, 64, seed=11).reshape(2, 6, 64) / 100
    temb = rows(2, 64, seed=12)
    with torch.no_grad():
        launched = len(launches)
        ours = model.block(hidden, text, temb)
        assert len(launches) == launched + 1  # proj_out's: one launch for both parts
        restore_producers(model)
        assert type(model.block) is FluxSingleTransformerBlock
        expected = model.block(hidden, text, temb)
    for got, want in zip(ours, expected, strict=True):
        assert got.shape == want.shape and relative(got, want) < 0.01


class Wrapped(nn.Module):
    """A layer wrapped as PEFT wraps one (its LoRA branch reads the same input)."""

    def __init__(self, layer: nn.Linear):
        super().__init__()
        self.base_layer = layer

    def forward(self, x):
        return self.base_layer(x) + x[..., : self.base_layer.out_features] * 0.5


def test_producers_whose_layer_is_wrapped_run_diffusers_own_forward(launches):
    """PEFT's baselines wrap the float8 layers: the single block and the feed-forward then
    give the wrapper the GELU'd input diffusers' own forward gives it."""
    from diffusers.models.attention import FeedForward
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    torch.manual_seed(4)
    model = nn.Module()
    model.ff = FeedForward(64, dim_out=32, activation_fn="gelu-approximate").to(torch.bfloat16)
    model.block = FluxSingleTransformerBlock(64, num_attention_heads=2, attention_head_dim=32).to(torch.bfloat16)
    quantize_module(model, "fp8")
    model.ff.net[2], model.block.proj_out = Wrapped(model.ff.net[2]), Wrapped(model.block.proj_out)
    x, text = rows(2 * 8, 64, seed=13).reshape(2, 8, 64) / 100, rows(2 * 3, 64, seed=14).reshape(2, 3, 64) / 100
    temb = rows(2, 64, seed=15)
    with torch.no_grad():
        ours = (model.ff(x), *model.block(x, text, temb))
        restore_producers(model)
        expected = (model.ff(x), *model.block(x, text, temb))
    for got, want in zip(ours, expected, strict=True):
        assert torch.equal(got, want)


def test_regional_compile_still_finds_fluxs_single_blocks(interpreted):
    """diffusers' regional compile finds blocks by class name: the single blocks, now
    `Float8SingleBlock`, are compiled as before."""
    from diffusers import FluxTransformer2DModel

    from loraswap.engine.compile import compile_denoiser

    torch.manual_seed(3)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)).to(torch.bfloat16)
    quantize_module(model, "fp8")
    assert {type(block) for block in model.single_transformer_blocks} == {Float8SingleBlock}
    compile_denoiser(model, "default")
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    assert all(block._compiled_call_impl is not None for block in blocks)


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
    weights the kernel's layers read): with each GELU where torch computes it, its image
    equals torchao's own path's, bitwise; as served, with the GELUs in the kernel, within a
    level of it."""
    adapter_factory("strong", "tiny-flux", rank=8, targets="all", alpha=64.0, seed=70, folder=tmp_path)
    engine = Engine(EngineConfig(model="tiny-flux", adapters=tmp_path, compile=False, warmup=False, quantize="fp8",
                                 dtype="bfloat16"))
    switched = [m for m in engine.denoiser.modules() if isinstance(m, Float8RowsLinear)]
    assert {type(m) for m in switched} == {Float8RowsLinear}
    assert any(type(m) is Float8FeedForward for m in engine.denoiser.modules())  # feed-forwards' GELU in the kernel
    assert {name.rsplit(".", 1)[-1] for name, m in engine.denoiser.named_modules()
            if isinstance(m, Float8RowsLinear)} >= {"proj_out", "0", "to_add_out", "2"}
    assert any(type(m) is Float8SingleBlock for m in engine.denoiser.modules())

    def image(loras) -> np.ndarray:
        request = GenerateRequest(prompt="a fox", seed=2, steps=1, width=32, height=32, loras=loras)
        return np.asarray(engine.generate(request).image)

    served = image([("strong", 0.8)])
    assert len(launches) >= len(switched)  # every output projection through the kernel
    restore_producers(engine.denoiser)
    ours = image([("strong", 0.8)])
    for module in switched:
        module.__class__ = nn.Linear
    reference = image([("strong", 0.8)])
    assert np.array_equal(reference, ours)
    assert np.abs(served.astype(float) - reference).mean() < 1.0
    assert not np.array_equal(image([]), ours)  # the adapter is in it
