"""FLUX.1 Kontext: FLUX.1's edit model, FLUX.1 [dev]'s architecture and components.

The pipeline takes the image to edit through its own optional `image` (encoded by the
VAE and attended to beside the latents), so it is an edit family without image pipelines.
"""

from diffusers import FluxKontextPipeline

from ..family import TINY_DEFAULTS, Architecture, Family
from .flux import FLUX_DEV_ARCHITECTURE, flux_dev_extras, tiny_flux_components


def _tiny_flux_kontext() -> FluxKontextPipeline:
    return FluxKontextPipeline(**tiny_flux_components())


def asked_size(kwargs: dict) -> dict:
    """A call that asks for a size gets it: Kontext otherwise makes a ~1 MP image whatever the
    size (its `max_area`) and first resizes the input to one of its preferred resolutions."""
    if "width" in kwargs and "height" in kwargs:
        return dict(kwargs, max_area=kwargs["width"] * kwargs["height"], _auto_resize=False)
    return kwargs


# Kontext [dev]'s scheduler and tokenizers are FLUX.1 [dev]'s (the pipeline always passes
# the scheduler a resolution-dependent `mu`)
FLUX_KONTEXT_ARCHITECTURE = Architecture(components=FLUX_DEV_ARCHITECTURE.components, extras=flux_dev_extras)

FAMILY = Family(
    name="flux-kontext",
    pipeline="FluxKontextPipeline",
    presets={"tiny-flux-kontext": _tiny_flux_kontext},
    architectures={"flux-kontext": FLUX_KONTEXT_ARCHITECTURE},
    image_input="edit",
    defaults=TINY_DEFAULTS,
    adjust_call=asked_size,
)
