"""The engine's typed configuration and the shape of one generation request."""

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from loraswap.adapters.cache import CacheConfig
from loraswap.adapters.sources.downloads import default_download_dir
from loraswap.adapters.sources.local import AdapterSources
from loraswap.adapters.sources.remote import CIVITAI_API, RemoteSettings
from loraswap.adapters.store import make_remote, make_sources
from loraswap.engine.quantize.weights import QuantizeMode
from loraswap.engine.sizes import parse_size
from loraswap.flags import ADAPTERS, MODELS, SPEED, Flag

if TYPE_CHECKING:
    from loraswap.engine.parallel.ranks import Parallelism

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class EngineConfig(BaseModel):
    """How one base model is served. Fields marked with a `Flag` are settings of `loraswap serve`."""

    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Flag(MODELS, repeat="Repeat to host several base models: the first is the default.")] = (
        Field("tiny-sd", description="A preset (tiny-sd, tiny-sdxl, tiny-flux, ...), a real architecture with "
              "random weights (flux-dev-random, ...), a hub id or a local diffusers folder."))
    device: Annotated[Literal["auto", "cpu", "cuda"], Flag(MODELS)] = Field(
        "auto", description="auto (CUDA when present), cpu or cuda.")
    dtype: Annotated[Literal["auto", "float32", "float16", "bfloat16"], Flag(MODELS)] = Field(
        "auto", description="auto (bfloat16 on CUDA, float32 on CPU), float32, float16 or bfloat16.")
    warmup: Annotated[bool, Flag(MODELS)] = Field(
        True, description="Generate once at start-up, so that the first request finds the model compiled.")
    max_size: Annotated[str | None, Flag(MODELS)] = Field(
        None, description="The largest image the model makes, WIDTHxHEIGHT (either way round); "
        "a larger size asked is refused (400), a larger input image with no size asked is scaled down to fit "
        "(default: twice the model's native size a side, at least 128x128: the demo's 128x128, SDXL's 2048x2048).")
    adapters: Annotated[Path | None, Flag(ADAPTERS)] = Field(
        None, description="Folder of .safetensors adapters; an adapter's id is its path under it without the "
                          "suffix.")
    hub: Annotated[bool, Flag(ADAPTERS)] = Field(
        False, description="Also serve hub adapters (owner/name, or owner/name@revision); HF_HUB_OFFLINE=1 serves "
                           "them from the huggingface_hub cache alone.")
    hub_allow: Annotated[list[str], Flag(ADAPTERS)] = Field(
        default_factory=lambda: ["*"], description="fnmatch pattern of hub ids served.")
    hub_deny: Annotated[list[str], Flag(ADAPTERS)] = Field(
        default_factory=list, description="fnmatch pattern of hub ids refused (403).")
    hub_cache_dir: Annotated[Path | None, Flag(ADAPTERS)] = Field(
        None, description="huggingface_hub's cache folder (default: HF_HUB_CACHE).")
    swap_mode: Annotated[Literal["fused", "load-and-fuse", "hotswap"], Flag(ADAPTERS)] = Field(
        "fused", description="fused (loraswap's swap), or a benchmark baseline: load-and-fuse (diffusers' "
                             "load_lora_weights + fuse_lora per request, eager) or hotswap (diffusers + PEFT "
                             "hotswap, compiled).")
    hotswap_rank: Annotated[int, Flag(ADAPTERS)] = Field(
        128, ge=1, le=1024, description="With --swap-mode hotswap: the highest rank served (every adapter is padded "
                                        "to it).")
    url_allow: Annotated[list[str], Flag(ADAPTERS)] = Field(
        default_factory=list, description="A host adapters may be fetched from by URL: host or host:port, fnmatch; "
        "* is any public host (never a loopback, private or metadata address, unless named); plain http only from "
        "a host named. None given: URLs are refused.")
    civitai: Annotated[bool, Flag(ADAPTERS)] = Field(
        False, description="Serve Civitai adapters (civitai:MODEL@VERSION, or an AIR) through Civitai's API, "
                           "checked against the SHA256 it lists; a token from CIVITAI_TOKEN or "
                           "--civitai-token-file.")
    civitai_api: Annotated[str | None, Flag(ADAPTERS)] = Field(
        None, description="Civitai's API base, or a mirror's (default: https://civitai.com/api); turns --civitai "
                          "on.")
    civitai_token_file: Annotated[Path | None, Flag(ADAPTERS)] = Field(
        None, description="A file holding a Civitai API token (default: the CIVITAI_TOKEN variable).")
    s3: Annotated[bool, Flag(ADAPTERS)] = Field(
        False, description="Serve adapters from S3 buckets (s3://bucket/key), with the standard AWS settings "
                           "(AWS_* variables, profiles, instance roles).")
    s3_endpoint_url: Annotated[str | None, Flag(ADAPTERS)] = Field(
        None, description="An S3-compatible store's endpoint (MinIO, R2, ...); turns --s3 on.")
    download_dir: Annotated[Path | None, Flag(ADAPTERS)] = Field(
        None, description="Folder of the adapters fetched by URL or from Civitai, kept across restarts (default: "
                          "~/.cache/loraswap/downloads).")
    download_timeout_s: Annotated[float, Flag(ADAPTERS)] = Field(
        600.0, gt=0, description="Longest one download (URL, Civitai, S3) may take, s, however steadily its host "
                                 "sends: a host dripping bytes is cut off (502).")
    download_cache_gb: Annotated[float, Flag(ADAPTERS)] = Field(
        20.0, gt=0, description="Disk the downloads may take, GiB; the least recently used are dropped past it.")
    max_blend: Annotated[int, Flag(ADAPTERS)] = Field(
        4, ge=1, le=32, description="Most adapters blended in one request.")
    max_rank: Annotated[int, Flag(ADAPTERS)] = Field(1024, ge=1, description="Highest LoRA rank accepted.")
    max_adapter_mb: Annotated[float, Flag(ADAPTERS)] = Field(
        2048, gt=0, description="Largest adapter file, MiB.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Adapter cache budgets (host, GPU).")
    prefetch_threads: Annotated[int, Flag(ADAPTERS)] = Field(
        4, ge=1, le=64, description="Threads reading adapters ahead of the GPU.")
    source: object | None = Field(None, exclude=True, description="An adapter source object handed in by code "
                                  "(tests, hub); not a setting.")
    compile: Annotated[bool | None, Flag(SPEED)] = Field(
        None, description="Regional torch.compile of the denoiser (default: on CUDA).")
    ulysses_degree: Annotated[int, Flag(SPEED)] = Field(
        1, ge=1, le=64, description="Split each image's sequence over this many processes, one GPU each (Ulysses "
                                    "attention; FLUX.1 and Kontext, FLUX.2, Qwen-Image and Edit, Wan): N x "
                                    "--ring-degree processes in all, the first serving HTTP.")
    ring_degree: Annotated[int, Flag(SPEED)] = Field(
        1, ge=1, le=64, description="Split each image's sequence over this many processes with ring attention "
                                    "(times --ulysses-degree).")
    rank_wait_s: Annotated[float, Flag(SPEED)] = Field(
        120.0, gt=0, description="With several processes: how long one that has ended an image waits for the "
                                 "others to end it. Past it, one failed alone (a GPU out of memory) and left the "
                                 "others stuck: the server exits (code 70) for its supervisor to start it again.")
    cfg_parallel: Annotated[bool, Flag(SPEED)] = Field(
        False, description="Make the two passes of classifier-free guidance at once on two sets of processes "
                           "(Wan, Qwen-Image and Edit): twice the processes of --ulysses-degree x --ring-degree.")
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
    quantize: Annotated[QuantizeMode, Flag(SPEED)] = Field(
        "none", description="Denoiser weights in float8 (torchao): none, fp8 (weights and activations, row-wise "
                            "scales; CUDA 8.9+), fp8-tensorwise (one scale per tensor) or fp8-weight-only.")
    quantize_text_encoders: Annotated[Literal["none", "fp8-weight-only"], Flag(SPEED)] = Field(
        "none", description="Text encoders' weights in float8: none or fp8-weight-only (half their bf16 size; "
                            "the low-memory mode).")
    pristine: Annotated[Literal["device", "host"], Flag(SPEED)] = Field(
        "device", description="Where pristine copies of swapped weights live: device, or host (pinned RAM; the "
                              "low-memory mode).")
    max_gpu_memory_gb: Annotated[float | None, Flag(SPEED)] = Field(
        None, gt=0, description="Cap this process's GPU memory (a smaller card on a larger one).")
    step_cache: Annotated[str, Flag(SPEED)] = Field(
        "off", description="Skip the denoiser's blocks on steps a cache can stand in for, by default: off, "
                           "first-block[:threshold=T], taylorseer[:interval=N,order=K,warmup=W] or "
                           "magcache[:threshold=T,max_skip=N,retention=R] (transformer models only; a request's "
                           "step_cache overrides it).")
    step_cache_allow: Annotated[list[str], Flag(SPEED)] = Field(
        default_factory=lambda: ["first-block", "taylorseer"], description="A step cache method requests may "
        "ask for (besides off and --step-cache's); magcache is calibrated on the model at start-up.")
    step_cache_calibration: Annotated[Path | None, Flag(SPEED)] = Field(
        None, description="MagCache's ratios for this model (a JSON list, one per step) instead of measuring them "
                          "at start-up.")

    @field_validator("max_size")
    @classmethod
    def _a_size(cls, size: str | None) -> str | None:
        if size is not None:
            parse_size(size)
        return size

    @field_validator("attention")
    @classmethod
    def _known_backend(cls, name: str | None) -> str | None:
        from loraswap.engine.startup.attention import check_backend_name

        return check_backend_name(name)

    @field_validator("step_cache")
    @classmethod
    def _known_step_cache(cls, text: str) -> str:
        from loraswap.engine.step_cache import canonical

        return _or_value_error(canonical, text)

    @field_validator("step_cache_allow")
    @classmethod
    def _known_methods(cls, methods: list[str]) -> list[str]:
        from loraswap.engine.step_cache import METHODS

        unknown = [m for m in methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown step cache {', '.join(unknown)}: use {', '.join(METHODS)}")
        return methods

    @property
    def parallelism(self) -> "Parallelism":
        """How the engine's sequence is split over processes (`world` 1: it is not)."""
        from loraswap.engine.parallel.ranks import Parallelism

        return Parallelism(self.ulysses_degree, self.ring_degree, 2 if self.cfg_parallel else 1)

    @model_validator(mode="after")
    def _ring_merges_with_the_log_sum_exp(self):
        from loraswap.engine.parallel.ranks import check_ring_attention

        check_ring_attention(self.parallelism, self.attention)
        return self

    def adapter_sources(self) -> AdapterSources | None:
        """Where this model's adapters come from: `source` if given, else the folder, the hub,
        and files elsewhere (URLs, Civitai), each as its settings allow."""
        if self.source is not None:
            return self.source
        max_bytes = int(self.max_adapter_mb * 2**20)
        remote = make_remote(RemoteSettings(tuple(self.url_allow), self._civitai_api(), self._civitai_token(),
                                            self.s3 or self.s3_endpoint_url is not None, self.s3_endpoint_url,
                                            max_bytes, total_timeout=self.download_timeout_s),
                             self.download_dir or default_download_dir(), int(self.download_cache_gb * 2**30))
        return make_sources(self.adapters, self.hub, self.hub_cache_dir, self.hub_allow, self.hub_deny, max_bytes,
                            remote)

    def _civitai_api(self) -> str | None:
        return self.civitai_api or (CIVITAI_API if self.civitai else None)

    def _civitai_token(self) -> str | None:
        """The token: --civitai-token-file's first line, else CIVITAI_TOKEN (read at start-up)."""
        if self.civitai_token_file is not None:
            return self.civitai_token_file.read_text().strip().splitlines()[0].strip() or None
        return os.environ.get("CIVITAI_TOKEN") or None

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]


def _or_value_error(read, text: str):
    """`read(text)`, its BadRequest a ValueError (what a config's validator raises)."""
    from loraswap.errors import BadRequest

    try:
        return read(text)
    except BadRequest as e:
        raise ValueError(str(e)) from None
