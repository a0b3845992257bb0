"""Where loraswap keeps files of its own by default: under the user's cache folder, as
huggingface_hub keeps its own ($XDG_CACHE_HOME, else ~/.cache)."""

import os
from pathlib import Path


def user_cache(*parts: str) -> Path:
    """`$XDG_CACHE_HOME/loraswap/<parts>`, or `~/.cache/loraswap/<parts>`."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "loraswap", *parts)
