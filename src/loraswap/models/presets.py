"""Built-in tiny presets: the real diffusers pipeline classes with tiny configs.

Each family module (`families/`) says how to build its presets; weights come from a
fixed seed and the tokenizers are made in code, so every call returns the same pipeline
without any download. They exist for tests and for the demo server: their images are
noise, but every code path (text encoders, UNet or transformer, VAE, scheduler, LoRA
layouts) is the real one.
"""

import torch
from diffusers import DiffusionPipeline

from loraswap.models.families import PRESET_FAMILIES

SEED = 0

PRESETS = tuple(PRESET_FAMILIES)


def build_preset(name: str) -> DiffusionPipeline:
    """Build preset `name` with the same weights on every call (seeded)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        pipeline = PRESET_FAMILIES[name].presets[name]()
    for component in pipeline.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval().requires_grad_(False)
    pipeline.set_progress_bar_config(disable=True)
    pipeline.register_to_config(_name_or_path=name)
    return pipeline
