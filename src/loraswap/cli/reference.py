"""docs/settings.md, written from the settings (the config fields marked with a `Flag`):
every `serve` flag, its variable, its default and its help, by panel.
`tools/docs/settings_reference.py` writes the page and a test checks it is current, so the
page cannot drift from the flags."""

import textwrap

from loraswap.cli.settings import SETTINGS, Setting

INTRO = ("Every flag is also an environment variable and a key of a `--config` file (TOML or YAML; `max-queue` "
         "or `max_queue`). The variable is `LORASWAP_<FLAG>` (`--max-queue`: `LORASWAP_MAX_QUEUE`){others}; the "
         "table names each. Precedence, lowest first: the defaults, the file, the variables, the flags. A repeatable "
         "flag takes a list in a file. This page is written from the config classes' fields (their `Flag` marks, "
         "`src/loraswap/flags.py`) by `tools/docs/settings_reference.py`.")
BESIDES = """Besides these: `--config FILE` (a TOML or YAML file of these settings; `examples/serve.toml`),
`--print-config` (print the settings as a config file, API keys left out, and exit) and
`--verbose` / `-v` (log debug messages).
"""


def _header() -> str:
    """The title and what the page holds; the variables not named `LORASWAP_<FLAG>` (another
    tool's, as `RAY_ADDRESS`) are named from the settings, so the sentence stays true."""
    others = "".join(f", but `--{s.name}` reads `{s.env}`" for s in SETTINGS if s.env != "LORASWAP_" + s.param.upper())
    intro = textwrap.fill(INTRO.format(others=others), 90, break_long_words=False, break_on_hyphens=False)
    return f"# Settings of `loraswap serve`\n\n{intro}\n\n{BESIDES}"


def _default(setting: Setting) -> str:
    if setting.secret or setting.default in (None, (), ""):
        return ""
    values = setting.default if isinstance(setting.default, tuple) else (setting.default,)
    shown = ", ".join(str(v).lower() if isinstance(v, bool) else str(v) for v in values)
    return f"`{shown}`"


def _row(setting: Setting) -> str:
    if setting.type is bool:
        flag = f"`--{setting.name}` / `--no-{setting.name}`"
    else:
        flag = f"`--{setting.name}`" + (" (repeatable)" if setting.multiple else "")
    note = " With `--ray` only." if setting.ray_only else ""
    help_text = (setting.help + note).replace("|", "\\|")
    return f"| {flag} | `{setting.env}` | {_default(setting)} | {help_text} |"


def settings_markdown() -> str:
    panels: dict[str, list[Setting]] = {}
    for setting in SETTINGS:
        panels.setdefault(setting.panel, []).append(setting)
    parts = [_header()]
    for panel, settings in panels.items():
        parts += [f"\n## {panel}\n", "| flag | variable | default | what it does |", "|---|---|---|---|",
                  *(_row(s) for s in settings)]
    return "\n".join(parts) + "\n"
