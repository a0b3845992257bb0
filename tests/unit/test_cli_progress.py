"""Progress where a person waits at a terminal (a model loading, an image's steps, a
benchmark's rounds), and nothing of it in a pipe, a log file or a test's output."""

import contextlib
import io
import logging
import sys

from PIL import Image
from typer.testing import CliRunner

import loraswap.progress
from loraswap.cli import app
from loraswap.progress import counting, on_terminal, tracked

runner = CliRunner()


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_nothing_is_drawn_off_a_terminal(capsys):
    assert not on_terminal()  # pytest's captured stderr is no tty
    with counting("steps") as report:
        report(1, 2)
    assert list(tracked(range(3), "rounds")) == [0, 1, 2]
    assert capsys.readouterr().err == ""


def test_a_bar_is_drawn_on_a_terminal_with_log_lines_above_it(monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    handler = logging.StreamHandler(terminal)
    logging.getLogger().addHandler(handler)
    try:
        assert on_terminal()
        with counting("steps") as report:
            report(1, 4)
            assert handler.stream is not terminal  # written through rich, above the bar
            logging.getLogger("loraswap.test").warning("a log line")
            report(4, 4)
        assert handler.stream is terminal
    finally:
        logging.getLogger().removeHandler(handler)
    assert "a log line" in terminal.getvalue() and "steps" in terminal.getvalue()


def test_generate_reports_each_step_and_prints_no_bar_to_a_pipe(monkeypatch, tmp_path):
    """One run of the demo (32 px, 3 steps): the engine's per-step callback drives the bar, and
    the loading spinner draws nothing into a pipe."""
    reports = []

    @contextlib.contextmanager
    def recording(description, total=None):
        yield lambda done, total: reports.append((done, total))

    monkeypatch.setattr(loraswap.progress, "counting", recording)
    out = tmp_path / "out.png"
    result = runner.invoke(app, ["generate", "a red circle", "--model", "demo", "--steps", "3", "--no-compile",
                                 "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert reports == [(1, 3), (2, 3), (3, 3)]
    assert "\x1b[" not in result.output and "\r" not in result.output
    assert Image.open(out).size == (32, 32)
