"""A damaged or tampered state folder, through the routes and the app's lifespan: a corrupt or
replaced database and rows changed by hand cost no video (each job is rebuilt from its
record, or its files are kept aside), an id with a pattern reaches no file, the folder's own
links are never followed, and a damaged owner secret is written again from its copy."""

import hashlib
import logging
import sqlite3
import time

import pytest
from fastapi.testclient import TestClient
from support.fakes import fake_app
from support.servers import form

KEY = "key-1"
AUTH = {"authorization": f"Bearer {KEY}"}


def files(folder) -> list[str]:
    return sorted(path.name for path in folder.iterdir()) if folder.exists() else []


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _made(client, prompt: str = "a fox") -> dict:
    video = client.post("/v1/videos", files=form(prompt=prompt, frames=2), headers=AUTH).json()
    deadline = time.monotonic() + 10
    while (view := client.get(f"/v1/videos/{video['id']}", headers=AUTH).json())["status"] not in (
            "completed", "failed"):
        assert time.monotonic() < deadline, view
        time.sleep(0.01)
    return view


def _first_server(state, count: int) -> dict[str, bytes]:
    """`count` completed videos of KEY's: {id: MP4 bytes}."""
    app, _ = fake_app(state_dir=state, api_keys=[KEY])
    with TestClient(app) as client:
        made = [_made(client, f"a fox {i}")["id"] for i in range(count)]
        return {video_id: client.get(f"/v1/videos/{video_id}/content", headers=AUTH).content for video_id in made}


def _served(client, video_id: str) -> tuple[int, int, bytes]:
    polled = client.get(f"/v1/videos/{video_id}", headers=AUTH)
    content = client.get(f"/v1/videos/{video_id}/content", headers=AUTH)
    return polled.status_code, content.status_code, content.content


def _still_serves(client) -> bool:
    return _made(client, "after")["status"] == "completed" and client.get("/health").status_code == 200


