"""Building the pipelines that loraswap serves: tiny presets, real models, and real
architectures with random weights (`<architecture>-random`)."""

from functools import cache
from pathlib import Path

import torch
from diffusers import DiffusionPipeline

from loraswap.models.architectures import ARCHITECTURES, RANDOM_SUFFIX, build_architecture_pipeline
from loraswap.models.families import ARCHITECTURE_FAMILIES, PRESET_FAMILIES, architecture, family_for, family_of
from loraswap.models.family import Family
from loraswap.models.presets import PRESETS, build_preset

__all__ = ["ARCHITECTURES", "PRESETS", "Family", "adapter_targets", "architecture_denoiser", "default_dtype",
           "denoiser_names", "family_for", "family_of", "generation_defaults", "load_pipeline", "lora_components",
           "model_name", "resolve_device"]


def resolve_device(device: str | None = None) -> torch.device:
    """`auto`/None picks CUDA when present, else the CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_pipeline(name_or_path: str, device: str | torch.device | None = None,
                  dtype: torch.dtype | None = None) -> DiffusionPipeline:
    """The plain diffusers pipeline that `--model name_or_path` serves.

    A preset (`tiny-sd`, `tiny-flux`, ... : `PRESETS`) is built in code with the same
    weights every time; `<architecture>-random` (`sdxl-random`, `flux-dev-random`, ... :
    `ARCHITECTURES`) is a real architecture with random weights (for benchmarks); anything else goes to
    `DiffusionPipeline.from_pretrained`
    (a hub id, honouring the hub cache and HF_HUB_OFFLINE, or a local folder).
    """
    device = resolve_device(str(device) if device is not None else None)
    dtype = dtype or default_dtype(device)
    if name_or_path in PRESETS:
        pipeline = build_preset(name_or_path)
    elif name_or_path.removesuffix(RANDOM_SUFFIX) in ARCHITECTURES and name_or_path.endswith(RANDOM_SUFFIX):
        # a random model wanted in host RAM (to be quantized onto the GPU) draws its values there
        init_device = "cuda" if device.type == "cpu" and torch.cuda.is_available() else None
        return build_architecture_pipeline(name_or_path.removesuffix(RANDOM_SUFFIX), device, dtype, init_device)
    else:
        pipeline = DiffusionPipeline.from_pretrained(name_or_path, torch_dtype=dtype)
        pipeline.set_progress_bar_config(disable=True)
        for component in pipeline.components.values():  # served, never trained (as the presets are)
            if isinstance(component, torch.nn.Module):
                component.eval().requires_grad_(False)
    pipeline.to(device=device)
    if pipeline.dtype != dtype:
        pipeline.to(dtype=dtype)
    return pipeline


DENOISERS = ("unet", "transformer", "transformer_2")  # transformer_2: Wan 2.2's low-noise expert


def denoiser_names(pipeline: DiffusionPipeline) -> list[str]:
    """The pipeline's denoisers: "unet" (SD, SDXL) or "transformer", and Wan 2.2's "transformer_2"."""
    return [name for name in DENOISERS if getattr(pipeline, name, None) is not None]


def denoiser_name(pipeline: DiffusionPipeline) -> str:
    """The pipeline's first denoiser ("unet" or "transformer")."""
    return denoiser_names(pipeline)[0]


def architecture_denoiser(name: str) -> str:
    """A real architecture's first denoiser ("unet" or "transformer")."""
    return next(n for n in DENOISERS if n in architecture(name).components)


def generation_defaults(name_or_path: str) -> dict[str, float]:
    """width/height/steps (and frames, guidance) used when a request gives none; empty: the pipeline's own."""
    return dict(PRESET_FAMILIES[name_or_path].defaults) if name_or_path in PRESETS else {}


def model_name(pipeline: DiffusionPipeline, name_or_path: str) -> str:
    """The served model's name: preset name, hub id, or the folder's `_name_or_path`."""
    if name_or_path in PRESETS or not Path(name_or_path).exists():
        return name_or_path
    return pipeline.config.get("_name_or_path") or name_or_path


def lora_components(name_or_path: str) -> tuple[type[DiffusionPipeline], dict[str, torch.nn.Module]]:
    """(pipeline class, LoRA-loadable components) of a preset, a real architecture or a model.

    Real architectures (`sd15`, `sdxl`, `flux-dev`, ...) are built on the meta device: their
    layer names and tensor shapes, without memory. Anything else is loaded on the CPU.
    """
    name_or_path = name_or_path.removesuffix(RANDOM_SUFFIX)
    if name_or_path in ARCHITECTURES:
        return _architecture_components(name_or_path)
    pipeline = build_preset(name_or_path) if name_or_path in PRESETS else load_pipeline(name_or_path, device="cpu")
    return type(pipeline), adapter_targets(pipeline)


@cache
def _architecture_components(name: str) -> tuple[type[DiffusionPipeline], dict[str, torch.nn.Module]]:
    """A real architecture's components on the meta device (built once: they hold no memory)."""
    from loraswap.models.architectures import build_architecture_component

    cls = ARCHITECTURE_FAMILIES[name].pipeline_class
    names = [n for n in adapter_target_names(cls) if n in architecture(name).components]
    return cls, {n: build_architecture_component(name, n) for n in names}


def adapter_target_names(pipeline_cls) -> list[str]:
    """The components adapters may change: diffusers' LoRA-loadable ones, and every text
    encoder (FLUX.1 files carry T5 keys, which diffusers' loader drops)."""
    names = list(pipeline_cls._lora_loadable_modules)
    return names + [n for n in ("text_encoder", "text_encoder_2", "text_encoder_3") if n not in names]


def adapter_targets(pipeline) -> dict[str, torch.nn.Module]:
    """Name -> module of each component of `pipeline` adapters may change."""
    return {n: getattr(pipeline, n) for n in adapter_target_names(type(pipeline))
            if isinstance(getattr(pipeline, n, None), torch.nn.Module)}
