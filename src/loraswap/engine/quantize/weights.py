"""`--quantize` and `--quantize-text-encoders`: linear weights in float8, through torchao.

`fp8`: float8 weights and dynamically quantized activations, row-wise scales (float8
matmuls; CUDA compute capability 8.9 or later), the output projections' activations scaled
in one pass by `float8_activations`. `fp8-tensorwise`: the same with one scale per tensor
(cheaper scaling, coarser). `fp8-weight-only`: float8 weights de-quantized in
the matmul (half the weight memory, any device). Either way the fused swap re-quantizes a
touched weight from its pristine float8 copy (`swap.Fp8Weight`).
"""

import logging
from typing import get_args

from torch import nn

from loraswap.engine.config.quantization import QuantizeMode
from loraswap.engine.quantize.float8_activations import use_float8_rows

logger = logging.getLogger(__name__)


TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


def quantize_text_encoders(pipeline, mode: str, device=None) -> None:
    """`--quantize-text-encoders`: the text encoders' linear weights (T5-XXL's, say) in
    float8, half their bf16 size, as the low-memory mode wants."""
    for name in TEXT_ENCODERS:
        encoder = getattr(pipeline, name, None)
        if encoder is not None:
            quantize_module(encoder, mode, device)


MODES: tuple[str, ...] = get_args(QuantizeMode)


def check_mode(mode: str) -> str:
    """`mode` if it is a `--quantize` mode, else a ValueError naming them."""
    if mode not in MODES:
        raise ValueError(f"unknown quantization '{mode}'; choose one of {', '.join(MODES)}")
    return mode


def float8_config(mode: str):
    """torchao's configuration for a `--quantize` mode other than `none`."""
    try:
        from torchao.quantization import (
            Float8DynamicActivationFloat8WeightConfig,
            Float8WeightOnlyConfig,
            PerRow,
            PerTensor,
        )
    except ImportError:
        raise ValueError("--quantize needs torchao: pip install 'loraswap[fp8]'") from None
    # set_inductor_config=False: torchao would otherwise switch on Inductor's coordinate-descent
    # tuning for the whole process, which added minutes to FLUX.1's first compile and to
    # every restart on a warm compile cache (its results are not reused;
    # bench/results/runs/2026-12-03-startup-flux-fp8-h200.md)
    if mode in ("fp8", "fp8-tensorwise"):
        granularity = PerRow() if mode == "fp8" else PerTensor()
        return Float8DynamicActivationFloat8WeightConfig(granularity=granularity, set_inductor_config=False)
    if check_mode(mode) == "fp8-weight-only":
        return Float8WeightOnlyConfig(set_inductor_config=False)
    raise ValueError("--quantize none has no float8 configuration")


def quantize_module(module: nn.Module, mode: str, device=None) -> None:
    """Every linear layer of `module` in float8 (a mode of `MODES`), each moved to `device`
    as it is quantized; `none`: as it is."""
    if mode == "none":
        return
    config = float8_config(mode)
    from torchao.quantization import quantize_

    try:
        quantize_(module, config, device=device)
    except AssertionError as e:  # torchao's hardware check
        raise ValueError(f"--quantize {mode} cannot run here ({e}); use fp8-weight-only") from None
    if mode == "fp8":
        use_float8_rows(module)
    logger.info("%s quantized: %s", type(module).__name__, mode)
