"""docs/architecture.md stays true: every module it names exists, and every `module.py:name`
it cites is defined there (a class, a function, a method of that class, or a module-level name)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "loraswap"
CITED = re.compile(r"`([\w/]+\.py)(?::([\w.]+))?")


def _module(path: str) -> Path | None:
    """The module a path names: from the package's root or the repository's, else the one module
    of the package or of tools/ whose path ends so (the page shortens `server/requests/limits.py`
    to `requests/limits.py` inside a room)."""
    for root in (PACKAGE, ROOT):
        if (root / path).is_file():
            return root / path
    found = [p for folder in (PACKAGE, ROOT / "tools") for p in folder.rglob(Path(path).name)
             if p.as_posix().endswith("/" + path)]
    return found[0] if len(found) == 1 else None


def _defines(source: str, name: str) -> bool:
    return re.search(rf"^\s*(async def|def|class) {name}\b|^{name}\b.*=", source, re.M) is not None


def test_every_module_and_name_the_page_cites_exists():
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for path, names in CITED.findall(page):
        module = _module(path)
        if module is None:
            missing.append(path)
            continue
        source = module.read_text()
        missing += [f"{path}:{names}" for name in names.split(".") if names and not _defines(source, name)]
    assert not missing, f"docs/architecture.md cites what is not there: {sorted(set(missing))}"
