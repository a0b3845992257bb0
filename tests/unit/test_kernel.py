"""The swap kernels (one pass for plain weights, two for float8 ones), run by Triton's
interpreter on CPU tensors.

On a GPU the same kernels are compiled; `tests/gpu/test_gpu_smoke.py` checks the one-pass kernel
there against `addmm` in bf16, `tests/gpu/test_fp8_kernel.py` the float8 one against
torchao's quantization. Here the interpreter checks the indexing,
masking, blending and float8 rounding."""

import pytest
import torch
from support.numerics import assert_bitwise_equal, weights_snapshot

pytest.importorskip("triton", reason="the test extra pins triton for the CPU interpreter")


@pytest.fixture(scope="module")
def interpreted():
    """The kernel built once for Triton's CPU interpreter (and rebuilt normally afterwards)."""
    from loraswap.engine.kernels import float8 as float8_kernels
    from loraswap.engine.kernels import fused as kernels
    from loraswap.engine.kernels.float8_rounding import float8_rounding

    built = (kernels.tile_functions, kernels.lora_kernel, kernels.loha_kernel, kernels.dora_kernel, float8_rounding,
             float8_kernels.float8_functions, float8_kernels.row_functions, float8_kernels.per_tensor_kernel,
             float8_kernels.per_row_kernel)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        for kernel in built:
            kernel.cache_clear()
        yield kernels
    for kernel in built:
        kernel.cache_clear()


@pytest.fixture(scope="module")
def float8(interpreted):
    """The float8 kernels, under Triton's CPU interpreter as `interpreted`."""
    from loraswap.engine.kernels import float8 as float8_kernels

    return float8_kernels


class Launches(list):
    """Which float8 kernel ("per tensor", "per row") each launch ran; `unmasked`: whether
    each per-row launch ran without masks (whole tiles and rank blocks)."""

    unmasked: list


@pytest.fixture
def float8_launches(float8, monkeypatch) -> Launches:
    """The float8 kernels' launches from now on (`Launches`)."""
    launched, built = Launches(), float8.float8_kernels
    launched.unmasked = []

    class Counted:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launched.append(self.name)

            def launch(*args, **options):
                if "EVEN" in options:
                    launched.unmasked.append(options["EVEN"])
                return self.kernel[grid](*args, **options)
            return launch

    monkeypatch.setattr(float8, "float8_kernels", lambda: tuple(
        Counted(name, kernel) for name, kernel in zip(("per tensor", "per row"), built())))
    return launched


@pytest.mark.parametrize("dtype,ulps", [(torch.float32, 1e-6), (torch.bfloat16, 2**-7)])
@pytest.mark.parametrize("m,n,k", [(70, 200, 4), (33, 17, 40), (130, 129, 33)])
def test_loha_kernel_matches_the_products_within_one_rounding(interpreted, dtype, ulps, m, n, k):
    """W = P + alpha * (B1 @ A1) * (B2 @ A2) in one pass, against float64 (and in place)."""
    g = torch.Generator().manual_seed(m + n * k)
    pristine, up1, down1, up2, down2 = (torch.randn(*s, generator=g).to(dtype)
                                        for s in ((m, n), (m, k), (k, n), (m, k), (k, n)))
    exact = pristine.double() + 0.3 * (up1.double() @ down1.double()) * (up2.double() @ down2.double())
    weight = torch.full_like(pristine, float("nan"))
    interpreted.fuse_loha_into(weight, pristine, up1, down1, up2, down2, 0.3)
    tolerance = ulps * exact.abs().clamp(min=1.0) + 1e-5 * k * k
    assert ((weight.double() - exact).abs() <= tolerance).all()
    interpreted.fuse_loha_into(weight, weight, up1, down1, up2, down2, -0.3)
    assert ((weight.double() - pristine.double()).abs() <= 2 * tolerance).all()


