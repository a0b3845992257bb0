"""Video jobs across restarts: a new `VideoStore` on the same state folder finds the completed
jobs with the same bytes until their TTL (counted from completion) runs out, makes the
interrupted ones again (or fails them with the code server_restarted), removes expired jobs,
sets aside files of no job, and recovers from a corrupt database (every job rebuilt from its
record), a missing MP4, an unreadable row and an unusable folder. Through the routes:
`test_video_state_routes.py`, `test_video_tampering.py`."""

import asyncio
import hashlib
import logging
import sqlite3

import pytest
from PIL import Image
from support.fakes import frame_red

from loraswap.engine.engine import GenerateResult
from loraswap.engine.request import GenerateRequest
from loraswap.errors import AdapterNotFound
from loraswap.server.auth import key_digest
from loraswap.server.config import ServerConfig
from loraswap.server.videos import store as videos
from loraswap.server.videos.state import ADDED_COLUMNS, COLUMNS
from loraswap.server.videos.store import VideoNotFound, VideoStatus, VideoStore

REQUEST = GenerateRequest(prompt="a fox running", negative_prompt="blur", steps=3, guidance=4.5, width=16,
                          height=16, seed=7, loras=[("styles/anime", 0.8)], frames=3, output="video", max_frames=121)


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def video_result(n: int = 3) -> GenerateResult:
    frames = [Image.new("RGB", (16, 16), (frame_red(i), 120, 60)) for i in range(n)]
    return GenerateResult(frames[0], 0, 0.0, 0.01, frames=frames, fps=8)


async def makes(job):
    return video_result()


async def hangs(job):
    await asyncio.Event().wait()


async def settle(job) -> None:
    await asyncio.wait_for(asyncio.shield(job.task), 10)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def files(folder) -> list[str]:
    return sorted(path.name for path in (folder / "videos").iterdir())


def restart(store: VideoStore, clock=None, **config) -> VideoStore:
    """A new store on the old one's folder (the old one's tasks cancelled, as a crash ends them)."""
    return VideoStore(store.config.model_copy(update=config), clock or store.clock)


# ---------------------------------------------------------------- completed jobs
def test_a_completed_job_survives_a_restart_with_the_same_bytes_until_its_ttl(tmp_path):
    clock = Clock()

    async def scenario():
        store = VideoStore(ServerConfig(state_dir=tmp_path, video_ttl_s=60), clock)
        job = store.submit(REQUEST, "styles/anime:0.8", 4, makes, "fake")
        clock.now += 5
        await settle(job)
        before = (sha(job.mp4), job.view())
        await store.stop()
        clock.now += 50  # down 50 s: 10 s of its 60 left
        again = restart(store)
        kept = again.completed(job.id)
        after = (sha(kept.mp4), kept.view())
        thumbnail = kept.thumbnail.getpixel((0, 0))
        clock.now += 10
        with pytest.raises(VideoNotFound, match="expired"):
            again.get(job.id)
        await again.stop()
        return before, after, thumbnail

    before, after, thumbnail = asyncio.run(scenario())
    assert after == before, "same bytes, same Video object"
    assert (after[1]["completed_at"], after[1]["expires_at"], after[1]["seconds"]) == (1005, 1065, "0.75")
    assert thumbnail == (frame_red(0), 120, 60), "the first frame, lossless"
    assert files(tmp_path) == [], "the expired job's files are removed"


