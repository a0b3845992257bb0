"""`--help` a person can read at 80 columns: options grouped by panel, every variable's name
whole, and `serve --help` pointing at docs/settings.md for the full table."""

import re

from typer.testing import CliRunner

from loraswap.cli import app
from loraswap.cli.settings import SETTINGS

runner = CliRunner()


def _help(*command: str) -> str:
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return result.output


def test_serve_help_fits_80_columns_with_every_variable_whole():
    text = _help("serve")
    assert max(len(line) for line in text.splitlines()) <= 80
    # every setting's variable appears whole (a name cut at the column edge would not match)
    missing = [s.env for s in SETTINGS if not re.search(rf"\b{s.env}\b", text)]
    assert not missing, missing
    assert "docs/settings.md" in text.split("Options:")[0]
    # the panels, in order, each once
    headers = [line.rstrip(":") for line in text.splitlines() if line and not line.startswith(" ")
               and line.endswith(":")]
    assert headers == ["Options", "Models", "Adapters and caches", "Scheduling", "Speed and memory",
                       "Server and limits", "Ray"], headers
    # well under the table typer drew (8 lines a setting at 80 columns), which cut names off
    assert len(text.splitlines()) < 5.5 * len(SETTINGS)


def test_values_are_named_as_click_names_them():
    text = _help("generate")
    assert "--steps INTEGER" in text and "--model TEXT" in text and "--adapters PATH" in text
    assert not re.search(r"<(str|int|float|path|file|list\[)", text)  # typer's `<list[str]>`, `<int>`
    assert "Usage: root generate [OPTIONS] {PROMPT}" in text and "\n  PROMPT  What to draw." in text


def test_a_hyphenated_word_is_never_split_across_lines():
    for command in (["serve"], ["generate"], ["adapters", "inspect"], ["bench", "swap"]):
        text = _help(*command)
        assert not re.search(r"[\w]-\n", text), command
