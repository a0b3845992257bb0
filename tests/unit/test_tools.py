"""The tools under tools/ (GPU profiles, checks and demo training cited in BENCHMARKS.md and
docs/) still import against the package: a move in src/ must move their imports too."""

import importlib.util
from pathlib import Path

import pytest

TOOLS = sorted((Path(__file__).resolve().parents[2] / "tools").glob("**/*.py"))


def test_the_tools_are_found():
    assert len(TOOLS) >= 20, TOOLS


@pytest.mark.parametrize("path", TOOLS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_tool_imports(path, monkeypatch):
    monkeypatch.syspath_prepend(str(path.parent))  # as `python tools/X/NAME.py` puts its own folder first
    spec = importlib.util.spec_from_file_location(f"tool_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines, never runs: each tool's work is under __main__
