"""Checks against a reference that need CUDA, run on a GPU machine:

    PYTHONPATH=/tmp/site:src:tests python3 -m pytest -q tests/gpu

Without CUDA each one is collected and skipped (its module's `pytestmark`). With
`LORASWAP_GPU_EVIDENCE=FOLDER` set, what they measured is written there as JSON, one file per
check, at the session's end: the evidence BENCHMARKS.md's dated runs cite."""

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

EVIDENCE = "LORASWAP_GPU_EVIDENCE"


@pytest.fixture(scope="session")
def evidence() -> Iterator[Callable[[str, dict], None]]:
    """record(file name, row): a measured row, printed (`-s` shows it) and, with
    $LORASWAP_GPU_EVIDENCE set, written to that folder with the other rows of its file."""
    rows: dict[str, list[dict]] = {}

    def record(name: str, row: dict) -> None:
        print(name, json.dumps(row), flush=True)
        rows.setdefault(name, []).append(row)

    yield record
    if folder := os.environ.get(EVIDENCE):
        Path(folder).mkdir(parents=True, exist_ok=True)
        for name, kept in rows.items():
            (Path(folder) / name).write_text(json.dumps(kept, indent=1))