@pytest.mark.parametrize("peft", [True, False])
@pytest.mark.parametrize("by_row", [True, False])
@pytest.mark.parametrize("dtype,ulps", [(torch.float32, 1e-6), (torch.bfloat16, 2**-7)])
def test_dora_kernel_matches_the_rescaled_change(interpreted, peft, by_row, dtype, ulps):
    """PEFT's W = V * m / ||V|| and LyCORIS's W = V * (w (m / ||V|| - 1) + 1) (norms per row,
    or per column), V = P + alpha * B @ A, in one pass over W (two over P), against float64."""
    g = torch.Generator().manual_seed(3)
    m, n, k = 70, 130, 8
    pristine, up, down = (torch.randn(*s, generator=g).to(dtype) for s in ((m, n), (m, k), (k, n)))
    magnitude = torch.rand(m if by_row else n, generator=g).double() + 0.5
    merged = torch.addmm(pristine.double(), up.double(), down.double(), alpha=0.4)
    norms = merged.norm(dim=1 if by_row else 0)
    factor = magnitude / norms if peft else 0.7 * (magnitude / norms - 1) + 1
    exact = merged * factor.view((-1, 1) if by_row else (1, -1))
    weight = torch.full_like(pristine, float("nan"))
    interpreted.fuse_dora_into(weight, pristine, up, down, 0.4, magnitude.float(), 0.7, peft, by_row)
    assert ((weight.double() - exact).abs() <= ulps * exact.abs().clamp(min=1.0) + 1e-5).all()


