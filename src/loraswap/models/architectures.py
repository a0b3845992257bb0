"""The real architectures of the families (`families/`), built from their configs.

No weights are downloaded: `build_architecture_component` puts the modules on the meta
device (for key layouts and tensor shapes, e.g. `adapters make-random`) or fills them with
random weights on a real device (for benchmarks: same compute, same memory).
"""

import contextlib

import torch
from accelerate import init_empty_weights
from transformers import PretrainedConfig

from loraswap.models.families import ARCHITECTURE_FAMILIES, architecture

ARCHITECTURES = tuple(ARCHITECTURE_FAMILIES)  # the real architectures' names (`sd15`, `sdxl`, `flux-dev`, ...)


def build_architecture_component(name: str, component: str, device: str | torch.device = "meta",
                          dtype: torch.dtype = torch.bfloat16, init_device: str | torch.device | None = None
                          ) -> torch.nn.Module:
    """One component of a real architecture: on `meta` (no memory), or random on a device.

    With `init_device` (a GPU, say, for a component wanted in host RAM) the random values
    are drawn there, one tensor at a time, and copied to `device`: a GPU draws FLUX's
    transformer orders of magnitude faster than the CPU does. Only the parameters start on
    meta: the tensors a constructor computes (Wan's rotary buffers, Qwen-Image's rotary
    tables, a plain attribute) are made on `device` as a normal build makes them.
    """
    device, init_device = torch.device(device), torch.device(init_device or device)
    if init_device != device and device.type != "meta":
        with init_empty_weights(include_buffers=False):
            module = build_architecture_component(name, component, device, dtype)
        return materialize_random(module, device, init_device)
    cls, config = architecture(name).components[component]
    with torch.device(device):
        module = cls(config) if isinstance(config, PretrainedConfig) else cls(**config)
    return module.to(dtype).eval().requires_grad_(False)


@torch.no_grad()
def materialize_random(module: torch.nn.Module, device: torch.device, init_device: torch.device) -> torch.nn.Module:
    """`module`'s parameters (on meta) given random values on `device`, drawn on `init_device`.

    The values follow PyTorch's defaults for linear and convolution layers (uniform in
    +-1/sqrt(fan_in)); 1-d weights (norm scales) are ones, biases zeros. Tied parameters
    stay tied.
    """
    made: dict[int, torch.nn.Parameter] = {}  # meta parameter -> its real one (ties kept)
    for name, parameter in list(module.named_parameters(remove_duplicate=False)):
        if id(parameter) not in made:
            if parameter.dim() >= 2:
                bound = parameter[0].numel() ** -0.5  # fan_in
                value = torch.empty(parameter.shape, dtype=parameter.dtype, device=init_device).uniform_(-bound, bound)
            else:
                fill = 0.0 if name.endswith("bias") else 1.0
                value = torch.full(parameter.shape, fill, dtype=parameter.dtype, device=init_device)
            made[id(parameter)] = torch.nn.Parameter(value.to(device), requires_grad=False)
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner), leaf, made[id(parameter)])
    return module.eval().requires_grad_(False)


RANDOM_SUFFIX = "-random"


@contextlib.contextmanager
def default_dtype_set_to(dtype: torch.dtype):
    """torch's process-wide default dtype set to `dtype` for the block, and put back after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_architecture_pipeline(name: str, device: str | torch.device, dtype: torch.dtype,
                         init_device: str | torch.device | None = None):
    """The full pipeline of a real architecture with random weights (`<name>-random` models).

    Same compute and memory as the real model; tokenizers are made in code, so prompts
    tokenize without a download (their ids differ from the real vocabularies'). A pipeline
    wanted on the CPU (to be quantized onto a GPU, say) draws its values on `init_device`.
    """
    with default_dtype_set_to(dtype):  # initialise straight in the serving dtype
        components = {component: build_architecture_component(name, component, device=device, dtype=dtype,
                                                       init_device=init_device)
                      for component in architecture(name).components}
    pipeline = ARCHITECTURE_FAMILIES[name].pipeline_class(**components, **architecture(name).extras())
    pipeline.set_progress_bar_config(disable=True)
    pipeline.register_to_config(_name_or_path=name + RANDOM_SUFFIX)
    return pipeline
