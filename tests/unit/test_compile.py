"""Swaps on a compiled model never recompile, and match the eager model."""

import pytest
import torch
import torch._dynamo
from support.numerics import image_array, rel_err

from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest
from loraswap.engine.startup.compile import graph_count

SPECS = [(4, "attn"), (64, "all"), (16, "attn"), (128, "all"), (8, "all"), (32, "attn")]


@pytest.mark.slow  # compiles
def test_twelve_swaps_of_mixed_ranks_and_targets_never_recompile(adapter_factory):
    root = adapter_factory.root / "compiled"
    for i, (rank, targets) in enumerate(SPECS):
        adapter_factory(f"c{i}", "tiny-flux", rank=rank, targets=targets, fmt="diffusers" if i % 2 else "kohya",
                        text_encoder=i == 3, alpha=6.0 * rank, seed=40 + i, folder=root)
    torch._dynamo.reset()
    compiled = Engine(EngineConfig(model="tiny-flux", adapters=root, compile=True, warmup=False))
    eager = Engine(EngineConfig(model="tiny-flux", adapters=root, compile=False, warmup=False))
    # warm-up: the first image compiles the repeated blocks
    compiled.set_adapters([])
    base = image_array(compiled.pipeline)
    graphs_after_warmup = graph_count()
    assert graphs_after_warmup > 0, "the denoiser blocks were compiled"
    compiled_at_warmup = compiled.recompiles  # (no warm-up at start: the first image above compiled)

    # torch's own patch: pytest's monkeypatch would delete the option on undo (it is not in the
    # config module's __dict__), and every later compile in the process would then fail
    sequence = [[(f"c{i % len(SPECS)}", 1.0)] for i in range(11)] + [[("c1", 0.6), ("c2", 0.5)]]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for loras in sequence:
            compiled.set_adapters(loras)
            eager.set_adapters(loras)
            ours, reference = image_array(compiled.pipeline), image_array(eager.pipeline)
            assert rel_err(ours, reference) <= 1e-4, loras
            assert rel_err(ours, base) >= 1e-3, "the compiled model sees the swapped weights"
    assert compiled.recompiles == compiled_at_warmup, "no swap added a graph"
    assert graph_count() == graphs_after_warmup


@pytest.mark.slow  # compiles
def test_a_flux_warm_up_compiles_one_graph_per_block_kind_and_layout():
    """The double block once, the single block once per input layout (contiguous after the
    double blocks, a slice after a single block: see engine/startup/compile.py); nothing else, and
    nothing more on a second image."""
    torch._dynamo.reset()
    before = graph_count()
    engine = Engine(EngineConfig(model="tiny-flux", compile=True))
    assert graph_count() - before == 3
    engine.generate(GenerateRequest(prompt="a second image", seed=1))
    assert engine.recompiles == 0
