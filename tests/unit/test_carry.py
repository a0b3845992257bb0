"""tools/ray/carry_ray.sh and carry_select.py: which wheels travel to a machine without a package
index, judged by version requirements against the target's installed versions, not names."""

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

SCRIPTS = Path(__file__).resolve().parents[2] / "tools" / "ray"
sys.path.insert(0, str(SCRIPTS))
import carry_select  # noqa: E402

# what `pip download "ray[serve]"` resolves, in small: Requires-Dist lines as the real wheels have them
WHEELS = {
    "ray-2.60.0": ["grpcio>=1.42.0", "requests", 'grpcio-reflection ; extra == "serve"', 'fastapi ; extra == "serve"',
                   'uvicorn[standard] ; extra == "serve"'],
    "grpcio_reflection-1.85.1": ["grpcio>=1.85.1", "protobuf>=6.31.1"],
    "grpcio-1.85.3": [],
    "protobuf-7.36.2": [],
    "requests-2.34.2": [],
    "fastapi-0.165.0": ["starlette>=0.40.0"],
    "starlette-1.10.0": [],
    "uvicorn-0.55.0": ["h11>=0.8", 'colorama>=0.4 ; sys_platform == "win32" and extra == "standard"',
                       'httptools>=0.6.3 ; extra == "standard"', 'websockets>=10.4 ; extra == "standard"'],
    "h11-0.16.0": [],
    "httptools-0.9.0": [],
    "websockets-17.4": [],
    "colorama-0.4.6": [],
}
# the GPU machine as found: an older grpcio than grpcio-reflection asks for, uvicorn without its extras
TARGET = ["grpcio==1.84.0", "protobuf==7.36.2", "requests==2.32.0", "uvicorn==0.55.0", "h11==0.16.0",
          "fastapi==0.100.0", "starlette==0.27.0"]


def make_wheels(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for stem, requires in WHEELS.items():
        name, version = stem.split("-")
        with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as archive:
            lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                     *(f"Requires-Dist: {r}" for r in requires)]
            archive.writestr(f"{stem}.dist-info/METADATA", "\n".join(lines) + "\n")
    return folder


def chosen_names(paths) -> set[str]:
    return {Path(p).name.split("-")[0] for p in paths}


def test_a_version_the_target_has_but_a_requirement_refuses_travels(tmp_path):
    wheels = carry_select.read_wheels(make_wheels(tmp_path / "wheels"))
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("\n".join(TARGET) + "\n")
    have = carry_select.read_freeze(freeze)
    assert have["grpcio"] == Version("1.84.0")
    chosen = carry_select.select(wheels, have, [Requirement("ray[serve]==2.60.0")],
                                 carry_select.target_environment("3.12"))
    # grpcio 1.84.0 is there, but grpcio-reflection needs >=1.85.1; uvicorn is there, not its
    # `standard` extra; fastapi 0.100.0 meets ray's bare `fastapi`, so its own dependencies are the target's
    assert chosen_names(chosen) == {"ray", "grpcio", "grpcio_reflection", "httptools", "websockets"}


def test_without_a_target_list_the_whole_closure_travels_but_what_is_for_another_platform(tmp_path):
    wheels = carry_select.read_wheels(make_wheels(tmp_path / "wheels"))
    chosen = carry_select.select(wheels, {}, [Requirement("ray[serve]==2.60.0")],
                                 carry_select.target_environment("3.12"))
    assert chosen_names(chosen) == {n.split("-")[0] for n in WHEELS} - {"colorama"}


def test_a_requirement_no_carried_wheel_meets_is_refused_by_name(tmp_path):
    wheels = carry_select.read_wheels(make_wheels(tmp_path / "wheels"))
    with pytest.raises(SystemExit, match=r"grpcio>=1\.90"):
        carry_select.select(wheels, {}, [Requirement("grpcio>=1.90")], carry_select.target_environment("3.12"))


def pack(tmp_path: Path, target: list[str], *extra: str) -> Path:
    """`carry_ray.sh pack` over the test wheels for `target`, its pieces joined, checked against
    SHA256SUMS and unpacked: the folder `install` chooses from on the target."""
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("\n".join(target) + "\n")
    out = tmp_path / "carry"
    env = {**os.environ, "WHEELS": str(make_wheels(tmp_path / "wheels")), "HAVE": str(freeze), "PIECE": "1K",
           "PYTHON_VERSION": "3.12"}
    run = subprocess.run(["bash", str(SCRIPTS / "carry_ray.sh"), "pack", str(out), *extra], env=env,
                         capture_output=True, text=True, check=True)
    pieces = sorted(out.glob("[0-9]*/piece.*"), key=lambda p: p.name)  # piece.000, piece.001, ...
    assert len(pieces) > 1 and f"{len(pieces)} piece(s)" in run.stdout
    joined = tmp_path / "ray.tar"
    joined.write_bytes(b"".join(p.read_bytes() for p in pieces))
    digest = subprocess.run(["sha256sum", str(joined)], capture_output=True, text=True).stdout.split()[0]
    assert (out / "SHA256SUMS").read_text().split()[0] == digest
    with tarfile.open(joined) as archive:
        archive.extractall(tmp_path / "unpacked", filter="data")
    return tmp_path / "unpacked" / "wheels"


def install_choice(folder: Path, target: list[str]) -> set[str]:
    """What `install` chooses on a target with `target` installed (as `carry_select.py` there)."""
    have = {name: Version(v) for name, v in (line.split("==") for line in target)}
    roots = [Requirement(line) for line in (folder / "REQUIREMENTS.txt").read_text().splitlines() if line]
    return chosen_names(carry_select.select(carry_select.read_wheels(folder), have, roots,
                                            carry_select.target_environment("3.12")))


def test_pack_carries_what_the_target_lacks_and_install_chooses_the_same(tmp_path):
    folder = pack(tmp_path, TARGET)
    carried = {p.name for p in folder.glob("*.whl")}
    assert chosen_names(carried) == {"ray", "grpcio", "grpcio_reflection", "httptools", "websockets"}
    assert (folder / "REQUIREMENTS.txt").read_text().split() == ["ray[serve]==2.60.0"]
    # uvicorn stayed behind, its metadata did not: on the target its `standard` extra still asks
    # for httptools and websockets
    assert install_choice(folder, TARGET) == chosen_names(carried)


def test_a_target_that_has_everything_gets_nothing_and_other_platforms_roots_are_skipped(tmp_path):
    everything = [f"{stem.split('-')[0].replace('_', '-')}=={stem.split('-')[1]}" for stem in WHEELS]
    folder = pack(tmp_path, everything, 'colorama==0.4.6 ; sys_platform == "win32"')
    assert list(folder.glob("*.whl")) == []
    assert install_choice(folder, everything) == set()


def test_a_version_that_is_not_pep_440_counts_as_absent(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("grpcio==1.84.0\npython-apt==2.4.0+ubuntu1build1\ndistro-info==1.1build1\n")
    assert carry_select.read_freeze(freeze) == {"grpcio": Version("1.84.0"),
                                                "python-apt": Version("2.4.0+ubuntu1build1")}
