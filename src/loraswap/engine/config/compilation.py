"""How the denoiser is made fast: torch.compile, its caches, and the attention backend."""

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from loraswap.flags import SPEED, Flag


def backend_names() -> list[str]:
    """The attention backends diffusers' dispatcher knows (imported here only when a name is checked)."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return sorted(name.value for name in AttentionBackendName)


def check_backend_name(name: str | None) -> str | None:
    """`name` lower-cased if diffusers' dispatcher knows it, else a ValueError listing those it does."""
    if name is None:
        return None
    if name.lower() not in backend_names():
        raise ValueError(f"unknown attention backend '{name}'; diffusers' dispatcher has: {', '.join(backend_names())}")
    return name.lower()


class CompilationConfig(BaseModel):
    """Whether and how the denoiser (and the VAE) is compiled, and which attention kernels it calls."""

    model_config = ConfigDict(extra="forbid")

    compile: Annotated[bool | None, Flag(SPEED)] = Field(
        None, description="Regional torch.compile of the denoiser (default: on CUDA).")
    compile_mode: Annotated[Literal["default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune"],
                            Flag(SPEED)] = Field(
        "default", description="torch.compile mode: default, max-autotune-no-cudagraphs, reduce-overhead or "
                               "max-autotune (CUDA graphs: the whole denoiser, not its blocks).")
    compile_vae: Annotated[bool | None, Flag(SPEED)] = Field(
        None, description="With compile on, also compile the VAE decoder: a faster decode, a longer start-up "
                          "(default: with the CUDA-graph compile modes only, where the decode counts).")
    compile_while_loading: Annotated[bool, Flag(SPEED)] = Field(
        False, description="A local diffusers folder with regional compile: compile a stand-in for the denoiser "
                           "(FLUX.1) on a thread while the weights are copied in (experimental).")
    compile_cache: Annotated[Path | None, Flag(SPEED)] = Field(
        None, description="Folder for torch.compile's caches, kept across restarts: a restarted process compiles "
                          "from it.")
    attention: Annotated[str | None, Flag(SPEED)] = Field(
        None, description="Attention backend of diffusers' dispatcher (native, _native_cudnn, _native_flash, "
                          "flex, ...; default: diffusers').")

    @field_validator("attention")
    @classmethod
    def _known_backend(cls, name: str | None) -> str | None:
        return check_backend_name(name)
