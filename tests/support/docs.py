"""The examples of a docs page, run as written against real servers.

How a page is run (`run_page`):
- its ```sh and ```python blocks, in order, in one folder of its own (a block may use a file an
  earlier one wrote), but a block right after a `<!-- docs-test: skip (why) -->` line, and one
  right after `<!-- docs-test: file NAME -->` (the page says to save it as NAME) is written
  to NAME, for a later block to run;
- against the server given to start with (the Makefile's `serve` command: `make_serve_args`), if
  any, started in that folder with its state and download folders there, never ~/.cache/loraswap;
- a block holding a `loraswap serve ARGS` line starts that server (its state and downloads in
  the folder too), with the block's `export` lines as its environment: it serves the port it
  names (8888 by default) from then on;
- each server listens on a free port: the examples' `localhost:8888` and `HOST:8888` (and any
  other port a serve line names) are written `127.0.0.1:PORT`;
- shell blocks run in `bash -e -o pipefail`, with curl run as `curl --fail-with-body --silent
  --show-error` (an HTTP error fails the block) and `python` the interpreter of the tests;
- every image, MP4 or base64 JSON image a block writes must decode.
"""

import base64
import io
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from support.servers import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
DOC_PORT = 8888  # the port `loraswap serve` listens on when none is named
SKIP = "<!-- docs-test: skip"
FILE = re.compile(r"<!-- docs-test: file (\S+) -->")
CURL = "curl() { command curl --fail-with-body --silent --show-error \"$@\"; }\n"
HERMETIC = ["--state-dir", "state", "--download-dir", "downloads"]
BLOCK_TIMEOUT_S = 300


@dataclass
class Block:
    language: str  # "sh" or "python"
    text: str
    line: int  # where it starts in its page, for the failure message
    file: str | None = None  # the file the page says to save it as, rather than run it


def examples(page: Path) -> list[Block]:
    """The page's sh and python fenced blocks, but those marked to skip."""
    blocks, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = re.fullmatch(r"```(\w+)", lines[i])
        if fence:
            end = lines.index("```", i + 1)
            before = lines[i - 1] if i > 0 else ""
            if fence.group(1) in ("sh", "python") and not before.startswith(SKIP):
                saved = FILE.fullmatch(before)
                blocks.append(Block(fence.group(1), "\n".join(lines[i + 1:end]) + "\n", i + 1,
                                    saved.group(1) if saved else None))
            i = end
        i += 1
    return blocks


