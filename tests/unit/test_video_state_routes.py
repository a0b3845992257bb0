"""Video jobs across restarts through the routes and the app's lifespan, in-process over a
FakeBackend: a completed video downloads with the same bytes from a new app on the same
state folder, an interrupted one is made again with its request, DELETE removes files, and
a full disk fails one job while the server keeps serving."""

import errno
import hashlib
import logging
import sqlite3
import time

from fastapi.testclient import TestClient
from support.fakes import fake_app

from loraswap.server.videos import state as video_state


def files(folder) -> list[str]:
    return sorted(path.name for path in (folder / "videos").iterdir())


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_full_disk_fails_the_job_clearly_and_the_server_keeps_serving(tmp_path, monkeypatch, caplog):
    def full(path, write, **options):
        raise OSError(errno.ENOSPC, "No space left on device")

    app, backend = fake_app(state_dir=tmp_path)
    with TestClient(app) as client, caplog.at_level(logging.ERROR, logger="loraswap.server"):
        with monkeypatch.context() as patch:
            patch.setattr(video_state, "write_whole", full)
            failed = _made(client)
        with monkeypatch.context() as patch:  # a row that cannot be written: the job goes on, not kept
            patch.setattr(video_state.VideoState, "save", _full_database)
            unsaved = _made(client)
        served = _made(client)
        content = client.get(f"/v1/videos/{served['id']}/content")
    assert failed["status"] == "failed" and failed["error"] == {
        "code": "state_write_failed", "message": "the server could not keep this video: writing it to its state "
        "folder failed ([Errno 28] No space left on device)"}
    assert (unsaved["status"], served["status"], content.status_code) == ("completed", "completed", 200)
    assert "is not kept across a restart" in caplog.text
    assert files(tmp_path) == sorted([f"{unsaved['id']}.mp4", f"{unsaved['id']}.png"]
                                     + [f"{served['id']}.{ext}" for ext in ("json", "mp4", "png")])


def _full_database(self, row):
    raise sqlite3.OperationalError("database or disk is full")


def _made(client) -> dict:
    video = client.post("/v1/videos", files={"prompt": (None, "a fox"), "frames": (None, "2")}).json()
    for _ in range(500):
        view = client.get(f"/v1/videos/{video['id']}").json()
        if view["status"] in ("completed", "failed"):
            return view
        time.sleep(0.01)
    raise AssertionError(view)


# ---------------------------------------------------------------- through the routes and the lifespan
def test_the_routes_find_a_completed_and_an_interrupted_job_after_a_restart(tmp_path):
    app, backend = fake_app(state_dir=tmp_path)
    with TestClient(app) as client:
        done = _made(client)
        mp4 = client.get(f"/v1/videos/{done['id']}/content").content
        backend.hold_before_step = 0
        fields = {"prompt": "a held fox", "model": "fake", "frames": "5", "num_inference_steps": "2", "seed": "9",
                  "guidance_scale": "3.5", "negative_prompt": "blur", "size": "32x16"}
        held = client.post("/v1/videos", files={k: (None, v) for k, v in fields.items()}).json()
    app, again = fake_app(state_dir=tmp_path)
    with TestClient(app) as client:
        same = client.get(f"/v1/videos/{done['id']}/content").content
        thumbnail = client.get(f"/v1/videos/{done['id']}/content", params={"variant": "thumbnail"})
        for _ in range(500):
            if client.get(f"/v1/videos/{held['id']}").json()["status"] == "completed":
                break
            time.sleep(0.01)
        resumed = client.get(f"/v1/videos/{held['id']}").json()
        assert client.delete(f"/v1/videos/{done['id']}").status_code == 200
        left = files(tmp_path)
    assert sha(same) == sha(mp4) and thumbnail.headers["content-type"] == "image/webp"
    assert resumed["status"] == "completed" and resumed["size"] == "32x16"
    assert [(r.prompt, r.frames, r.steps, r.seed, r.guidance, r.negative_prompt, r.width, r.height, model)
            for r, model in again.generated] == [("a held fox", 5, 2, 9, 3.5, "blur", 32, 16, "fake")]
    assert left == [f"{held['id']}.{ext}" for ext in ("json", "mp4", "png")], "DELETE removed the other's files"
