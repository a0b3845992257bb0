"""Which of a folder of wheels a target without a package index must install.

    python3 tools/ray/carry_select.py WHEELS REQUIREMENTS [--have FREEZE] [--python 3.12]

WHEELS holds every wheel the REQUIREMENTS file's requirements need (what `pip download`
resolved; a wheel a pack left out keeps its METADATA under WHEELS/metadata/). FREEZE is
the target's `pip list --format=freeze` (default: this Python's own installed
distributions, which is what the target sees when run there). Prints, one per line, the
wheels to install: those whose package the target lacks, and those whose package the
target has at a version some requirement of the install does not accept
(`grpcio-reflection` asking `grpcio>=1.85.1` of a target with 1.84.0). Names alone are not
enough: a version the target has is kept only if every requirement on it accepts it.

A package the target already satisfies keeps the target's own dependencies; only the
extras asked of it (`uvicorn[standard]`) are followed, through the carried wheel's
metadata. Exits 1, naming the requirement, when no carried wheel satisfies one.
"""

import argparse
import sys
import zipfile
from dataclasses import dataclass, field
from email.parser import Parser
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version


@dataclass
class Wheel:
    path: Path | None  # None: left out of the pack (the target had it), its metadata kept
    version: Version
    requires: list[Requirement] = field(default_factory=list)


def parse_metadata(text: str) -> tuple[str, Version, list[Requirement]]:
    """A wheel's METADATA (email headers, then the description): name, version, Requires-Dist."""
    headers = Parser().parsestr(text, headersonly=True)
    requires = [Requirement(line) for line in headers.get_all("Requires-Dist", [])]
    return canonicalize_name(headers["Name"]), Version(headers["Version"]), requires


def read_wheels(folder: Path) -> dict[str, Wheel]:
    """The folder's wheels, and the metadata of those a pack left out (`metadata/*.METADATA`),
    whose requirements still count: a target's `uvicorn` still asks for its extras."""
    wheels = {}
    for path in sorted((folder / "metadata").glob("*.METADATA")):
        name, version, requires = parse_metadata(path.read_text("utf-8"))
        wheels[name] = Wheel(None, version, requires)
    for path in sorted(folder.glob("*.whl")):
        name, version, requires = parse_metadata(wheel_metadata(path))
        wheels[name] = Wheel(path, version, requires)
    return wheels


def wheel_metadata(path: Path) -> str:
    with zipfile.ZipFile(path) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return archive.read(meta).decode("utf-8")


def read_freeze(path: Path | None) -> dict[str, Version]:
    """name -> version of a `pip list --format=freeze` file, or of this Python's distributions.
    A version that is not PEP 440 (a distribution's `1.1build1`) counts as absent."""
    if path is None:
        pairs = [(d.metadata["Name"], d.version) for d in metadata.distributions()]
    else:  # `name @ file://...` lines name no version: absent too
        pairs = [line.strip().split("==", 1) for line in path.read_text().splitlines() if "==" in line]
    have = {}
    for name, version in pairs:
        try:
            have[canonicalize_name(name)] = Version(version)
        except InvalidVersion:
            print(f"carry_select: {name} {version} is not a PEP 440 version: treated as absent", file=sys.stderr)
    return have


def target_environment(python: str | None) -> dict[str, str]:
    """Marker values of the target: this interpreter's, or a Linux x86-64 CPython `python`."""
    env = default_environment()
    if python:
        env |= {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
                "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                "implementation_name": "cpython", "platform_python_implementation": "CPython"}
    return env


def applies(requirement: Requirement, env: dict[str, str], extras: set[str]) -> bool:
    """Whether a Requires-Dist line counts for a package asked with `extras`."""
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate(env | {"extra": extra}) for extra in extras | {""})


def extras_only(requirement: Requirement, env: dict[str, str], extras: set[str]) -> bool:
    """Whether the line counts only because of one of `extras` (not for the bare package)."""
    return (requirement.marker is not None and not requirement.marker.evaluate(env | {"extra": ""})
            and applies(requirement, env, extras))


def select(wheels: dict[str, Wheel], have: dict[str, Version], roots: list[Requirement],
           env: dict[str, str]) -> list[Path]:
    """The wheels to install (see the module's doc)."""
    kept: set[str] = set()
    extras: dict[str, set[str]] = {}
    pending = [root for root in roots if applies(root, env, set())]
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        wheel = wheels.get(name)
        asked = extras.setdefault(name, set())
        new_extras = set(requirement.extras) - asked
        asked |= new_extras
        installed = have.get(name)
        if name not in kept and not (installed and requirement.specifier.contains(installed, prereleases=True)):
            if wheel is None or wheel.path is None or not requirement.specifier.contains(wheel.version,
                                                                                         prereleases=True):
                raise SystemExit(f"no carried wheel satisfies {requirement} (the target has "
                                 f"{installed or 'none'}); add it to the pack")
            kept.add(name)
            pending += [r for r in wheel.requires if applies(r, env, asked)]
        elif new_extras and wheel is not None:
            # a kept wheel takes all the extra's lines; the target's own package only those the
            # extra adds (its base dependencies are installed there already)
            pending += [r for r in wheel.requires if (applies(r, env, new_extras) if name in kept
                                                      else extras_only(r, env, new_extras))]
        if name in kept and not requirement.specifier.contains(wheels[name].version, prereleases=True):
            raise SystemExit(f"the carried {name} {wheels[name].version} does not satisfy {requirement}")
    return sorted(wheels[name].path for name in kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheels", type=Path)
    parser.add_argument("requirements", type=Path, nargs="?", help="the requirements the wheels were downloaded for")
    parser.add_argument("--write-metadata", type=Path, metavar="DIR",
                        help="instead: write each wheel's METADATA into DIR (a pack keeps those it leaves out)")
    parser.add_argument("--have", type=Path, help="the target's `pip list --format=freeze` (default: this Python's)")
    parser.add_argument("--python", help="the target's Python (X.Y) when run elsewhere than on it")
    args = parser.parse_args()
    if args.write_metadata:
        args.write_metadata.mkdir(parents=True, exist_ok=True)
        for wheel in sorted(args.wheels.glob("*.whl")):
            (args.write_metadata / f"{wheel.stem}.METADATA").write_text(wheel_metadata(wheel), "utf-8")
        return
    roots = [Requirement(line) for line in args.requirements.read_text().splitlines() if line.strip()]
    chosen = select(read_wheels(args.wheels), read_freeze(args.have), roots, target_environment(args.python))
    if chosen:
        print("\n".join(str(path) for path in chosen))


if __name__ == "__main__":
    sys.exit(main())