def make_serve_args() -> list[str]:
    """The arguments of `loraswap serve` in the Makefile's `serve` recipe."""
    recipe = re.search(r"^serve:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE).group(1)
    words = shlex.split(recipe)
    return words[words.index("serve") + 1:]


@dataclass
class Page:
    """A page's folder and the servers its examples talk to, by the port the page names."""

    folder: Path
    servers: dict[int, ServerProcess] = field(default_factory=dict)

    def start(self, args: list[str], env: dict | None = None) -> None:
        doc_port = DOC_PORT
        if "--port" in args:
            at = args.index("--port")
            doc_port, args = int(args[at + 1]), args[:at] + args[at + 2:]
        if doc_port in self.servers:
            self.servers.pop(doc_port).stop()
        log = self.folder / f"server-{len(list(self.folder.glob('server-*.log')))}.log"
        server = ServerProcess([*args, *HERMETIC], log, env=env)
        self.servers[doc_port] = server
        server.wait_ready()

    def address(self, text: str) -> str:
        """`text` with each port the page names pointing at its server."""
        for doc_port, server in self.servers.items():
            text = re.sub(rf"\b(localhost|HOST):{doc_port}\b", f"127.0.0.1:{server.port}", text)
        return text

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


def run_page(page_path: Path, folder: Path, monkeypatch, first_server: list[str] | None,
             edits: dict[str, str] | None = None) -> list[str]:
    """Every example of the page, in order, `first_server`'s arguments (if any) served before
    the first; `edits`: text replaced in the examples before they run. The files holding
    pictures the examples wrote, each checked."""
    monkeypatch.chdir(folder)  # the servers' relative folders (demo-adapters/, state/) are the page's
    page, pictures = Page(folder), []
    try:
        if first_server is not None:
            page.start(first_server)
        for block in examples(page_path):
            for old, new in (edits or {}).items():
                block.text = block.text.replace(old, new)
            before = {p: p.stat().st_mtime_ns for p in folder.iterdir() if p.is_file()}
            if block.file is not None:
                (folder / block.file).write_text(block.text)
                continue
            (_run_shell if block.language == "sh" else _run_python)(page, block)
            pictures += _check_outputs(folder, before, block)
    finally:
        page.stop()
    return pictures


def _run_shell(page: Page, block: Block) -> None:
    lines = block.text.splitlines()
    serve = next((n for n, line in enumerate(lines) if line.startswith("loraswap serve ")), None)
    if serve is not None:  # exports, then the server: the rest of the block runs against it
        env = _exported(lines[:serve], page.folder)
        page.start(shlex.split(lines[serve], comments=True)[2:], env)
        lines = lines[:serve] + lines[serve + 1:]
    script = CURL + page.address("\n".join(lines))
    _run(["bash", "-e", "-o", "pipefail", "-c", script], page, block)


def _exported(lines: list[str], folder: Path) -> dict:
    """The environment the `export` lines before a serve line set."""
    out = subprocess.run(["bash", "-e", "-c", "\n".join(lines) + "\nenv -0"], cwd=folder, capture_output=True,
                         check=True, env=_environment()).stdout
    return dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)


def _run_python(page: Page, block: Block) -> None:
    script = page.folder / f"example-{block.line}.py"
    script.write_text(page.address(block.text))
    _run([sys.executable, script.name], page, block)


def _environment(client: bool = False) -> dict:
    """This environment, with the tests' interpreter (and its `loraswap`) first on the PATH. A
    client's without HF_HUB_OFFLINE: huggingface_hub's offline mode refuses every URL, the test's
    servers on 127.0.0.1 too (the examples reach nothing else)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if client:
        env.pop("HF_HUB_OFFLINE", None)
    return env


def _run(argv: list[str], page: Page, block: Block) -> None:
    done = subprocess.run(argv, cwd=page.folder, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
                          env=_environment(client=True))
    assert done.returncode == 0, (f"the {block.language} example at line {block.line} failed "
                                  f"({done.returncode}):\n{block.text}\nstdout: {done.stdout[-2000:]}\n"
                                  f"stderr: {done.stderr[-2000:]}")


def _check_outputs(folder: Path, before: dict[Path, int], block: Block) -> list[str]:
    """Every file the block wrote that holds pictures decodes; their names."""
    written = [p for p in folder.iterdir() if p.is_file() and before.get(p) != p.stat().st_mtime_ns]
    checked = []
    for path in written:
        data = path.read_bytes()
        if path.suffix in (".png", ".jpg", ".webp"):
            decodes(data, f"{path.name} (line {block.line})")
        elif path.suffix == ".mp4":
            assert data[4:8] == b"ftyp", f"{path.name} (line {block.line}) is no MP4"
        elif path.suffix == ".json" and "b64_json" in (text := data.decode()):
            for item in json.loads(text)["data"]:
                decodes(base64.b64decode(item["b64_json"]), f"{path.name} (line {block.line})")
        elif path.suffix == ".json" and isinstance(answer := json.loads(text), dict) and "images" in answer:  # A1111
            for item in answer["images"]:
                decodes(base64.b64decode(item), f"{path.name} (line {block.line})")
        else:
            continue
        checked.append(path.name)
    return checked


def decodes(data: bytes, name: str) -> Image.Image:
    """The picture in `data`, decoded whole; it fails naming `name` when it is none."""
    image = Image.open(io.BytesIO(data))
    image.load()
    assert image.width >= 16 and image.height >= 16, name
    return image
