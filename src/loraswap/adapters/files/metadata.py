"""What an adapter says about itself: the base model it was made for, or its family.

Base models, all honoured: safetensors metadata (`base_model`, `base_model_name_or_path`),
the model card's `base_model:` (a string or a list) and adapter_config.json's
`base_model_name_or_path`, the last two read from the adapter's own folder.

Families, for an adapter that names no base model: the trainers' own words in its
metadata (`modelspec.architecture`, kohya's `ss_base_model_version`) and what its source
says (Civitai's `baseModel`), read as one of the families loraswap serves.
"""

import json
import re
from collections.abc import Sequence
from pathlib import Path

from huggingface_hub.repocard import metadata_load

from loraswap.errors import AdapterIncompatible

METADATA_KEYS = ("base_model", "base_model_name_or_path", "modelspec.base_model")
FAMILY_KEYS = ("modelspec.architecture", "ss_base_model_version")
# how trainers and Civitai name a family -> the family's name (models/families/); the first match wins
FAMILY_WORDS = (
    (r"kontext", "flux-kontext"),
    (r"flux[ ._-]?2", "flux2"),
    (r"flux", "flux"),
    (r"qwen.*edit", "qwen-image-edit"),
    (r"qwen", "qwen-image"),
    (r"z[ ._-]?image", "z-image"),
    (r"\bwan", "wan"),
    (r"sd[ ._-]?3|stable-diffusion-v3|stable diffusion 3", "sd3"),
    (r"sdxl|stable-diffusion-xl|\bpony|illustrious|noobai", "sdxl"),
    (r"sd[ ._-]?v?1([._-]|\b)|stable-diffusion-v1|sd 1\.[45]", "sd15"),
)


def family_hint(metadata: dict[str, str], source_says: str | None = None) -> str | None:
    """The family the adapter's metadata (or its source, e.g. Civitai's baseModel) names, if any."""
    for words in [*(metadata.get(key) for key in FAMILY_KEYS), source_says]:
        if not words:
            continue
        found = next((family for pattern, family in FAMILY_WORDS if re.search(pattern, str(words).lower())), None)
        if found is not None:
            return found
    return None


def declared_base_models(metadata: dict[str, str], folder: Path | None) -> list[str]:
    names: list[str] = [metadata[k] for k in METADATA_KEYS if metadata.get(k)]
    if folder is not None:
        card = folder / "README.md"
        if card.is_file():
            declared = (metadata_load(card) or {}).get("base_model")
            names += [declared] if isinstance(declared, str) else list(declared or [])
        config = folder / "adapter_config.json"
        if config.is_file():
            try:
                declared = json.loads(config.read_text()).get("base_model_name_or_path")
            except (json.JSONDecodeError, AttributeError):
                declared = None
            if isinstance(declared, str) and declared:
                names.append(declared)
    return list(dict.fromkeys(str(n) for n in names if n))


def same_model(a: str, b: str) -> bool:
    return a.strip().rstrip("/").lower() == b.strip().rstrip("/").lower()


def matching_model(declared: Sequence[str], hosted: Sequence[str]) -> str | None:
    """The hosted model an adapter declaring `declared` is served by: the first hosted model
    it names, or the first hosted (the default) when it declares none; None if it names
    only models not hosted."""
    if not declared:
        return hosted[0] if hosted else None
    return next((h for h in hosted if any(same_model(d, h) for d in declared)), None)


def refuse_other_base(adapter_id: str, declared: Sequence[str], hosted: Sequence[str]) -> str:
    """`matching_model`, or AdapterIncompatible (422) naming what it was made for and what is hosted."""
    match = matching_model(declared, hosted)
    if match is None:
        raise AdapterIncompatible(adapter_id, f"it was made for {', '.join(declared)}, and this server hosts "
                                  f"{', '.join(hosted)}", f"Send it to a server hosting {declared[0]}")
    return match
