"""Progress bars where a person waits at a terminal: a model loading, an image's steps, a
benchmark's rounds (rich, drawn on stderr).

Off when stderr is not a terminal (a pipe, a log file, a test): then every helper here
does nothing, and rich is not imported.
"""

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator


def on_terminal() -> bool:
    """Whether stderr is a terminal a bar can be drawn on. A stream that is no tty never is,
    whatever FORCE_COLOR says (a CI log, a test's captured output); rich is imported only
    for a tty."""
    if not sys.stderr.isatty():
        return False
    from rich.console import Console

    return Console(stderr=True).is_terminal


@contextlib.contextmanager
def _progress(*columns):
    """A transient rich Progress on stderr; log lines written meanwhile go above it."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    chosen = columns or (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                         TimeElapsedColumn())
    stderr = sys.stderr
    with Progress(*chosen, console=Console(stderr=True), transient=True) as bar:
        # rich prints what is written to sys.stderr above the bar; a log handler holds the stream
        # it was given, so it is pointed at rich's while the bar shows
        handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.StreamHandler)
                    and h.stream is stderr and sys.stderr is not stderr]
        for handler in handlers:
            handler.setStream(sys.stderr)
        try:
            yield bar
        finally:
            for handler in handlers:
                handler.setStream(stderr)


@contextlib.contextmanager
def waiting(description: str) -> Iterator[None]:
    """A spinner with the seconds spent, while something of unknown length runs (a model loading)."""
    if not on_terminal():
        yield
        return
    from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

    with _progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn()) as bar:
        bar.add_task(description, total=None)
        yield


@contextlib.contextmanager
def counting(description: str, total: int | None = None) -> Iterator[Callable[[int, int], None]]:
    """A bar; the caller reports with the callback `(done, total)` (the engine's `on_step`)."""
    if not on_terminal():
        yield lambda done, total: None
        return
    with _progress() as bar:
        task = bar.add_task(description, total=total)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def tracked(items, description: str) -> Iterator:
    """`items`, with a bar of how many are done (a benchmark's rounds)."""
    items = list(items)
    with counting(description, len(items)) as report:
        for done, item in enumerate(items):
            report(done, len(items))
            yield item
        report(len(items), len(items))
