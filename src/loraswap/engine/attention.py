"""Attention backend choice (`--attention`), through diffusers' attention dispatcher.

Models whose attention processors go through the dispatcher (FLUX) take any backend
it names (`set_attention_backend`). The UNets of SD 1.5 and SDXL call PyTorch's
scaled-dot-product attention directly; for them the `native` family is honoured by
choosing SDPA's kernel around each pipeline call (`torch.nn.attention.sdpa_kernel`),
and other backends are refused with the ones that apply.
"""

import contextlib
import logging

from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

logger = logging.getLogger(__name__)

SDPA_KERNELS = {"_native_cudnn": SDPBackend.CUDNN_ATTENTION, "_native_efficient": SDPBackend.EFFICIENT_ATTENTION,
                "_native_flash": SDPBackend.FLASH_ATTENTION, "_native_math": SDPBackend.MATH}


def backend_names() -> list[str]:
    from diffusers.models.attention_dispatch import AttentionBackendName

    return sorted(name.value for name in AttentionBackendName)


def check_backend_name(name: str | None) -> str | None:
    """`name` lower-cased if diffusers' dispatcher knows it, else a ValueError listing those it does."""
    if name is None:
        return None
    if name.lower() not in backend_names():
        raise ValueError(f"unknown attention backend '{name}'; diffusers' dispatcher has: {', '.join(backend_names())}")
    return name.lower()


def _uses_dispatcher(module: nn.Module) -> bool:
    return any(hasattr(getattr(m, "processor", None), "_attention_backend") for m in module.modules())


class AttentionBackend:
    """One backend set on a model's attention-bearing components; `context()` wraps each
    pipeline call (the SDPA kernel choice for components that call SDPA directly)."""

    def __init__(self, name: str, components: dict[str, nn.Module]):
        self.name = name
        direct = []
        for component_name, module in components.items():
            if not hasattr(module, "set_attention_backend"):
                continue  # text encoders (transformers models) keep their own attention
            if _uses_dispatcher(module):
                module.set_attention_backend(name)
            else:
                direct.append(component_name)
        self._sdpa = None
        if direct and name != "native":
            if name not in SDPA_KERNELS:
                raise ValueError(f"attention backend '{name}' does not apply to the {', '.join(direct)}: its "
                                 "attention calls PyTorch's SDPA directly; choose native or one of "
                                 f"{', '.join(sorted(SDPA_KERNELS))}")
            self._sdpa = SDPA_KERNELS[name]
        logger.info("attention backend %s%s", name, f" (SDPA kernel for the {', '.join(direct)})" if self._sdpa else "")

    def context(self):
        return sdpa_kernel(self._sdpa) if self._sdpa is not None else contextlib.nullcontext()