def test_expired_jobs_are_removed_and_files_of_no_job_set_aside_at_start_and_removed_by_the_sweeper(
        tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(videos, "SWEEP_EVERY_S", 0.01)

    async def scenario():
        store = VideoStore(ServerConfig(state_dir=tmp_path, video_ttl_s=60), clock)
        expiring, kept = store.submit(REQUEST, "m", None, makes), None
        await settle(expiring)
        clock.now += 30
        kept = store.submit(REQUEST, "m", None, makes)
        await settle(kept)
        await store.stop()
        for name in ("video_gone.mp4", "video_gone.png", f"{kept.id}.mp4.part"):  # a crash's leftovers
            (tmp_path / "videos" / name).write_bytes(b"x")
        clock.now += 31  # the first expired while the server was down
        again = restart(store)
        at_start = (files(tmp_path), len(again), sorted(p.name for p in (tmp_path / "orphans").iterdir()))
        again.start()
        running = again.submit(REQUEST, "m", None, hangs)
        for name in ("video_late.mp4", f"{running.id}.mp4.part"):  # deleted meanwhile; being written
            (tmp_path / "videos" / name).write_bytes(b"x")
        await asyncio.sleep(0.2)
        swept = files(tmp_path)
        await again.stop()
        return kept.id, running.id, at_start, swept

    kept, running, at_start, swept = asyncio.run(scenario())
    # at a start, a file of no job is kept aside, never deleted; a crash's .part file is removed
    assert at_start == ([f"{kept}.json", f"{kept}.mp4", f"{kept}.png"], 1, ["video_gone.mp4", "video_gone.png"])
    assert swept == sorted([f"{kept}.json", f"{kept}.mp4", f"{kept}.png", f"{running}.json",
                            f"{running}.mp4.part"]), "a running job's files are kept"


def test_delete_removes_the_row_and_the_files(tmp_path):
    async def scenario():
        store = VideoStore(ServerConfig(state_dir=tmp_path), Clock())
        job = store.submit(REQUEST, "m", None, makes)
        await settle(job)
        written = files(tmp_path)
        store.delete(job.id)
        await store.stop()
        again = restart(store)
        found = len(again)
        await again.stop()
        return job.id, written, found

    video_id, written, found = asyncio.run(scenario())
    assert written == [f"{video_id}.json", f"{video_id}.mp4", f"{video_id}.png"]
    assert (files(tmp_path), found) == ([], 0)


def test_a_jobs_owner_is_the_same_after_a_restart_and_names_no_key(tmp_path):
    """The owner secret is made once and kept (owner-only): a key's jobs stay its own after a
    restart, and another key's digest differs."""
    async def scenario():
        first = VideoStore(ServerConfig(state_dir=tmp_path), Clock())
        owners = (key_digest(first.state.owner_secret, b"key-a"), key_digest(first.state.owner_secret, b"key-b"))
        await first.stop()
        again = restart(first)
        owner_again = key_digest(again.state.owner_secret, b"key-a")
        await again.stop()
        return owners, owner_again

    (owner_a, owner_b), owner_again = asyncio.run(scenario())
    assert owner_a == owner_again and owner_a != owner_b
    assert "key-a" not in owner_a and owner_a != hashlib.sha256(b"key-a").hexdigest()[:32]
    assert (tmp_path / "owner-secret").stat().st_mode & 0o777 == 0o600


# ---------------------------------------------------------------- interrupted jobs
def test_an_interrupted_job_is_made_again_with_the_same_request_after_a_restart(tmp_path):
    made = []

    async def records(job):
        made.append((job.request, job.target, job.fps, job.model))
        return video_result()

    async def scenario():
        store = VideoStore(ServerConfig(state_dir=tmp_path), Clock())
        job = store.submit(REQUEST, "styles/anime:0.8", 4, hangs, "fake")
        await asyncio.sleep(0)
        await store.stop()  # the job dies with the server
        again = restart(store)
        waiting = again.get(job.id).status
        await again.resume(records)
        await settle(again.get(job.id))
        done = again.get(job.id)
        await again.stop()
        return waiting, done

    waiting, done = asyncio.run(scenario())
    assert (waiting, done.status, done.attempts, done.id.startswith("video_")) == (
        VideoStatus.QUEUED, VideoStatus.COMPLETED, 2, True)
    assert made == [(REQUEST, "fake", 4, "styles/anime:0.8")], "every field of the request, the model and fps"


@pytest.mark.parametrize("case,phrase", [
    ("resume off", "resuming is off (--no-resume-videos)"),
    ("second restart", "it was being made again after an earlier restart; it is not made a third time"),
    ("fails again", "making it again failed: adapter 'nope': gone. Check the id"),
])
def test_a_job_not_made_again_fails_saying_the_server_restarted(tmp_path, case, phrase):
    async def fails(job):
        raise AdapterNotFound("nope", "gone", "Check the id")

    async def scenario():
        store = VideoStore(ServerConfig(state_dir=tmp_path), Clock())
        job = store.submit(REQUEST, "m", None, hangs)
        await store.stop()
        store = restart(store, resume_videos=case != "resume off")
        if case == "second restart":
            await store.resume(hangs)
            await store.stop()
            store = restart(store)
        if case == "fails again":
            await store.resume(fails)
            await settle(store.get(job.id))
        failed = store.get(job.id)
        await store.stop()
        return failed

    failed = asyncio.run(scenario())
    assert failed.status is VideoStatus.FAILED and failed.view()["expires_at"] is not None
    assert failed.error["code"] == "server_restarted"
    assert failed.error["message"] == f"the server restarted while this video was being made, and {phrase}"


class Loading:
    """A backend that serves (or fails to load) once `done` is set."""

    def __init__(self, load_error=None):
        self.done, self.error = asyncio.Event(), load_error

    def ready_info(self):
        return {"model": "fake"} if self.done.is_set() and not self.error else None

    @property
    def load_error(self):
        return self.error if self.done.is_set() else None


@pytest.mark.parametrize("load_error", [None, "no such model"])
def test_interrupted_jobs_wait_for_the_backend_then_run_or_fail(tmp_path, load_error):
    async def scenario():
        store = VideoStore(ServerConfig(state_dir=tmp_path), Clock())
        job = store.submit(REQUEST, "m", None, hangs)
        await store.stop()
        again, backend = restart(store), Loading(load_error)
        again.start(makes, backend)
        await asyncio.sleep(0.5)
        waited = again.get(job.id).status
        backend.done.set()
        await asyncio.sleep(0.5)
        job = again.get(job.id)
        if job.task is not None:
            await settle(job)
        await again.stop()
        return waited, job

    waited, job = asyncio.run(scenario())
    assert waited is VideoStatus.QUEUED, "nothing runs before the backend serves"
    if load_error:
        assert job.error == {"code": "server_restarted", "message": "the server restarted while this video was "
                             "being made, and the model failed to load: no such model"}
    else:
        assert job.status is VideoStatus.COMPLETED


# ---------------------------------------------------------------- a corrupt or unusable state
def _another_programs_database(path, data: bytes) -> None:
    path.unlink()
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE videos (name, length)")


DAMAGE = {"garbage": lambda path, data: path.write_bytes(b"not a database " * 100),
          "header cut": lambda path, data: path.write_bytes(data[:50]),
          "half": lambda path, data: path.write_bytes(data[:len(data) // 2]),
          "emptied": lambda path, data: path.write_bytes(b""),
          "another program's": _another_programs_database}


@pytest.mark.parametrize("damage", ["garbage", pytest.param("header cut", marks=pytest.mark.slow),
                                    pytest.param("half", marks=pytest.mark.slow), "emptied", "another program's"])
def test_a_corrupt_database_is_moved_aside_and_every_job_is_rebuilt_from_its_record(tmp_path, damage, caplog):
    """Truncated, garbled or replaced: no job is lost. The completed ones are served with the
    same bytes and Video object, the interrupted one is made again."""
    async def scenario():
        store = VideoStore(ServerConfig(state_dir=tmp_path), Clock())
        done = []
        for i in range(12):
            job = store.submit(REQUEST, "m", None, makes, owner=f"owner-{i % 2}")
            await settle(job)
            done.append((job.id, sha(job.mp4), job.view()))
        held = store.submit(REQUEST, "m", None, hangs)
        await store.stop()
        database = tmp_path / "videos.sqlite3"
        DAMAGE[damage](database, database.read_bytes())
        again = restart(store)
        found = len(again), again.get(held.id).status
        after = [(job.id, sha(job.mp4), job.view()) for job in (again.completed(i, f"owner-{n % 2}")
                                                                for n, (i, _, _) in enumerate(done))]
        await again.resume(makes)
        await settle(again.get(held.id))
        new = again.submit(REQUEST, "m", None, makes)
        await settle(new)
        await again.stop()
        return done, found, after, again.get(held.id).status, new

    with caplog.at_level(logging.WARNING, logger="loraswap.server"):
        done, found, after, resumed, new = asyncio.run(scenario())
    assert found == (13, VideoStatus.QUEUED) and after == done, "every job back, the same bytes and object"
    assert (resumed, new.status) == (VideoStatus.COMPLETED, VideoStatus.COMPLETED)
    assert "rebuilt 13 videos from their records" in caplog.text
    if damage != "emptied":  # an empty file is an empty database: nothing to move aside
        assert len(list(tmp_path.glob("videos.sqlite3.corrupt-*"))) == 1
        assert "cannot be read" in caplog.text and "moved to videos.sqlite3.corrupt-" in caplog.text
    assert len(files(tmp_path)) == 14 * 3 and not (tmp_path / "orphans").exists(), "no file removed or set aside"


def test_a_missing_mp4_fails_that_job_and_an_unreadable_row_is_rebuilt_from_its_record(tmp_path, caplog):
    async def scenario():
        store = VideoStore(ServerConfig(state_dir=tmp_path), Clock())
        lost, kept, unreadable = (store.submit(REQUEST, "m", None, makes) for _ in range(3))
        for job in (lost, kept, unreadable):
            await settle(job)
        await store.stop()
        (tmp_path / "videos" / f"{lost.id}.mp4").unlink()
        with sqlite3.connect(tmp_path / "videos.sqlite3") as db:
            db.execute("UPDATE videos SET request = '{' WHERE id = ?", (unreadable.id,))
        again = restart(store)
        result = (again.get(lost.id), again.completed(kept.id).mp4 == kept.mp4, len(again),
                  again.completed(unreadable.id).mp4 == unreadable.mp4, unreadable.id)
        await again.stop()
        return result

    with caplog.at_level(logging.WARNING, logger="loraswap.server"):
        lost, kept_same, found, rebuilt_same, unreadable = asyncio.run(scenario())
    assert lost.status is VideoStatus.FAILED and lost.error["code"] == "video_lost" and kept_same and found == 3
    assert f"video {lost.id} failed: its MP4 is missing" in caplog.text
    assert f"dropping video '{unreadable}': its row in the state folder cannot be read" in caplog.text
    assert rebuilt_same and f"rebuilt 1 videos from their records in {tmp_path / 'videos'}" in caplog.text


def test_a_state_folder_another_server_holds_is_not_shared(tmp_path, caplog):
    async def scenario():
        first = VideoStore(ServerConfig(state_dir=tmp_path), Clock())
        with caplog.at_level(logging.WARNING, logger="loraswap.server"):
            second = VideoStore(ServerConfig(state_dir=tmp_path), Clock())
        job = second.submit(REQUEST, "m", None, makes)
        await settle(job)
        folder = second.state.folder
        await second.stop()
        await first.stop()
        return folder, job

    folder, job = asyncio.run(scenario())
    assert folder != tmp_path and not folder.exists(), "a temporary folder, removed at stop"
    assert job.status is VideoStatus.COMPLETED and files(tmp_path) == []
    assert "lost at a restart" in caplog.text and "give each server its own --state-dir" in caplog.text
    assert [r.levelname for r in caplog.records] == ["WARNING"], "it serves on: a warning, no error"


def test_a_state_folder_that_cannot_be_made_does_not_stop_the_start(tmp_path, caplog):
    (tmp_path / "a-file").write_text("not a folder")

    async def scenario():
        with caplog.at_level(logging.ERROR, logger="loraswap.server"):
            store = VideoStore(ServerConfig(state_dir=tmp_path / "a-file"), Clock())
        job = store.submit(REQUEST, "m", None, makes)
        await settle(job)
        temporary = store.state.temporary
        await store.stop()
        return job, temporary

    job, temporary = asyncio.run(scenario())
    assert temporary and job.status is VideoStatus.COMPLETED and "lost at a restart" in caplog.text


def test_a_database_from_before_jobs_had_owners_is_read_and_written(tmp_path):
    """A row an earlier version wrote (no `owner` column) is everyone's job; new rows keep their owner."""
    old_columns = [c for c in COLUMNS if c not in ADDED_COLUMNS]  # owner, urls, ...: all added since
    db = sqlite3.connect(tmp_path / "videos.sqlite3")
    db.execute(f"CREATE TABLE videos ({', '.join(old_columns)}, PRIMARY KEY (id))")
    row = {"id": "video_" + "0" * 32, "request": REQUEST.model_dump_json(), "model": "m", "target": None, "fps": 8,
           "created_at": 1000.0, "finished_at": 1000.0, "expires_at": 9e9, "error": '{"code": "x", "message": "y"}',
           "seconds": "auto", "size": "auto", "attempts": 1}
    db.execute(f"INSERT INTO videos VALUES ({', '.join('?' * len(old_columns))})", [row[c] for c in old_columns])
    db.commit()
    db.close()

    async def scenario():
        store = VideoStore(ServerConfig(state_dir=tmp_path), Clock())
        assert store.get(row["id"], owner="anyone").error == {"code": "x", "message": "y"}
        mine = store.submit(REQUEST, "m", None, makes, owner="owner-a")
        await settle(mine)
        await store.stop()
        again = VideoStore(ServerConfig(state_dir=tmp_path), Clock())
        assert again.get(mine.id, "owner-a").owner == "owner-a"
        with pytest.raises(VideoNotFound):
            again.get(mine.id, "owner-b")
        await again.stop()

    asyncio.run(scenario())
