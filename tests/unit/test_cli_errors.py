"""The command line's first minute: `--version` and `--help` without torch, and every user
error refused before a model loads, in one or two lines with what to do, exit code 2 for a
wrong use and 1 for a failure, never a traceback."""

import socket
import subprocess
import sys
from importlib.metadata import version

import pytest
from typer.testing import CliRunner

from loraswap.cli import app

runner = CliRunner()
HEAVY = ("torch", "diffusers", "transformers", "torchao", "peft", "rich")
DEMO_ADAPTERS = "src/loraswap/models/demo_weights/adapters"


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: the errors below must come before one."""
    import loraswap.engine.engine

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(loraswap.engine.engine.Engine, "__init__", refuse)


def _lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.strip()]


def test_help_and_version_import_no_heavy_library():
    code = "\n".join(["import sys", "from loraswap.cli import app",
                      "for args in (['--help'], ['--version']):",
                      "    try:", "        app(args, prog_name='loraswap')",
                      "    except SystemExit as e:", "        assert e.code == 0",
                      f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]", done.stdout
    assert "Usage: loraswap" in done.stdout and f"loraswap {version('loraswap')}" in done.stdout


def test_version_is_the_package_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"loraswap {version('loraswap')}\n"


def test_help_lists_every_command_without_loading_it():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in ("serve", "deploy", "generate", "adapters", "bench"):
        assert f"\n  {name} " in result.output, result.output


def test_each_summary_is_its_command_s_own_first_line():
    """`loraswap --help` shows summaries kept beside the commands' names; they must say what the commands do."""
    from loraswap.cli import Commands

    for name, lazy in Commands.lazy_commands.items():
        command = lazy.load(name)
        assert " ".join(command.help.split()).startswith(lazy.summary), name


@pytest.mark.parametrize("args,flag,words", [
    (["--adapters", "{tmp}/missing"], "--adapters", "does not exist"),
    (["--model", "nosuchmodel"], "--model", "a preset (tiny-sd, demo,"),
    (["--model", "demx"], "--model", "did you mean demo?"),
    (["--width", "33"], "--width", "must be a multiple of 8, not 33"),
    (["--steps", "0"], "--steps", "must be greater than or equal to 1, not 0"),
    (["-o", "{tmp}/out.gif"], "-o", "write an image (.png, .jpg or .webp) or a video (.mp4)"),
    (["--model", "tiny-wan", "-o", "{tmp}/out.png"], "-o", "this model makes videos: write one with -o"),
    (["--model", "tiny-flux", "--width", "72"], "--width/--height", "a width that is a multiple of 16, not 72"),
    (["--width", "1024", "--height", "1024"], "--width/--height", "demo makes images of at most 128x128, not "
     "1024x1024: ask for a smaller size (--max-size sets this bound)"),
])
def test_generate_refuses_a_wrong_use_before_the_model_loads(args, flag, words, tmp_path, no_model_loads):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = runner.invoke(app, ["generate", "a red circle", "--model", "demo", *args])
    assert result.exit_code == 2, result.output
    first, second = _lines(result.output)
    assert first.startswith(f"error: Invalid value for {flag}: ") and words in first, first
    assert second == "See 'root generate --help'."  # CliRunner's program name
    assert "Traceback" not in result.output and "pydantic" not in result.output and "http" not in result.output
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_adapter_is_refused_before_the_model_loads_in_cli_words(no_model_loads, tmp_path):
    result = runner.invoke(app, ["generate", "x", "--model", "demo", "--adapters", DEMO_ADAPTERS, "--lora", "nosuch",
                                 "-o", str(tmp_path / "x.png")])
    assert result.exit_code == 1
    assert _lines(result.output) == ["error: adapter 'nosuch': no such adapter in the adapter folder. "
                                     "`loraswap adapters list --adapters DIR` lists the ids there"]
    result = runner.invoke(app, ["generate", "x", "--model", "demo", "--lora", "nosuch", "-o", str(tmp_path / "x.png")])
    assert result.exit_code == 1
    assert _lines(result.output) == ["error: adapter 'nosuch': no adapter folder is configured and it is not a hub "
                                     "id. Run it with --adapters DIR or --hub"]


def test_server_words_become_command_line_words():
    from loraswap.cli.group import in_cli_words

    assert in_cli_words("Drop the @revision, or start the server with --hub") == \
        "Drop the @revision, or run it with --hub"
    assert in_cli_words("Start the server with --url-allow h") == "Run it with --url-allow h"
    assert in_cli_words("this server does not fetch adapters from url references. Start it with --url-allow HOST") \
        == "loraswap does not fetch adapters from url references. Run it with --url-allow HOST"
    assert "GET" not in in_cli_words("GET /adapters lists the ids this server knows")


def test_serve_finds_its_port_in_use_before_loading(no_model_loads):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        result = runner.invoke(app, ["serve", "--model", "demo", "--port", str(port)])
    assert result.exit_code == 1
    assert _lines(result.output) == [f"error: cannot serve on 127.0.0.1:{port}: another program listens on it. Stop "
                                     "that program, or serve on another port: --port N (or LORASWAP_PORT=N)"]


def test_serve_refuses_an_unknown_model_and_a_missing_folder_before_loading(no_model_loads, tmp_path):
    result = runner.invoke(app, ["serve", "--model", "demo", "--model", "nosuchmodel"])
    assert result.exit_code == 2 and "'nosuchmodel' is no model loraswap knows" in result.output
    result = runner.invoke(app, ["serve", "--model", "demo", "--adapters", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "--adapters" in result.output and "does not exist" in result.output


def test_an_unexpected_error_is_one_line_unless_debugging(monkeypatch):
    import loraswap.cli.adapter_tools

    def broken(*args, **kwargs):
        raise RuntimeError("something broke")

    monkeypatch.setattr(loraswap.cli.adapter_tools, "inspect_report", broken)
    path = f"{DEMO_ADAPTERS}/big.safetensors"
    result = runner.invoke(app, ["adapters", "inspect", path])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert _lines(result.output)[0] == "error: unexpected RuntimeError: something broke"
    assert "--debug" in _lines(result.output)[1] and "LORASWAP_DEBUG=1" in _lines(result.output)[1]
    for args, env in ((["--debug", "adapters", "inspect", path], {}), (["adapters", "inspect", path],
                                                                       {"LORASWAP_DEBUG": "1"})):
        result = runner.invoke(app, args, env=env)
        assert isinstance(result.exception, RuntimeError), result.output


def test_a_usage_error_of_click_itself_is_two_lines():
    result = runner.invoke(app, ["generate", "a fox", "--steps", "many"])
    assert result.exit_code == 2
    first, second = _lines(result.output)
    assert first.startswith("error: Invalid value for '--steps'") and second == "See 'root generate --help'."
    result = runner.invoke(app, ["nosuchcommand"])
    assert result.exit_code == 2 and _lines(result.output)[0] == "error: No such command 'nosuchcommand'."
