"""The one-pass swap kernel, run by Triton's interpreter on CPU tensors.

On a GPU the same kernel is compiled; `scripts/gpu_smoke.py` checks it there against
`addmm` in bf16. Here the interpreter checks the indexing, masking and blending."""

import pytest
import torch

from helpers import assert_bitwise_equal, weights_snapshot

pytest.importorskip("triton", reason="the test extra pins triton for the CPU interpreter")


@pytest.fixture(scope="module")
def interpreted():
    """The kernel built once for Triton's CPU interpreter (and rebuilt normally afterwards)."""
    from loraswap.engine import kernels

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        kernels._kernel.cache_clear()
        yield kernels
    kernels._kernel.cache_clear()


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
    from loraswap.engine.config import EngineConfig
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
    assert all(runs for _, _, runs in engines[0].swapper._views.values())
    changed = [k for k in base if not torch.equal(base[k], results[0][k])]
    assert len(changed) > 20
    for key in changed:  # fp32 weights: the kernel and addmm agree to float rounding
        torch.testing.assert_close(results[0][key], results[1][key], rtol=1e-5, atol=1e-6)
    engines[0].set_adapters([("k2", 1.0)])
    engines[0].set_adapters([])
    assert_bitwise_equal(base, engines[0].components)
