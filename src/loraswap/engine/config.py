"""The engine's typed configuration and the shape of one generation request."""

from pathlib import Path
from typing import Literal

import torch
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..adapters.cache import CacheConfig
from ..adapters.source import AdapterSources
from ..adapters.store import make_sources
from .quantize import QuantizeMode

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class EngineConfig(BaseModel):
    """How one base model is served."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("tiny-sd", description="A preset (tiny-sd, tiny-flux, ...), a real architecture with random "
                       "weights (flux-dev-random, ...), a hub id or a local folder.")
    adapters: Path | None = Field(None, description="Folder of adapters; ids are paths under it without suffix.")
    hub: bool = Field(False, description="Serve hub adapters (owner/name[@revision]) through huggingface_hub.")
    hub_allow: list[str] = Field(default_factory=lambda: ["*"], description="fnmatch patterns of hub ids served.")
    hub_deny: list[str] = Field(default_factory=list, description="fnmatch patterns of hub ids refused (403).")
    hub_cache_dir: Path | None = Field(None, description="huggingface_hub cache folder (default: HF_HUB_CACHE).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto picks CUDA when present.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="auto: bf16 on CUDA, fp32 on CPU.")
    compile: bool | None = Field(None, description="Regional torch.compile of the denoiser; None: on for CUDA only.")
    compile_mode: Literal["default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune"] = Field(
        "default", description="torch.compile mode; the CUDA-graph modes compile the whole denoiser, not its blocks.")
    compile_vae: bool | None = Field(
        None, description="With compile on, also compile the VAE decoder; None: with the CUDA-graph compile "
                          "modes only (short requests, where the decode counts).")
    attention: str | None = Field(None, description="Attention backend of diffusers' dispatcher (None: its default).")
    quantize: QuantizeMode = Field(
        "none", description="Denoiser linear weights in float8 (torchao); fp8 and fp8-tensorwise also quantize "
                            "activations (CUDA), with scales per row or per tensor.")
    quantize_text_encoders: Literal["none", "fp8-weight-only"] = Field(
        "none", description="Text encoders' linear weights in float8 (half their bf16 size).")
    max_gpu_memory_gb: float | None = Field(
        None, gt=0, description="Cap on this process's GPU memory (a 24 GB card on a larger one).")
    compile_cache: Path | None = Field(None, description="Folder of torch.compile's caches, kept across restarts.")
    swap_mode: Literal["fused", "load-and-fuse", "hotswap"] = Field(
        "fused", description="fused: loraswap's swap; load-and-fuse: diffusers' load_lora_weights + fuse_lora per "
                             "request, eager; hotswap: diffusers + PEFT hotswap (the two baselines).")
    hotswap_rank: int = Field(128, ge=1, le=1024, description="--swap-mode hotswap: the highest rank served "
                                                               "(every adapter is padded to it).")
    pristine: Literal["device", "host"] = Field("device", description="Where pristine weight copies live.")
    max_adapter_mb: float = Field(2048, gt=0, description="Largest adapter file accepted, MiB.")
    max_rank: int = Field(1024, ge=1, description="Highest LoRA rank accepted.")
    max_blend: int = Field(4, ge=1, le=32, description="Most adapters blended in one request.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Adapter cache budgets (host, GPU).")
    prefetch_threads: int = Field(4, ge=1, le=64, description="Threads reading adapters ahead of the GPU worker.")
    source: object | None = Field(None, exclude=True, description="An adapter source object (tests, hub).")
    warmup: bool = Field(True, description="Generate once at start-up (compiles when compile is on).")
    compile_while_loading: bool = Field(
        False, description="A local diffusers folder with regional compile: build the modules, then compile a "
                           "stand-in for the denoiser (FLUX.1) on a thread while the weights are copied in.")

    @field_validator("attention")
    @classmethod
    def _known_backend(cls, name: str | None) -> str | None:
        from .attention import check_backend_name

        return check_backend_name(name)

    def adapter_sources(self) -> AdapterSources | None:
        """Where this model's adapters come from: `source` if given, else the folder and/or hub."""
        return self.source or make_sources(self.adapters, self.hub, self.hub_cache_dir, self.hub_allow,
                                           self.hub_deny, int(self.max_adapter_mb * 2**20))

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]


class GenerateRequest(BaseModel):
    """One image or video: prompt, sampling parameters, the adapters to blend (id, weight), and
    for image inputs the image (and the mask, white where to paint) already decoded and checked
    by the caller; for video models the number of frames."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    prompt: str
    negative_prompt: str | None = None
    steps: int | None = Field(None, ge=1, le=200)
    guidance: float | None = Field(None, ge=0, le=50)
    width: int | None = Field(None, ge=8, le=4096, multiple_of=8)
    height: int | None = Field(None, ge=8, le=4096, multiple_of=8)
    seed: int | None = Field(None, ge=0, lt=2**63)
    loras: list[tuple[str, float]] = Field(default_factory=list)
    image: Image.Image | None = None
    mask: Image.Image | None = None
    strength: float | None = Field(None, gt=0, le=1)
    frames: int | None = Field(None, ge=1, le=1000)
    output: Literal["image", "video"] | None = None  # what the API asked for (None: what the model makes)
    max_frames: int | None = Field(None, ge=1)  # the server's limit, held against the model's default too
