"""The model families loraswap serves, one module each (see `..family.Family`).

Adding a family: write its module (tiny preset, real architecture, image pipelines,
output) and list it here; the presets, architectures and image inputs follow from the
record.
"""

from diffusers import DiffusionPipeline

from loraswap.models.families import (
    demo,
    demo_flux,
    flux,
    flux2,
    flux_kontext,
    qwen_image,
    qwen_image_edit,
    sd3,
    sd15,
    sdxl,
    wan,
    z_image,
)
from loraswap.models.family import Architecture, Family

# `demo` after `sd15` and `demo_flux` after `flux`: each pair share a pipeline class, and
# `family_of` takes the first (a demo preset's own record comes through `family_for`)
FAMILIES: tuple[Family, ...] = tuple(module.FAMILY for module in (
    sd15, demo, sdxl, sd3, flux, demo_flux, flux_kontext, flux2, qwen_image, qwen_image_edit, z_image, wan))

# tiny preset name -> its family; real architecture name -> its family
PRESET_FAMILIES = {preset: family for family in FAMILIES for preset in family.presets}
ARCHITECTURE_FAMILIES = {name: family for family in FAMILIES for name in family.architectures}


def architecture(name: str) -> Architecture:
    return ARCHITECTURE_FAMILIES[name].architectures[name]


def family_for(name_or_path: str, pipeline: DiffusionPipeline) -> Family | None:
    """The record that serves `pipeline`, loaded as `name_or_path`: a preset's own (its
    defaults and call), else the family its pipeline class is one of."""
    return PRESET_FAMILIES.get(name_or_path) or family_of(pipeline)


def family_of(pipeline: DiffusionPipeline) -> Family | None:
    """The family whose pipelines `pipeline` is one of (None: a pipeline no family lists)."""
    name = type(pipeline).__name__
    return next((f for f in FAMILIES if name == f.pipeline or name in f.image_pipelines.values()), None)