@pytest.mark.parametrize("dtype,ulps", [(torch.float32, 1e-6), (torch.float16, 2**-10), (torch.bfloat16, 2**-7)])
@pytest.mark.parametrize("m,n,k", [(70, 200, 4), (128, 256, 64), (33, 17, 40), (1, 300, 1), (130, 129, 33)])
def test_kernel_matches_addmm_within_one_rounding(interpreted, dtype, ulps, m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    pristine, up, down = (torch.randn(*s, generator=g).to(dtype) for s in ((m, n), (m, k), (k, n)))
    assert interpreted.kernel_available(pristine)
    exact = torch.addmm(pristine.double(), up.double(), down.double(), alpha=0.7)

    weight, before = torch.full_like(pristine, float("nan")), pristine.clone()
    interpreted.fuse_into(weight, pristine, up, down, 0.7, use_kernel=True)
    # one rounding of the exact result: the error is within half an ulp of |W| (plus fp32 sums)
    tolerance = ulps * exact.abs().clamp(min=1.0) + 1e-5 * k
    assert ((weight.double() - exact).abs() <= tolerance).all()
    assert torch.equal(pristine, before)  # the pristine copy is only read

    # in place (a further adapter of a blend): W += alpha * B @ A
    again = weight.clone()
    interpreted.fuse_into(again, again, up, down, -0.7, use_kernel=True)
    twice = torch.addmm(weight.double(), up.double(), down.double(), alpha=-0.7)
    assert ((again.double() - twice).abs() <= ulps * twice.abs().clamp(min=1.0) + 1e-5 * k).all()


def test_swap_through_the_kernel_matches_addmm_and_returns_to_base(interpreted, adapter_factory, tmp_path):
    from loraswap.engine.config.engine import EngineConfig
    from loraswap.engine.engine import Engine

    adapter_factory("k1", "tiny-sdxl", rank=16, targets="all", text_encoder=True, seed=90, folder=tmp_path)
    adapter_factory("k2", "tiny-sdxl", rank=4, targets="attn", seed=91, folder=tmp_path)
    engines = [Engine(EngineConfig(model="tiny-sdxl", adapters=tmp_path, compile=False, warmup=False))
               for _ in range(2)]
    engines[1].swapper.kernel = False
    base = weights_snapshot(engines[0].components)
    results = []
    for engine in engines:
        engine.set_adapters([("k1", 0.8), ("k2", 0.5)])
        results.append(weights_snapshot(engine.components))
    assert engines[0].swapper.pristine_layers and not engines[0].swapper.layers_without_kernel
    changed = [k for k in base if not torch.equal(base[k], results[0][k])]
    assert len(changed) > 20
    for key in changed:  # fp32 weights: the kernel and addmm agree to float rounding
        torch.testing.assert_close(results[0][key], results[1][key], rtol=1e-5, atol=1e-6)
    engines[0].set_adapters([("k2", 1.0)])
    engines[0].set_adapters([])
    assert_bitwise_equal(base, engines[0].components)


FLOAT8 = torch.float8_e4m3fn


def test_float8_kernel_rounds_to_nearest_even_as_torch_does(float8):
    """Per tensor, with P = 0 and the largest |value| 448, the scale stays 1 and the kernel's
    float8 values are its own rounding of `values`: ties, carries into the exponent
    (124.6 -> 128), subnormals (below 2**-6, steps of 2**-9) and their ties."""
    fp8 = torch.arange(256, dtype=torch.uint8).view(FLOAT8).float()
    fp8 = fp8[fp8.isfinite()].unique()  # every float8 value, sorted
    fp8 = fp8[~fp8.signbit() | (fp8 != 0)]  # not -0: 0 + -0 is +0 in the kernel's sum, as in torchao's
    ties = (fp8[:-1] + fp8[1:]) / 2
    g = torch.Generator().manual_seed(5)
    values = torch.cat([ties, ties.nextafter(torch.tensor(0.0)), fp8, torch.tensor([124.57, -31.67, 448.0]),
                        torch.randn(500, generator=g) * 10, torch.rand(300, generator=g) * 2**-6])
    m = values.numel()
    pristine, scale = torch.zeros(m, 4, dtype=FLOAT8), torch.ones(1, 1)
    up, down = values[:, None].float(), torch.ones(1, 4)
    qdata, new_scale = torch.empty_like(pristine), torch.empty_like(scale)
    assert float8.float8_kernel_available(qdata)
    float8.requantize_into(qdata, new_scale, pristine, scale, up, down, 1.0)
    assert new_scale.item() == 1.0
    expected = values.to(FLOAT8)
    wrong = (qdata[:, 0].view(torch.uint8) != expected.view(torch.uint8)).nonzero().flatten()
    assert wrong.numel() == 0, [(values[i].item(), qdata[i, 0].item(), expected[i].item()) for i in wrong[:5]]
    assert torch.equal(qdata.view(torch.uint8), qdata[:, :1].view(torch.uint8).expand(m, 4))


@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("m,n,k", [(70, 200, 4), (33, 17, 40), (128, 256, 64), (64, 128, 16), (130, 129, 1),
                                   (20, 300, 270)])
def test_float8_kernel_matches_torchaos_requantization(float8, float8_launches, per_row, m, n, k):
    """The kernel's W = float8(dequantize(P) + alpha * B @ A) against torchao's own
    `Float8Tensor.from_hp` of the same sum in fp32, on weights of widely spread magnitude;
    with a scale per row in one launch, per tensor in two."""
    from torchao.quantization import Float8Tensor, PerRow, PerTensor

    granularity = PerRow() if per_row else PerTensor()
    g = torch.Generator().manual_seed(m + n + k)
    weight = torch.randn(m, n, generator=g) * torch.exp(torch.randn(m, n, generator=g) * 2)
    base = Float8Tensor.from_hp(weight, float8_dtype=FLOAT8, granularity=granularity)
    pristine, scale = base.qdata.clone(), base.scale.clone()
    up, down = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    high = (pristine.float() * scale).addmm_(up, down, alpha=0.3)
    expected = Float8Tensor.from_hp(high, float8_dtype=FLOAT8, granularity=granularity)

    qdata, new_scale = torch.empty_like(pristine), torch.full_like(scale, float("nan"))
    float8.requantize_into(qdata, new_scale, pristine, scale, up, down, 0.3)
    assert float8_launches == (["per row"] if per_row else ["per tensor"] * 2)  # one launch a weight per row
    # whole 16 x 64 tiles, and rank 64 two whole 32-rank blocks, rank 16 one 16-rank block: no masks
    assert float8_launches.unmasked == ([(m, n, k) in ((128, 256, 64), (64, 128, 16))] if per_row else [])
    torch.testing.assert_close(new_scale, expected.scale.reshape(scale.shape), rtol=1e-6, atol=0)
    expected_q = expected.qdata
    # fp32 sums in another order can move a value across a rounding boundary, by one step
    differs = qdata.view(torch.uint8) != expected_q.view(torch.uint8)
    assert differs.float().mean() < 1e-3
    steps = (qdata.float() - expected_q.float()).abs() / expected_q.float().abs().clamp(min=2**-9)
    assert (steps[differs] <= 2**-3 + 1e-6).all()
    assert torch.equal(pristine, base.qdata)  # the pristine copy is only read


@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("m,n", [(70, 130), (64, 128)])  # 64 x 128: whole tiles and rank blocks, no masks
def test_float8_kernel_blends_match_torchaos_requantization_of_the_sum(float8, float8_launches, per_row, m, n):
    """A blend of three LoRAs of ranks 5, 40 and 32 (padded to 32, 64 and 32 ranks) in one
    call, each weighted by its own blend weight, against torchao's quantization of the fp32
    sum the eager path makes."""
    from torchao.quantization import Float8Tensor, PerRow, PerTensor

    from loraswap.adapters.kinds import LORA, Layer
    from loraswap.engine.swap.float8_weights import side_by_side

    granularity = PerRow() if per_row else PerTensor()
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(m, n, generator=g) * torch.exp(torch.randn(m, n, generator=g) * 2)
    base = Float8Tensor.from_hp(weight, float8_dtype=FLOAT8, granularity=granularity)
    pristine, scale = base.qdata.clone(), base.scale.clone()
    changes = [(Layer(LORA, {"up": torch.randn(m, r, generator=g), "down": torch.randn(r, n, generator=g)}, s), b)
               for r, s, b in ((5, 0.5, 0.7), (40, 0.1, -1.2), (32, 1.0, 0.3))]
    high = pristine.float() * scale
    for layer, blend in changes:
        high.addmm_(layer.up, layer.down, alpha=blend * layer.scale)
    expected = Float8Tensor.from_hp(high, float8_dtype=FLOAT8, granularity=granularity)
    up, down, alpha, alphas = side_by_side(changes, torch.device("cpu"))
    assert up.shape == (m, 128) and down.shape == (128, n) and alphas.tolist() == pytest.approx(
        [0.35, -0.12, -0.12, 0.3])
    qdata, new_scale = torch.empty_like(pristine), torch.full_like(scale, float("nan"))
    float8.requantize_into(qdata, new_scale, pristine, scale, up, down, alpha, alphas)
    assert float8_launches.unmasked == ([m == 64] if per_row else [])
    torch.testing.assert_close(new_scale, expected.scale.reshape(scale.shape), rtol=1e-6, atol=0)
    differs = qdata.view(torch.uint8) != expected.qdata.view(torch.uint8)
    assert differs.float().mean() < 1e-3  # fp32 sums in another order, one step at most
    steps = (qdata.float() - expected.qdata.float()).abs() / expected.qdata.float().abs().clamp(min=2**-9)
    assert (steps[differs] <= 2**-3 + 1e-6).all()


@pytest.mark.parametrize("change", ["lora", "loha", "lokr", "dora-peft", "dora-lycoris-out", "dora-lycoris-in"])
@pytest.mark.parametrize("even", [False, True])  # True: whole tiles and rank blocks, no masks
def test_float8_row_kernel_writes_each_kind_as_torchao_quantizes_the_eager_sum(float8, float8_launches, change,
                                                                               even):
    """One LoRA, one LoHa (W += (B1 @ A1) * (B2 @ A2)), one LoKr (kron(w1, w2a @ w2b)), or DoRA over a
    LoRA (each output row of the sum rescaled by PEFT's or LyCORIS's factor), re-quantized by
    the per-row kernel in one call, against torchao's quantization of the fp32 sum
    `kinds.write` makes (the eager path); DoRA rescaling input columns stays eager."""
    from torchao.quantization import Float8Tensor, PerRow

    from loraswap.adapters.kinds import LOHA, LOKR, LORA, Layer
    from loraswap.engine.swap.float8_weights import Fp8Weight

    g = torch.Generator().manual_seed(11)
    # (even: a LoRA and a LoHa of rank 16, one whole block of 16 ranks)
    m, n, r = (32, 128, 16 if change in ("lora", "loha") else 32) if even else (36, 300, 12)
    weight = torch.randn(m, n, generator=g) * torch.exp(torch.randn(m, n, generator=g))
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if change == "loha":
        layer = Layer(LOHA, {"w1a": rand(m, r), "w1b": rand(r, n), "w2a": rand(m, r), "w2b": rand(r, n)}, 0.05)
    elif change == "lora":
        layer = Layer(LORA, {"up": rand(m, r), "down": rand(r, n)}, 0.4)
    elif change == "lokr":  # kron of [4, 10] and [9, 30] (even: [4, 8] and [8, 16])
        p, q = (m // 4, n // 8) if even else (9, 30)
        layer = Layer(LOKR, {"w1": rand(4, n // q), "w2a": rand(p, 3), "w2b": rand(3, q)}, 0.3)
    else:
        convention = change.removeprefix("dora-")
        magnitude = rand(n) if convention == "lycoris-in" else rand(m).abs() * 30 + 1
        layer = Layer(LORA, {"up": rand(m, r), "down": rand(r, n), "magnitude": magnitude}, 0.4, dora=convention)
    fp8 = [Fp8Weight(Float8Tensor.from_hp(weight.clone(), float8_dtype=FLOAT8, granularity=PerRow()))
           for _ in range(2)]
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        from loraswap.engine.swap import float8_weights

        patch.setattr(float8_weights, "requantize_into", lambda *a, **k: calls.append(k) or float8.requantize_into(
            *a, **k))
        fp8[0].write([(layer, 0.8)], kernel=True)
    fp8[1].write([(layer, 0.8)], kernel=False)
    assert len(calls) == (0 if change == "dora-lycoris-in" else 1)
    assert float8_launches.unmasked == ([] if change == "dora-lycoris-in" else [even])
    torch.testing.assert_close(fp8[0].scale, fp8[1].scale, rtol=2e-6, atol=0)
    differs = fp8[0].qdata.view(torch.uint8) != fp8[1].qdata.view(torch.uint8)
    assert differs.float().mean() < 1e-3  # fp32 sums in another order, one step at most
    steps = (fp8[0].qdata.float() - fp8[1].qdata.float()).abs() / fp8[1].qdata.float().abs().clamp(min=2**-9)
    assert (steps[differs] <= 2**-3 + 1e-6).all()
    assert not torch.equal(fp8[0].qdata, fp8[0].pristine_qdata)


def test_float8_row_kernel_unrolls_the_ranks_its_shared_memory_can_pipeline(monkeypatch):
    """Per row, the rank unrolled in a power of two of 32-rank blocks, with as many pipelining
    stages (up to the tiles' most) as the factors' and weight's tiles fit in 70% of an H100's shared memory,
    else a loop over the ranks, not pipelined. Tall weights of short rows take 32 x 128 tiles."""
    from loraswap.engine.kernels.float8 import rank_block, row_plan, row_tiles

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (the interpreter takes small tiles)
    assert row_tiles(55296, 6144) == row_tiles(36864, 6144) == (32, 128, 4)  # FLUX.2's fused projections
    assert row_tiles(6144, 24576) == row_tiles(3072, 3072) == row_tiles(55296, 12288) == (16, 256, 3)

    cpu = torch.device("cpu")
    assert [row_plan(rank, 2, cpu) for rank in (1, 32, 33, 64, 96, 128, 256, 257)] == [
        (1, 3), (1, 3), (2, 3), (2, 3), (4, 2), (4, 2), (8, 1), (0, 1)]
    assert row_plan(128, 4, cpu) == (4, 1) and row_plan(256, 4, cpu) == (0, 1)  # fp32 factors, or LoHa's pairs
    # ranks up to 16 in one block of 16 (not in a blend, whose weights are per 32 ranks)
    assert [rank_block(rank, False) for rank in (16, 48, 8, 1, 24, 32, 64)] == [16, 32, 16, 16, 32, 32, 32]
    assert rank_block(16, True) == 32 and row_plan(16, 2, cpu, block_k=16) == (1, 3)
    assert row_plan(48, 2, cpu, block_k=16) == (4, 3)  # blocks of 16 unrolled in a power of two, too
    # the 32 x 128 tiles of tall weights: up to 4 stages
    assert [row_plan(rank, 2, cpu, (32, 128, 4)) for rank in (32, 128, 256)] == [(1, 4), (4, 3), (8, 1)]


def test_the_float8_warm_up_compiles_every_variant_real_swaps_launch(float8, monkeypatch):
    """What Triton compiles a per-row launch for (its constants, and which integers are
    multiples of 16 or 1, and the tensors' dtypes), at FLUX.1-dev's shapes: every variant a
    swap launches (LoRA at common ranks, a blend, LoHa, DoRA both ways, LoKr) is one the
    warm-up launched. Nothing runs: the kernel is a recorder."""
    from loraswap.engine.kernels.float8_warm_up import warm_up_float8

    launched: set = set()

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **options):
                # N and K specialized (M, P, Q, alpha and blend are not)
                integers = tuple(16 if x % 16 == 0 else 1 if x == 1 else 0 for x in args[11:13])
                dtypes = tuple(x.dtype for x in args if isinstance(x, torch.Tensor))
                launched.add((tuple(sorted(options.items())), integers, dtypes))
            return launch

    monkeypatch.setattr(float8, "float8_kernels", lambda: (None, Recorder()))
    monkeypatch.setattr(float8, "interpreting", lambda: False)  # the GPU's tiles
    shapes = [(3072, 64), (3072, 3072), (9216, 3072), (12288, 3072), (21504, 3072), (3072, 12288), (3072, 15360)]
    warm_up_float8(torch.device("cpu"), False, shapes)
    warmed, launched = launched, set()
    bf16 = dict(dtype=torch.bfloat16)
    for m, n in shapes:
        qdata, scale = torch.empty(m, n, dtype=FLOAT8), torch.ones(m, 1)
        write = lambda *operands, **options: float8.requantize_into(  # noqa: E731
            qdata, scale, qdata, scale, *operands, **options)
        for rank in (4, 8, 16, 24, 32, 40, 48, 64, 72, 96, 100, 128):
            up, down = torch.empty(m, rank, **bf16), torch.empty(rank, n, **bf16)
            write(up, down, 1.0)
            write(up, down, 1.0, kind="hadamard", second=(up, down))
            for peft in (True, False):
                write(up, down, 1.0, dora=float8.DoraRows(torch.ones(m, **bf16), 1.0, peft))
        write(torch.empty(m, 96, **bf16), torch.empty(96, n, **bf16), 1.0, torch.ones(3))  # a blend: 16 + 32 ranks
        write(torch.empty(4, 8), torch.empty(m // 4, n // 8), 1.0, kind="kronecker")
    assert launched <= warmed, sorted(launched - warmed)[:3]


def test_float8_row_kernel_loops_over_the_ranks_where_its_plan_runs_out_of_shared_memory(float8, monkeypatch):
    launches = []

    class Kernel:  # Triton's launch of the compiled kernel, short of shared memory when unrolled
        def __getitem__(self, grid):
            def launch(*args, K_BLOCKS, STAGES, **flags):
                launches.append((K_BLOCKS, STAGES))
                if K_BLOCKS:
                    raise float8.OutOfResources(290936, 232448, "shared memory")
            return launch

    monkeypatch.setattr(float8, "float8_kernels", lambda: (None, Kernel()))
    monkeypatch.setattr(float8, "SHORT_OF_MEMORY", set())
    qdata, scale = torch.zeros(4, 64, dtype=FLOAT8), torch.ones(4, 1)
    up, down = torch.ones(4, 128, dtype=torch.bfloat16), torch.ones(128, 64, dtype=torch.bfloat16)
    for _ in range(2):
        float8.requantize_into(qdata, scale, qdata.clone(), scale.clone(), up, down, 1.0)
    # (16 x 64 tiles under the interpreter: 3 stages fit) the plan that ran short is not tried again
    assert launches == [(4, 3), (0, 1), (0, 1)]


@pytest.mark.parametrize("per_row", [True, False])
def test_a_blend_unrolled_past_its_ranks_reads_no_weight_beyond_its_blocks(float8, per_row):
    """Ranks 32 + 64 are three blocks, unrolled as four: the fourth reads no blend weight
    (here a NaN just past the three), so the result equals the one with a zero there."""
    g = torch.Generator().manual_seed(3)
    m, n = 20, 70
    pristine = (torch.randn(m, n, generator=g) * 50).to(FLOAT8)
    scale = torch.rand(m if per_row else 1, 1, generator=g) * 1e-2
    up, down = torch.randn(m, 96, generator=g), torch.randn(96, n, generator=g)
    results = []
    for past in (float("nan"), 0.0):
        alphas = torch.tensor([0.3, -0.1, 0.2, past])[:3]
        qdata, new_scale = torch.empty_like(pristine), torch.empty_like(scale)
        float8.requantize_into(qdata, new_scale, pristine, scale, up, down, 1.0, alphas)
        results.append((qdata.view(torch.uint8), new_scale))
    assert results[0][1].isfinite().all() and torch.equal(results[0][1], results[1][1])
    assert torch.equal(results[0][0], results[1][0])


def test_the_row_kernel_refuses_changes_it_cannot_write(float8):
    qdata, scale = torch.zeros(6, 8, dtype=FLOAT8), torch.ones(6, 1)
    refused = {"needs its second pair": dict(kind="hadamard"), "is not 6 x 8": dict(kind="kronecker"),
               "unknown change": dict(kind="tucker")}
    for message, options in refused.items():
        with pytest.raises(ValueError, match=message):
            float8.requantize_into(qdata, scale, qdata.clone(), scale.clone(), torch.ones(2, 2), torch.ones(3, 5), 1.0,
                                   **options)
    with pytest.raises(ValueError, match="contiguous"):
        float8.requantize_into(qdata, scale, qdata.clone(), scale.clone(), torch.ones(2, 6).T, torch.ones(2, 8), 1.0)


@pytest.mark.slow  # Triton's interpreter
def test_float8_swaps_through_the_kernel_match_eager_and_return_to_base(float8, adapter_factory, tmp_path):
    pytest.importorskip("torchao", reason="the test extra pins torchao")
    from loraswap.engine.config.engine import EngineConfig
    from loraswap.engine.engine import Engine

    adapter_factory("f1", "tiny-flux", rank=8, targets="all", alpha=32.0, seed=92, folder=tmp_path)
    adapter_factory("f2", "tiny-flux", rank=20, targets="all", alpha=10.0, seed=93, folder=tmp_path)
    engines = [Engine(EngineConfig(model="tiny-flux", adapters=tmp_path, compile=False, warmup=False,
                                   quantize="fp8-weight-only")) for _ in range(2)]
    engines[1].swapper.float8_kernel = False
    state = lambda e: {n: (m.weight.qdata.clone(), m.weight.scale.clone())  # noqa: E731
                       for n, m in e.denoiser.named_modules() if hasattr(getattr(m, "weight", None), "qdata")}
    base = state(engines[0])
    calls = []
    real = float8.requantize_into
    with pytest.MonkeyPatch.context() as patch:
        from loraswap.engine.swap import float8_weights

        patch.setattr(float8_weights, "requantize_into", lambda *a: calls.append(1) or real(*a))
        fused = []
        for engine in engines:
            engine.set_adapters([("f1", 1.0)])
            fused.append(state(engine))
        calls.append("blend")
        for engine in engines:  # a blend of two: one kernel call per weight too
            engine.set_adapters([("f1", 0.7), ("f2", -0.4)])
            fused.append(state(engine))
    changed = [n for n in base if not torch.equal(base[n][0], fused[0][n][0])]
    one, blend = calls[:calls.index("blend")], calls[calls.index("blend") + 1:]
    assert len(changed) > 20 and len(one) == len(changed)  # every touched float8 weight, by the kernel
    assert len(blend) == len({n for n in base if not torch.equal(base[n][0], fused[2][n][0])})
    for first, second in ((0, 1), (2, 3)):
        for name in changed:
            (q, s), (q_eager, s_eager) = fused[first][name], fused[second][name]
            torch.testing.assert_close(s, s_eager, rtol=1e-6, atol=0)
            assert (q.view(torch.uint8) != q_eager.view(torch.uint8)).float().mean() < 1e-2
    engines[0].set_adapters([])
    after = state(engines[0])
    assert all(torch.equal(base[n][0], after[n][0]) and torch.equal(base[n][1], after[n][1]) for n in base)
    # a kernel call failing halfway through a swap leaves every float8 weight as it was
    failing = {"n": 0}

    def fail_fifth(*args):
        failing["n"] += 1
        if failing["n"] == 5:
            raise RuntimeError("injected")
        real(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(float8_weights, "requantize_into", fail_fifth)
        with pytest.raises(RuntimeError, match="injected"):
            engines[0].set_adapters([("f1", 0.5)])
    after = state(engines[0])
    assert all(torch.equal(base[n][0], after[n][0]) and torch.equal(base[n][1], after[n][1]) for n in base)


@pytest.mark.slow  # Triton's interpreter
def test_warm_up_compiles_the_variants_the_models_row_lengths_need(interpreted, float8, monkeypatch):
    """Triton specializes row lengths that are multiples of 16 (and 1): a model whose rows
    all are (every real one) warms three variants, one per class of rank, not six; a model
    with other row lengths (a 3x3 conv over 3 channels: 27) gets those variants too."""
    from torch import nn

    from loraswap.engine.swap import fused as swap

    assert interpreted.variants([3072, 12288, 64]) == [(32, 16), (32, 8), (32, 1)]
    assert interpreted.variants([320, 27, 1]) == [(32, 16), (32, 8), (32, 1), (24, 16), (24, 8), (24, 1),
                                                  (1, 16), (1, 8), (1, 1)]
    assert interpreted.variants([]) == []
    calls = []
    monkeypatch.setattr(swap, "warm_up", lambda device, dtype, lengths: calls.append((dtype, sorted(lengths))))
    model = nn.Sequential(nn.Linear(64, 32), nn.Conv2d(3, 16, 3), nn.Linear(32, 8).to(torch.bfloat16))
    swap.FusedSwapper({"unet": model}).warm_up_kernel()
    assert sorted(calls, key=str) == sorted([(torch.float32, [27, 64]), (torch.bfloat16, [32])], key=str)

    interpreted.warm_up(torch.device("cpu"), torch.float32, [27, 64])  # the real one runs its variants

    # float8 weights warm the re-quantization kernel with their own shapes
    from loraswap.engine.quantize.weights import quantize_module

    float8_calls = []
    monkeypatch.setattr(swap, "warm_up_float8", lambda device, per_tensor, shapes, dtype:
                        float8_calls.append((per_tensor, dtype, sorted(shapes))))
    calls.clear()
    quantized = nn.Sequential(nn.Linear(48, 32), nn.Linear(32, 16), nn.Linear(16, 8)).to(torch.bfloat16)
    quantize_module(quantized[:2], "fp8-weight-only")
    swap.FusedSwapper({"transformer": quantized}).warm_up_kernel()
    assert float8_calls == [(False, torch.bfloat16, [(16, 32), (32, 48)])]  # one scale per row
    # the real one runs every kind's variants, masked and (32 x 64: whole 16 x 64 tiles) not
    from loraswap.engine.kernels.float8_warm_up import warm_up_float8

    warm_up_float8(torch.device("cpu"), False, [(32, 64)])
    assert calls == [(torch.bfloat16, [16])]  # the layer left in bf16


def test_load_and_fuse_mode_does_not_warm_the_swap_kernels(monkeypatch):
    """The load-and-fuse baseline swaps through diffusers' load + fuse and never calls the
    kernels, so its start-up does not compile them (seconds of a cold start on a GPU)."""
    from loraswap.engine.config.engine import EngineConfig
    from loraswap.engine.engine import Engine
    from loraswap.engine.swap import fused as swap

    warmed = []
    monkeypatch.setattr(swap.FusedSwapper, "warm_up_kernel", lambda self: warmed.append(self))
    for mode in ("load-and-fuse", "fused"):
        Engine(EngineConfig(model="tiny-sd", compile=False, swap_mode=mode))
        assert len(warmed) == (mode == "fused")
