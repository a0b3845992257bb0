"""Which weights are kept in float8."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraswap.flags import SPEED, Flag

QuantizeMode = Literal["none", "fp8", "fp8-tensorwise", "fp8-weight-only"]


class QuantizationConfig(BaseModel):
    """The denoiser's and the text encoders' weights in float8 (torchao), or as loaded."""

    model_config = ConfigDict(extra="forbid")

    quantize: Annotated[QuantizeMode, Flag(SPEED)] = Field(
        "none", description="Denoiser weights in float8 (torchao): none, fp8 (weights and activations, row-wise "
                            "scales; CUDA 8.9+), fp8-tensorwise (one scale per tensor) or fp8-weight-only.")
    quantize_text_encoders: Annotated[Literal["none", "fp8-weight-only"], Flag(SPEED)] = Field(
        "none", description="Text encoders' weights in float8: none or fp8-weight-only (half their bf16 size; "
                            "the low-memory mode).")
