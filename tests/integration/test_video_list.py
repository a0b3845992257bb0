"""`GET /v1/videos` with the real `openai` client (`videos.list(after=, limit=, order=)`), against
a real server on loopback over a FakeBackend with two API keys: pages follow one another
without a gap or a repeat in either order, even when the job a page ended on is gone before
the next is asked for; each key lists only its own jobs (not those made while the server had
no keys); bad paging is refused with 400; and a polled job shows its denoising step, total
steps and elapsed time beside `progress`, which the client parses."""

import time

import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from support.fakes import fake_app, serve_on_loopback
from support.servers import form

KEYS = ("sk-list-a", "sk-list-b")


@pytest.fixture(scope="module")
def listing(tmp_path_factory):
    """The server, a client per key, and the ids key A made (oldest first), all completed."""
    app, backend = fake_app(api_keys=list(KEYS), state_dir=tmp_path_factory.mktemp("state"))
    with serve_on_loopback(app) as url:
        a, b = (OpenAI(base_url=url + "/v1", api_key=key, max_retries=0) for key in KEYS)
        made = [a.videos.create_and_poll(prompt=f"fox {i}", extra_body={"frames": 2}, poll_interval_ms=20).id
                for i in range(5)]  # one at a time: a key has at most 4 unfinished
        yield a, b, made, backend


def test_pages_of_two_cover_every_job_newest_first_then_oldest_first(listing):
    a, b, made, backend = listing
    first = a.videos.list(limit=2)
    assert [v.id for v in first.data] == made[::-1][:2] and first.has_more is True
    assert first.last_id == made[3] and first.to_dict()["first_id"] == made[4] and first.object == "list"
    pages = list(first.iter_pages())
    assert [len(page.data) for page in pages] == [2, 2, 1] and pages[-1].has_more is False
    assert [v.id for v in a.videos.list(limit=2)] == made[::-1], "auto-paging: every job once, newest first"
    assert [v.id for v in a.videos.list(limit=2, order="asc")] == made
    assert [v.id for v in a.videos.list(after=made[1], order="asc")] == made[2:]
    assert [v.id for v in a.videos.list(after=made[1])] == made[:1]
    assert all(v.object == "video" and v.prompt.startswith("fox ") for v in a.videos.list())


def test_another_key_sees_none_of_them_and_only_its_own(listing):
    a, b, made, backend = listing
    assert b.videos.list().data == [] and b.videos.list().has_more is False
    own = b.videos.create(prompt="b's fox", extra_body={"frames": 2})
    try:
        assert [v.id for v in b.videos.list()] == [own.id]
        assert own.id not in [v.id for v in a.videos.list()]
        # another key's id places a page by the time it carries, as a gone job's does: it lists
        # this key's own jobs alone, and says nothing of whether that job is still kept
        assert [v.id for v in b.videos.list(after=made[0], order="asc")] == [own.id]
        assert [v.id for v in b.videos.list(after=made[0])] == []
    finally:
        b.videos.delete(own.id)


def test_a_page_follows_a_job_that_went_since_the_page_before(listing):
    """The job a page ended on, deleted (or expired) before the next page is asked for: the
    next page still starts right after where it was, so the client's auto-paging loses nothing."""
    a, b, made, backend = listing
    own = [b.videos.create_and_poll(prompt=f"b's fox {i}", extra_body={"frames": 2}, poll_interval_ms=20).id
           for i in range(4)]
    try:
        for order in ("desc", "asc"):
            ids = own[::-1] if order == "desc" else list(own)
            first = b.videos.list(limit=2, order=order)
            assert [v.id for v in first.data] == ids[:2] and first.last_id == ids[1]
            b.videos.delete(first.last_id)
            own.remove(first.last_id)
            rest = b.videos.list(limit=2, order=order, after=first.last_id)
            assert [v.id for v in rest.data] == ids[2:] and rest.has_more is False
    finally:
        for video_id in own:
            b.videos.delete(video_id)


@pytest.mark.parametrize("query", [{"limit": 0}, {"limit": 101}, {"order": "sideways"}, {"after": "video_nope"},
                                   {"after": "video_" + "0" * 32}, {"after": "video_" + "f" * 32}])
def test_bad_paging_is_refused_with_400(listing, query):
    """A cursor that is no id, or an id that carries no time (made before ids carried one) and
    names no job kept: 400, naming it."""
    a, b, made, backend = listing
    with pytest.raises(openai.BadRequestError) as refused:
        a.videos.list(**query)
    if "after" in query:
        assert f"after: {query['after']!r} is no video id of this server's" in str(refused.value)


def test_a_job_made_while_the_server_had_no_keys_is_no_keys_to_list(tmp_path):
    app, backend = fake_app(state_dir=tmp_path)
    with TestClient(app) as client:
        made = client.post("/v1/videos", files=form(prompt="a fox", frames=2)).json()["id"]
        deadline = time.monotonic() + 10
        while client.get(f"/v1/videos/{made}").json()["status"] != "completed":
            assert time.monotonic() < deadline, "the job never completed"
            time.sleep(0.01)
        assert [job["id"] for job in client.get("/v1/videos").json()["data"]] == [made], "no keys: every job"
    app, backend = fake_app(state_dir=tmp_path, api_keys=[KEYS[0]])
    with TestClient(app) as client:
        listed = client.get("/v1/videos", headers={"authorization": f"Bearer {KEYS[0]}"}).json()
    assert listed["data"] == [] and listed["has_more"] is False


def test_a_polled_job_shows_its_step_total_steps_and_elapsed_seconds(listing):
    a, b, made, backend = listing
    backend.hold_before_step = 2  # steps 1 and 2 of 4 done, then it waits
    try:
        video = a.videos.create(prompt="a counted fox", extra_body={"frames": 2, "num_inference_steps": 4})
        assert video.to_dict()["step"] == 0 and video.to_dict()["total_steps"] == 4  # asked, before a step
        for _ in range(500):
            polled = a.videos.retrieve(video.id)
            if polled.status == "in_progress" and polled.to_dict()["step"] == 2:
                break
            time.sleep(0.01)
        else:
            raise AssertionError(f"the job never reached step 2: {polled}")
        time.sleep(0.2)
        held = a.videos.retrieve(video.id).to_dict()
    finally:
        backend.hold_before_step = None
        backend.resume.set()
    for _ in range(500):
        done = a.videos.retrieve(video.id)
        if done.status == "completed":
            break
        time.sleep(0.01)
    backend.resume.clear()
    assert done.status == "completed", done
    assert (held["status"], held["progress"], held["step"], held["total_steps"]) == ("in_progress", 50, 2, 4)
    assert held["elapsed_s"] >= 0.2
    finished = done.to_dict()
    assert (finished["step"], finished["total_steps"], finished["progress"]) == (4, 4, 100)
    assert finished["elapsed_s"] == a.videos.retrieve(video.id).to_dict()["elapsed_s"], "fixed once finished"
    assert [v.id for v in a.videos.list(limit=1).data] == [video.id], "listed too, the newest"
    a.videos.delete(video.id)
