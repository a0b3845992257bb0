"""The mark that makes a config field a setting of `loraswap serve`.

A config class marks a field with `Annotated[type, Flag(panel)]`. The CLI builds each
marked field's flag, `LORASWAP_*` variable, config-file key, --help text and row of
docs/settings.md from the mark and from the field itself: its type, default, description
and constraints (`cli/settings.py`). So a setting is written once, beside the code that
reads it. A field the server keeps out of logs (`repr=False`) is a secret: its flag shows
no default and an error never prints its value.
"""

from dataclasses import dataclass

# the --help panels, in the order they are shown
MODELS = "Models"
ADAPTERS = "Adapters and caches"
SCHEDULING = "Scheduling"
SPEED = "Speed and memory"
SERVER = "Server and limits"
RAY = "Ray"
PANELS = (MODELS, ADAPTERS, SCHEDULING, SPEED, SERVER, RAY)


@dataclass(frozen=True)
class Flag:
    panel: str
    name: str | None = None  # the flag without "--" (default: the field's name, dashed)
    unit: str | None = None  # the flag's unit where it differs from the field's: "MiB" for a field in bytes
    scale: int = 1  # one flag unit in the field's unit (MiB -> bytes: 2**20)
    repeat: str | None = None  # a one-value field whose flag may repeat (one config each); the help's note on it

    def __post_init__(self):
        if self.panel not in PANELS:
            raise ValueError(f"unknown panel {self.panel!r}; one of {PANELS}")
