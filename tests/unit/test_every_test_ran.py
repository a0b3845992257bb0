"""A session over two processes fails for a collected test that never ran (`support/every_test_ran.py`)."""

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

CONFTEST = f"""
import os
import sys

import pytest

sys.path.insert(0, {str(TESTS)!r})
from support.every_test_ran import (  # noqa: F401
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_xdist_node_collection_finished,
)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if item.name == "test_lost" and os.environ.get("LOSE_A_TEST"):
        return True  # the worker goes on without a report for it: a test lost
"""


def _run(folder: Path, lose: bool) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", **({"LOSE_A_TEST": "1"} if lose else {})}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", str(folder)],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def test_a_lost_test_fails_the_session_and_is_named(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_some.py").write_text("def test_kept():\n    pass\n\n\ndef test_lost():\n    pass\n")
    whole = _run(tmp_path, lose=False)
    assert whole.returncode == 0 and "2 passed" in whole.stdout, whole.stdout
    lost = _run(tmp_path, lose=True)
    assert lost.returncode == 1, lost.stdout
    assert "1 collected tests never ran: test_some.py::test_lost (x1)" in lost.stdout
