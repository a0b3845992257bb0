"""Hooks that fail a session for a collected test that never ran.

With its tests over two processes (pytest-xdist), a session can end green having run fewer
tests than it collected: a scheduler that keys tests by node id runs one of several items
sharing an id (schemathesis' items for each API operation share one under pytest 9). The
controller counts each id as often as the workers collected it against the tests that
finished, and fails the session for any that never ran. Imported by `tests/conftest.py`;
without xdist nothing is counted (one process reports every test it ran).
"""

from collections import Counter

import pytest

_collected: Counter = Counter()
_finished: Counter = Counter()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    if not _collected:  # every worker collects the same tests (xdist checks it)
        _collected.update(ids)


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and not report.passed):  # a test's end: run, skipped or broken
        _finished[report.nodeid] += 1


def pytest_sessionfinish(session, exitstatus):
    options = session.config.option
    if exitstatus != pytest.ExitCode.OK or options.setuponly or options.setupplan:  # the last two run no test
        return
    never_ran = _collected - _finished
    if never_ran:
        names = ", ".join(f"{nodeid} (x{count})" for nodeid, count in sorted(never_ran.items())[:20])
        message = f"{never_ran.total()} collected tests never ran: {names}"
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:  # -p no:terminal
            print(message)
        else:
            reporter.write_line(message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
