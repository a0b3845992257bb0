"""The codebase stays one a newcomer can read: a folder per concept, one concept per module,
names a user knows. (The layering and function sizes are checked by `lint-imports` and `ruff`
in `make test`; a long module is a hint to split it, not a failure.)"""

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "loraswap"
MAX_MODULES = 16  # past this a folder holds several concepts: give each its own folder
MAX_SHARED_PREFIX = 3  # `float8_a`, `float8_b`, `float8_c`, `float8_d` side by side: a folder named by a prefix


def _folders() -> dict[Path, list[str]]:
    """Each package folder of the source and the names of its modules."""
    folders = {}
    for init in PACKAGE.rglob("__init__.py"):
        folders[init.parent] = sorted(p.stem for p in init.parent.glob("*.py") if p.stem != "__init__")
    return folders


def test_a_folder_holds_one_concept_not_a_crowd_of_modules():
    crowded = {str(f.relative_to(PACKAGE)): len(names) for f, names in _folders().items() if len(names) > MAX_MODULES}
    assert not crowded, f"group these folders' modules into folders by concept: {crowded}"


def test_no_name_prefix_stands_in_for_a_folder():
    """Modules that share a name's first word (`float8_kernels`, `float8_weights`, ...) are a
    concept waiting for its folder."""
    found = {}
    for folder, names in _folders().items():
        prefixes = Counter(name.split("_")[0] for name in names if "_" in name)
        found |= {f"{folder.relative_to(PACKAGE)}/{prefix}_*": count for prefix, count in prefixes.items()
                  if count > MAX_SHARED_PREFIX}
    assert not found, f"give these prefixes a folder: {found}"


def test_every_source_folder_is_a_package():
    """A folder of modules without `__init__.py` is missed by packaging and by import-linter's contracts."""
    loose = [str(d.relative_to(PACKAGE)) for d in PACKAGE.rglob("*") if d.is_dir() and any(d.glob("*.py"))
             and not (d / "__init__.py").exists()]
    assert not loose, loose


def test_the_baselines_are_named_load_and_fuse_and_hotswap_everywhere():
    """"seed 1" / "seed 2" named the two baselines in an old write-up: nothing a user knows."""
    pattern = re.compile(r"\bseed[-_ ]?[12]\b", re.IGNORECASE)
    allowed = re.compile(r"--seed[ =]|seed=|manual_seed|\"seed\"")
    tools = [p for p in (ROOT / "tools").rglob("*") if p.suffix in {".py", ".sh", ".md"}]
    files = [*(ROOT / "src").rglob("*.py"), *tools, *(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(allowed.sub("", line))]
    assert not hits, hits
