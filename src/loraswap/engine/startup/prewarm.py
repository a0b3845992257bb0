"""Compiling while the model loads: a start's compile work beside its weight copy.

With regional compile (the compile modes without CUDA graphs), torch.compile traces each
kind of repeated block once per input layout, and every block of that kind runs the same
compiled code. So a stand-in for the denoiser (its class and config with a few blocks,
random weights, quantized as the real one will be) compiles the graphs the real model
needs, or on a warm compile cache loads them, and Triton compiles or loads the swap
kernels for the same row lengths. `Prewarm` runs the stand-in on a thread while the main
thread copies the weights in (`models/staged.py`); the real model's warm-up image then
finds its blocks compiled and the kernels ready.

The thread must not overlap `from_pretrained`: dynamo writes back the process's default
dtype and random state after every frame it traces, and diffusers' and transformers'
loaders change the default dtype while they build each model. So the stand-in is built
and quantized before the thread starts, and the engine starts it only beside
`fill_pipeline`, which copies tensors and changes nothing process-wide.

Only denoisers whose block inputs are known here have a stand-in (FLUX.1). A stand-in
that fails costs a warning: the warm-up compiles what it missed.
"""

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from loraswap.engine.quantize.weights import quantize_module
from loraswap.engine.startup.attention import AttentionBackend
from loraswap.engine.startup.compile import compile_denoiser
from loraswap.engine.swap.fused import FusedSwapper
from loraswap.models.architectures import default_dtype_set_to

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StandIn:
    layers: dict[str, int]  # config keys set to build a few blocks, one per kind and input layout
    inputs: Callable[[dict, int, int, torch.device, torch.dtype], dict]  # (config, width, height, ...) -> kwargs
    default_size: int  # the pipeline's width and height when a request gives none


def _flux_inputs(config: dict, width: int, height: int, device: torch.device, dtype: torch.dtype) -> dict:
    """FluxPipeline's transformer call for one image: packed latents (2x2 patches of the
    8x-downsampled image), 512 T5 tokens (its default max_sequence_length), and the empty
    joint_attention_kwargs it passes (the blocks' guards tell None from {})."""
    tokens, text = (height // 16) * (width // 16), 512
    guidance = torch.full([1], 3.5, device=device) if config.get("guidance_embeds") else None
    return dict(hidden_states=torch.randn(1, tokens, config["in_channels"], device=device, dtype=dtype),
                encoder_hidden_states=torch.randn(1, text, config["joint_attention_dim"], device=device, dtype=dtype),
                pooled_projections=torch.randn(1, config["pooled_projection_dim"], device=device, dtype=dtype),
                timestep=torch.full([1], 0.5, device=device, dtype=dtype), guidance=guidance,
                img_ids=torch.zeros(tokens, 3, device=device, dtype=dtype),
                txt_ids=torch.zeros(text, 3, device=device, dtype=dtype), joint_attention_kwargs={},
                return_dict=False)


# two single blocks: the first takes the double blocks' contiguous output, the others a view
# of the previous single block's (a second graph, for its strides)
STAND_INS = {"FluxTransformer2DModel": StandIn({"num_layers": 1, "num_single_layers": 2}, _flux_inputs, 1024)}


def denoiser_config(folder: str) -> tuple[type[nn.Module], dict] | None:
    """The class and config of a diffusers folder's denoiser, read without its weights;
    None when the folder has none that diffusers names."""
    import diffusers

    index = diffusers.DiffusionPipeline.load_config(folder)
    for name in ("transformer", "unet"):
        entry = index.get(name)
        if isinstance(entry, (list, tuple)) and entry[0] == "diffusers" and hasattr(diffusers, entry[1] or ""):
            cls = getattr(diffusers, entry[1])
            return cls, dict(cls.load_config(folder, subfolder=name))
    return None


class Prewarm:
    """The stand-in's compile and the swap kernels' warm-up, on a thread started at once;
    `join()` waits for it and says what it did (never raises: the warm-up covers a miss)."""

    def __init__(self, denoiser: tuple[type[nn.Module], dict], *, device: torch.device, dtype: torch.dtype,
                 quantize: str, compile_mode: str, attention: str | None):
        cls, config = denoiser
        if device.type == "cuda" and device.index is None:  # a new thread starts on device 0: name ours
            device = torch.device("cuda", torch.cuda.current_device())
        stand_in = STAND_INS[cls.__name__]
        # built and quantized here, before the thread starts (building sets the default dtype),
        # without gradients as loaded pipelines are: the blocks' guards check requires_grad
        with default_dtype_set_to(dtype), torch.device(device):
            model = cls.from_config({**config, **stand_in.layers}).eval().requires_grad_(False)
        quantize_module(model, quantize, device)
        size = stand_in.default_size  # the warm-up image's: the pipeline's default
        inputs = stand_in.inputs(dict(model.config), size, size, device, dtype)
        plain = nn.Linear(16, 16, device=device, dtype=dtype)  # full-precision weights' swap kernels
        self._args = (model, plain, inputs, device, compile_mode, attention)
        self.seconds: float | None = None  # how long the thread took, once it has finished without error
        self.error: str | None = None  # what went wrong (not the exception: its frames hold the stand-in)
        self._thread = threading.Thread(target=self._run, name="loraswap-prewarm", daemon=True)
        self._thread.start()

    @staticmethod
    def applies(denoiser: tuple[type[nn.Module], dict] | None) -> bool:
        return denoiser is not None and denoiser[0].__name__ in STAND_INS

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            self._warm(*self._args)
            self.seconds = time.perf_counter() - started
        except BaseException as e:  # noqa: BLE001 - reported by join(); the warm-up compiles instead
            self.error = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            self._args = ()  # the stand-in's memory goes back

    @staticmethod
    def _warm(model, plain, inputs, device, compile_mode, attention) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = AttentionBackend(attention, {"denoiser": model}) if attention else None
        compile_denoiser(model, compile_mode)
        with torch.inference_mode(), backend.context() if backend else contextlib.nullcontext():
            model(**inputs)
        # the swap kernels for the denoiser's row lengths (in its dtype, or float8) and for
        # full-precision weights (the text encoders' when the denoiser is quantized)
        FusedSwapper({"denoiser": model, "plain": plain}).warm_up_kernel()

    def join(self) -> float | None:
        """Wait for the thread; the seconds it took, or None when it failed (logged)."""
        self._thread.join()
        if self.error is not None:
            logger.warning("compiling while loading failed (%s); the warm-up compiles instead", self.error)
            return None
        logger.info("compiled while loading: the stand-in's blocks and the swap kernels in %.1f s", self.seconds)
        return self.seconds
