"""Attention backend choice (`--attention`), through diffusers' attention dispatcher. The
name is checked against the dispatcher's when the config is built (`config/compilation.py`).

Models whose attention processors go through the dispatcher (FLUX) take any backend
it names (`set_attention_backend`). The UNets of SD 1.5 and SDXL call PyTorch's
scaled-dot-product attention directly; for them the `native` family is honoured by
choosing SDPA's kernel around each pipeline call (`torch.nn.attention.sdpa_kernel`, with
fallbacks for attention the kernel cannot run), and other backends are refused with the
ones that apply. That choice is made outside compiled graphs, which do not re-check it:
it is part of the compile cache key (`engine.py`), and a process runs one choice per
denoiser class (two UNet models with different choices in one process share compiled
blocks).
"""

import contextlib
import logging
import threading

from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

logger = logging.getLogger(__name__)

SDPA_KERNELS = {"_native_cudnn": SDPBackend.CUDNN_ATTENTION, "_native_efficient": SDPBackend.EFFICIENT_ATTENTION,
                "_native_flash": SDPBackend.FLASH_ATTENTION, "_native_math": SDPBackend.MATH}


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

    # PyTorch's SDPA kernel flags belong to the process, not the thread: engines that force a
    # kernel take turns, so one engine's exit cannot switch another's kernel mid-image
    _sdpa_lock = threading.Lock()

    @contextlib.contextmanager
    def context(self):
        if self._sdpa is None:
            yield
            return
        # the chosen kernel first; attention it cannot run (the VAE's 512-wide head, fp32)
        # falls back to the memory-efficient kernel, then to math, rather than failing
        order = list(dict.fromkeys([self._sdpa, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]))
        with self._sdpa_lock, sdpa_kernel(order, set_priority=True):
            yield
