"""The codebase stays one a newcomer can read: small modules, names a user knows.
(The layering and function sizes are checked by `lint-imports` and `ruff` in `make test`.)"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "src").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules (one job per module): {long}"


def test_the_baselines_are_named_load_and_fuse_and_hotswap_everywhere():
    """"seed 1" / "seed 2" named the two baselines in an old write-up: nothing a user knows."""
    pattern = re.compile(r"\bseed[-_ ]?[12]\b", re.IGNORECASE)
    allowed = re.compile(r"--seed[ =]|seed=|manual_seed|\"seed\"")
    tools = [p for p in (ROOT / "tools").rglob("*") if p.suffix in {".py", ".sh", ".md"}]
    files = [*(ROOT / "src").rglob("*.py"), *tools, *(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(allowed.sub("", line))]
    assert not hits, hits
