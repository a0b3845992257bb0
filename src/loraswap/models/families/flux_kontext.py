"""FLUX.1 Kontext: FLUX.1's edit model, FLUX.1 [dev]'s architecture and components.

The pipeline takes the image to edit through its own optional `image` (encoded by the
VAE and attended to beside the latents), so it is an edit family without image pipelines.
"""

from diffusers import FluxKontextPipeline
from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

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


def input_image_tokens(kwargs: dict) -> int:
    """The tokens the input image adds to the transformer's sequence (beside the output's):
    the pipeline sizes it to the preferred resolution nearest its aspect (unless a size was
    asked: `asked_size`), down to multiples of 16 pixels, and each token is 16 x 16 pixels."""
    image = kwargs.get("image")
    image = image[0] if isinstance(image, list) else image
    if image is None:
        return 0
    width, height = image.size
    if kwargs.get("_auto_resize", True):
        _, width, height = min((abs(width / height - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
    return (width // 16) * (height // 16)


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
    input_tokens=input_image_tokens,
)