def _damage(database, how: str) -> None:
    data = database.read_bytes()
    if how == "truncated":
        database.write_bytes(data[:len(data) // 3])
    elif how == "garbled":
        database.write_bytes(data[:100] + bytes(b ^ 0x5A for b in data[100:]))
    elif how == "emptied":
        database.write_bytes(b"")
    else:  # replaced by another program's database
        database.unlink()
        with sqlite3.connect(database) as db:
            db.execute("CREATE TABLE videos (name, length)")


@pytest.mark.parametrize("how", ["truncated", "garbled", "emptied", "replaced"])
def test_a_corrupt_database_costs_no_video(tmp_path, how, caplog):
    """4 completed videos, the database damaged, a restart: all 4 served with the same bytes."""
    made = _first_server(tmp_path, 4)
    _damage(tmp_path / "videos.sqlite3", how)
    app, _ = fake_app(state_dir=tmp_path, api_keys=[KEY])
    with caplog.at_level(logging.WARNING, logger="loraswap.server"), TestClient(app) as client:
        served = {video_id: _served(client, video_id) for video_id in made}
        serves = _still_serves(client)
    assert served == {video_id: (200, 200, mp4) for video_id, mp4 in made.items()}
    assert "rebuilt 4 videos from their records" in caplog.text and serves
    assert not (tmp_path / "orphans").exists()


TAMPERED = ["error = 5", "error = '5'", "created_at = 'abc'", "expires_at = 'abc'", "finished_at = NULL",
            "fps = 1.5", "owner = 7", "request = json_set(request, '$.loras', json('[[\"../etc\", 1.0]]'))"]


@pytest.mark.parametrize("change", TAMPERED)
@pytest.mark.parametrize("record", ["kept", "lost too"])
def test_a_row_changed_by_hand_is_dropped_with_a_log_line_and_never_a_500(tmp_path, change, record, caplog):
    """Its job is rebuilt from its record; without one, its files are kept aside and it is a 404."""
    (video_id, mp4), (other, other_mp4) = _first_server(tmp_path, 2).items()
    with sqlite3.connect(tmp_path / "videos.sqlite3") as db:
        db.execute(f"UPDATE videos SET {change} WHERE id = ?", (video_id,))
    if record == "lost too":
        (tmp_path / "videos" / f"{video_id}.json").unlink()
    app, _ = fake_app(state_dir=tmp_path, api_keys=[KEY])
    with caplog.at_level(logging.WARNING, logger="loraswap.server"), TestClient(app) as client:
        served, kept = _served(client, video_id), _served(client, other)
        serves = _still_serves(client)
    assert f"dropping video '{video_id}': its row in the state folder cannot be read" in caplog.text
    assert kept == (200, 200, other_mp4) and serves
    if record == "kept":
        assert served == (200, 200, mp4), "rebuilt from its record: the same bytes"
    else:
        assert served[:2] == (404, 404)
        assert files(tmp_path / "orphans") == [f"{video_id}.mp4", f"{video_id}.png"], "kept aside, not deleted"
        assert f"moved 2 files of no video from {tmp_path / 'videos'}" in caplog.text


def test_an_id_with_a_pattern_reaches_no_file(tmp_path, caplog):
    """A row whose id became `video_*` is dropped (its job rebuilt from its record under its own
    id); DELETE of `video_*` is a 404 that removes nothing."""
    (video_id, mp4), (other, other_mp4) = _first_server(tmp_path, 2).items()
    with sqlite3.connect(tmp_path / "videos.sqlite3") as db:
        db.execute("UPDATE videos SET id = 'video_*' WHERE id = ?", (video_id,))
    before = files(tmp_path / "videos")
    app, _ = fake_app(state_dir=tmp_path, api_keys=[KEY])
    with caplog.at_level(logging.WARNING, logger="loraswap.server"), TestClient(app) as client:
        deletes = [client.delete(f"/v1/videos/{name}", headers=AUTH) for name in ("video_*", "video_%2A", "*")]
        served = _served(client, video_id), _served(client, other)
        left = files(tmp_path / "videos")
        serves = _still_serves(client)
    assert [r.status_code for r in deletes] == [404, 404, 404]
    assert "no video 'video_*'" in deletes[0].json()["error"]["message"]
    assert "dropping video 'video_*': its row in the state folder cannot be read" in caplog.text
    assert left == before and served == ((200, 200, mp4), (200, 200, other_mp4)) and serves


def test_a_videos_folder_that_is_a_link_is_not_followed(tmp_path, caplog):
    """A start finds `videos/` linking elsewhere: nothing there is read, moved or deleted; the
    server keeps its jobs in a temporary folder, says so, and serves."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "foreign.txt").write_text("not the server's")
    (elsewhere / "video_0123456789abcdef0123456789abcdef.mp4").write_bytes(b"not the server's either")
    state = tmp_path / "state"
    state.mkdir()
    (state / "videos").symlink_to(elsewhere, target_is_directory=True)
    app, _ = fake_app(state_dir=state, api_keys=[KEY])
    with caplog.at_level(logging.ERROR, logger="loraswap.server"), TestClient(app) as client:
        serves = _still_serves(client)
    assert files(elsewhere) == ["foreign.txt", "video_0123456789abcdef0123456789abcdef.mp4"] and serves
    assert (elsewhere / "foreign.txt").read_text() == "not the server's"
    assert f"{state / 'videos'} is a link, and the state folder's own files are never reached through one" in (
        caplog.text) and "lost at a restart" in caplog.text


@pytest.mark.parametrize("name", ["videos.sqlite3", "owner-secret", "kept-adapters.json", "lock"])
def test_no_file_of_the_state_folder_is_reached_through_a_link(tmp_path, name, caplog):
    foreign = tmp_path / "foreign"
    foreign.write_bytes(b"a file of the host's")
    state = tmp_path / "state"
    _first_server(state, 1)
    (state / name).unlink(missing_ok=True)
    (state / name).symlink_to(foreign)
    app, _ = fake_app(state_dir=state, api_keys=[KEY])
    with caplog.at_level(logging.ERROR, logger="loraswap.server"), TestClient(app) as client:
        serves = _still_serves(client)
    assert foreign.read_bytes() == b"a file of the host's" and (state / name).is_symlink() and serves
    assert f"{state / name} is a link" in caplog.text and "lost at a restart" in caplog.text


def test_an_mp4_that_is_a_link_is_never_served_nor_its_target_touched(tmp_path, caplog):
    (video_id, _), = _first_server(tmp_path, 1).items()
    secret = tmp_path / "secret.txt"
    secret.write_text("a file of the host's")
    mp4 = tmp_path / "videos" / f"{video_id}.mp4"
    mp4.unlink()
    mp4.symlink_to(secret)
    app, _ = fake_app(state_dir=tmp_path, api_keys=[KEY])
    with caplog.at_level(logging.WARNING, logger="loraswap.server"), TestClient(app) as client:
        polled, content, body = _served(client, video_id)
        serves = _still_serves(client)
    assert (polled, content) == (200, 409) and b"host's" not in body and serves
    assert "its MP4 is missing" in caplog.text
    assert secret.read_text() == "a file of the host's" and (tmp_path / "orphans" / mp4.name).is_symlink()


@pytest.mark.parametrize("damage", [b"", b"short"])
def test_a_damaged_owner_secret_is_written_again_from_its_copy(tmp_path, damage, caplog):
    (video_id, mp4), = _first_server(tmp_path, 1).items()
    secret = (tmp_path / "owner-secret").read_bytes()
    (tmp_path / "owner-secret").write_bytes(damage)
    app, _ = fake_app(state_dir=tmp_path, api_keys=[KEY])
    with caplog.at_level(logging.WARNING, logger="loraswap.server"), TestClient(app) as client:
        served = _served(client, video_id)
        serves = _still_serves(client)
    assert served == (200, 200, mp4) and serves, "still its owner's"
    assert (tmp_path / "owner-secret").read_bytes() == secret and len(secret) == 32
    assert (tmp_path / "owner-secret").stat().st_mode & 0o777 == 0o600
    assert "owner secret" in caplog.text and "was damaged: written again from its copy" in caplog.text


def test_an_owner_secret_lost_with_its_copy_is_made_anew_and_said(tmp_path, caplog):
    """Nothing can tell whose the old jobs were: they are no key's any more (404), and the log says so."""
    (video_id, _), = _first_server(tmp_path, 1).items()
    for name in ("owner-secret", "owner-secret.copy"):
        (tmp_path / name).write_bytes(b"")
    app, _ = fake_app(state_dir=tmp_path, api_keys=[KEY])
    with caplog.at_level(logging.WARNING, logger="loraswap.server"), TestClient(app) as client:
        polled = client.get(f"/v1/videos/{video_id}", headers=AUTH).status_code
        serves = _still_serves(client)
    assert polled == 404 and serves and len((tmp_path / "owner-secret").read_bytes()) == 32
    assert "is damaged and has no good copy: a new one is made" in caplog.text
