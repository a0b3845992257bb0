"""Kept adapters survive a restart: recorded in the state folder when kept, dropped when
evicted, kept again in the background once the model serves; a record that cannot be
read, or an adapter that is gone, never stops the server."""

import logging
import os
import time

from fastapi.testclient import TestClient
from support.servers import wait_ready

from loraswap.engine.config.engine import EngineConfig
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig
from loraswap.server.kept_adapters import RECORD, KeptAdapters


def _serving(folder, state):
    client = TestClient(create_app(ServerConfig(engines=[EngineConfig(model="tiny-sd", adapters=folder)],
                                                state_dir=state)))
    client.__enter__()
    wait_ready(client, 60)
    return client


def _record_settles(client, expected: list[str], timeout: float = 30) -> list[str]:
    """The server's record of kept adapters once it is `expected` (the background keeping has
    dropped what it could not keep), or as it is at `timeout`."""
    deadline = time.monotonic() + timeout
    while client.app.state.kept.ids() != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return client.app.state.kept.ids()


def test_the_record_is_written_whole_and_an_unreadable_one_starts_afresh(tmp_path, caplog):
    record = KeptAdapters(tmp_path)
    record.add("a")
    record.add("b")
    record.add("a")
    record.remove("b")
    assert KeptAdapters(tmp_path).ids() == ["a"] and not list(tmp_path.glob("*.part"))
    (tmp_path / RECORD).write_text("{not json")
    with caplog.at_level(logging.ERROR, logger="loraswap.server"):
        assert KeptAdapters(tmp_path).ids() == []
    assert "unreadable" in caplog.text


def test_a_record_that_is_a_link_or_a_fifo_is_not_read(tmp_path, caplog):
    """The state folder's record is read as every state file is: never through a link (to a file
    elsewhere), never a FIFO that would block the start."""
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text('["from-elsewhere"]')
    state = tmp_path / "state"
    state.mkdir()
    (state / RECORD).symlink_to(elsewhere)
    with caplog.at_level(logging.ERROR, logger="loraswap.server"):
        assert KeptAdapters(state).ids() == []
        (state / RECORD).unlink()
        os.mkfifo(state / RECORD)
        assert KeptAdapters(state).ids() == []
    assert caplog.text.count("unreadable") == 2


def test_kept_adapters_are_kept_again_after_a_restart(adapter_factory, tmp_path, caplog):
    folder = tmp_path / "adapters"
    adapter_factory("keep-me", "tiny-sd", rank=4, seed=71, folder=folder)
    adapter_factory("gone-later", "tiny-sd", rank=4, seed=72, folder=folder)
    adapter_factory("evicted", "tiny-sd", rank=4, seed=73, folder=folder)
    first = _serving(folder, tmp_path / "state")
    for adapter_id in ("keep-me", "gone-later", "evicted"):
        assert first.post(f"/adapters/{adapter_id}/load").status_code == 200
    assert first.delete("/adapters/evicted").status_code == 200
    first.__exit__(None, None, None)
    (folder / "gone-later.safetensors").unlink()
    with caplog.at_level(logging.WARNING, logger="loraswap.server"):
        second = _serving(folder, tmp_path / "state")
        try:
            assert _record_settles(second, ["keep-me"]) == ["keep-me"]
            kept = {row["id"] for row in second.get("/adapters").json()["adapters"] if row["kept"]}
            assert kept == {"keep-me"}
        finally:
            second.__exit__(None, None, None)
    assert "could not keep gone-later again" in caplog.text
    assert KeptAdapters(tmp_path / "state").ids() == ["keep-me"], "the adapter that is gone left the record"
