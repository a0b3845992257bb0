"""FLUX.1 Kontext: FLUX.1's edit model, FLUX.1 [dev]'s architecture and components.

The pipeline takes the image to edit through its own optional `image` (encoded by the
VAE and attended to beside the latents), so it is an edit family without image pipelines.
"""

from diffusers import FluxKontextPipeline
from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

from loraswap.models.families.flux import FLUX_DEV_ARCHITECTURE, flux_dev_extras, tiny_flux_components
from loraswap.models.family import TINY_DEFAULTS, Architecture, Family


def _tiny_flux_kontext() -> FluxKontextPipeline:
    return FluxKontextPipeline(**tiny_flux_components())


def asked_size(kwargs: dict) -> dict:
    """A call that asks for a size gets it: Kontext otherwise makes a ~1 MP image whatever the
    size (its `max_area`) and first resizes the input to one of its preferred resolutions."""
    if "width" in kwargs and "height" in kwargs:
        return dict(kwargs, max_area=kwargs["width"] * kwargs["height"], _auto_resize=False)
    return kwargs


def edit_tokens(kwargs: dict, patch: int) -> int:
    """The transformer's sequence for a call with an input image: the output's tokens (the asked
    size, else its 1024 x 1024) and the input's. The pipeline cuts the input down
    to multiples of `patch` pixels (a token each), first to the preferred resolution nearest
    its aspect unless a size was asked (`asked_size`)."""
    image = kwargs["image"]
    width, height = (image[0] if isinstance(image, list) else image).size
    width, height = width - width % patch, height - height % patch
    if kwargs.get("_auto_resize", True):
        _, width, height = min((abs(width / height - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
    output = (kwargs.get("width") or 1024) // patch * ((kwargs.get("height") or 1024) // patch)
    return output + (width // patch) * (height // patch)


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
    edit_tokens=edit_tokens,
)
