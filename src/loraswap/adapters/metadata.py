"""What an adapter says about itself: the base model it was made for.

Sources, all honoured: safetensors metadata (`base_model`, `base_model_name_or_path`),
the model card's `base_model:` (a string or a list) and adapter_config.json's
`base_model_name_or_path`, the last two read from the adapter's own folder.
"""

import json
from collections.abc import Sequence
from pathlib import Path

from huggingface_hub.repocard import metadata_load

from ..errors import AdapterIncompatible

METADATA_KEYS = ("base_model", "base_model_name_or_path", "modelspec.base_model")


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
