"""Hooks that fail a session for a collected test that never ran.

With its tests over two processes (pytest-xdist), a session whose worker loses some of its
tests can end green having run fewer. The controller counts what each worker collected
against the tests reported, and fails the session for any that never ran. Imported by
`tests/conftest.py`; without xdist nothing is counted (one process reports every test it ran).
"""

import pytest

_collected: set[str] = set()
_reported: set[str] = set()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    _collected.update(ids)


def pytest_runtest_logreport(report):
    _reported.add(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    never_ran = sorted(_collected - _reported)
    if never_ran and exitstatus == pytest.ExitCode.OK:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        reporter.write_line(f"{len(never_ran)} collected tests never ran: {', '.join(never_ran[:20])}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
