"""Which model an adapter file is for, as a server routes it (`server/routing.py`), found
among the models loraswap knows without a download: the presets and the real architectures.

1. A declared base model (metadata, model card, adapter_config.json) that is one of them is
   the answer. One that is not (a hub id) names the family by its words (`family_hint`).
2. Else the family the trainers' metadata names (`family_hint`).
3. The first known model, of that family first, whose layers the adapter's keys and shapes
   fit, is the model the file is described against.
"""

import functools
from dataclasses import dataclass

from loraswap.errors import AdapterError

UNLIMITED_BYTES = 2**40  # a large file is one to inspect, not to refuse


@dataclass(frozen=True)
class Route:
    model: str | None  # the known model it is described against; None: it fits none of them
    family: str | None
    reason: str  # how the family was found, in words


def known_models() -> dict[str, str]:
    """{model name as --model takes it: family name}: the presets, then `<architecture>-random`."""
    from loraswap.models.architectures import RANDOM_SUFFIX
    from loraswap.models.families import ARCHITECTURE_FAMILIES, PRESET_FAMILIES

    return {**{name: family.name for name, family in PRESET_FAMILIES.items()},
            **{name + RANDOM_SUFFIX: family.name for name, family in ARCHITECTURE_FAMILIES.items()}}


@functools.cache  # one command looks at a model more than once (where it fits, then what it does there)
def target_model(model: str, name: str | None = None):
    """What the store checks an adapter against for `model` (named `name`, default `model`)."""
    from loraswap.adapters.bound import ModelLayers
    from loraswap.adapters.store import TargetModel
    from loraswap.models import lora_components

    pipeline_cls, components = lora_components(model)
    unet = components.get("unet")
    return TargetModel(name or model, pipeline_cls, ModelLayers(components), None, unet.config if unet else None)


def what_it_says(location) -> tuple[list[str], str | None]:
    """The base models the adapter declares, and the family its metadata or source names
    (read from its header and side files, as routing reads them)."""
    from loraswap.adapters.files.formats import open_checked
    from loraswap.adapters.files.metadata import declared_base_models, family_hint

    file = open_checked(location.weights, location.adapter_id, UNLIMITED_BYTES)
    file.close()
    return declared_base_models(file.metadata, location.folder), family_hint(file.metadata, location.source_says)


def route(location) -> Route:
    """The known model (and family) a server would send the adapter to; a file's own defect
    (not safetensors, no adapter keys) is raised as it is."""
    from loraswap.adapters.files.metadata import family_hint

    models = known_models()
    declared, hint = what_it_says(location)
    named = [d for d in declared if d in models]
    if named:
        return Route(named[0], models[named[0]], f"it declares {named[0]} as its base model")
    if declared:
        family, reason = family_hint({}, declared[0]), f"it declares {declared[0]} as its base model"
    else:
        family, reason = hint, "its metadata names the family"
    candidates = sorted(models, key=lambda name: models[name] != family)  # its family's first
    # a declared base model loraswap does not know: the candidates stand in for it, layers only
    fitting = next((m for m in candidates if fits(location, m, declared[0] if declared else None)), None)
    if fitting is not None and family is None:
        return Route(fitting, models[fitting], f"its layers fit {fitting}")
    return Route(fitting, family, reason if family else "it names no base model or family, and its layers fit "
                 "none of loraswap's presets and architectures")


def fits(location, model: str, name: str | None = None) -> bool:
    """Whether the adapter's keys and shapes fit `model`'s layers (checked as if `model` were named `name`)."""
    from loraswap.adapters.store import StoreLimits, check_fit, has_own_defect

    try:
        check_fit(location, target_model(model, name), StoreLimits(max_adapter_bytes=UNLIMITED_BYTES, max_rank=2**31))
    except AdapterError:
        if has_own_defect(location, UNLIMITED_BYTES):  # refused whatever the model: said as it is
            raise
        return False
    return True
