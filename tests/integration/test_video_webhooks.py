"""Video jobs' webhooks, against a real server on loopback (over a FakeBackend) and a receiver
on 127.0.0.1 (allowed by naming it): the job's end (completed, failed, deleted) calls it once
with Standard Webhooks' payload (`type`, `timestamp`, `data`: the job), signed as Standard
Webhooks specifies (checked with `standardwebhooks.Webhook(secret).verify`); a receiver
failing the first tries (an error, a timeout, a redirect) gets a later one, after a back-off
that doubles; a restart between the job's end and the delivery still delivers; a name that
rebinds to loopback is refused where the socket opens and given up at once; one host gets one
try at a time; the webhooks owed are capped per key and in all; logs never show a URL's path;
and URLs past the rules are refused when the job is made (400 naming the rule)."""

import base64
import socket
import sqlite3
import threading
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpcore
import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from openai.types import Video
from standardwebhooks import Webhook, WebhookVerificationError
from support.fakes import fake_app, serve_on_loopback
from support.servers import form

from loraswap.server.config import WebhookConfig
from loraswap.server.videos import webhooks
from loraswap.server.videos.state import VideoState

SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()


class Receiver:
    """A webhook receiver on 127.0.0.1: records each POST (body bytes, headers, when) and answers
    it by `script` (a status, or ("hang", seconds) before a 200), then 200 once the script is
    done; `most_at_once` is the most requests it was answering at one time."""

    def __init__(self, script=()):
        self.script, self.calls, self.at_once, self.most_at_once = list(script), [], 0, 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.lock:
                    receiver.calls.append({"path": self.path, "body": body, "headers": dict(self.headers),
                                           "at": time.monotonic()})
                    answer = receiver.script.pop(0) if receiver.script else 200
                    receiver.at_once += 1
                    receiver.most_at_once = max(receiver.most_at_once, receiver.at_once)
                try:
                    self._answer(answer)
                except (BrokenPipeError, ConnectionResetError):  # the server's try timed out and hung up first
                    pass
                finally:
                    with receiver.lock:
                        receiver.at_once -= 1

            def _answer(self, answer):
                if isinstance(answer, tuple):  # answer late: the server's try may time out first
                    time.sleep(answer[1])
                    answer = 200
                self.send_response(answer)
                if 300 <= answer < 400:
                    self.send_header("Location", "/elsewhere")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.origin = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.url = self.origin + "/hooks/video"
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()

    def wait_for(self, n: int, timeout: float = 20.0) -> list[dict]:
        """The calls once there are `n`; then a moment more, and not one more may have come."""
        deadline = time.monotonic() + timeout
        while len(self.calls) < n:
            assert time.monotonic() < deadline, f"{len(self.calls)} calls of {n}"
            time.sleep(0.01)
        time.sleep(0.3)
        assert len(self.calls) == n, f"{len(self.calls)} calls, {n} expected"
        return self.calls

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made = []

    def make(script=()):
        made.append(Receiver(script))
        return made[-1]

    yield make
    for one in made:
        one.close()


def hooked_app(tmp_path, api_keys=(), **webhook_settings):
    settings = {"secret": SECRET, "allow": ["127.0.0.1"], "retry_s": 0.05, **webhook_settings}
    return fake_app(state_dir=tmp_path, webhooks=WebhookConfig(**settings), api_keys=list(api_keys))


def verified(call: dict, secret: str = SECRET) -> dict:
    """The payload, once Standard Webhooks' reference check passed on the bytes received."""
    return Webhook(secret).verify(call["body"], call["headers"])


def openai_client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def settled(client: OpenAI, video_id: str) -> Video:
    for _ in range(1000):
        video = client.videos.retrieve(video_id)
        if video.status in ("completed", "failed"):
            return video
        time.sleep(0.01)
    raise AssertionError(video)


def logged(caplog, words: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while words not in caplog.text:
        assert time.monotonic() < deadline, f"never logged: {words}\n{caplog.text}"
        time.sleep(0.02)


# ---------------------------------------------------------------- delivered
def test_a_completed_job_calls_its_webhook_once_with_the_event_signed(tmp_path, receiver):
    hook = receiver()
    app, backend = hooked_app(tmp_path)
    with serve_on_loopback(app) as url:
        client = openai_client(url)
        made = client.videos.create(prompt="a fox", extra_body={"frames": 2, "webhook_url": hook.url})
        [call] = hook.wait_for(1)
        polled = settled(client, made.id)
    payload = verified(call)
    assert set(payload) == {"type", "timestamp", "data"} and payload["type"] == "video.completed"
    assert abs(datetime.fromisoformat(payload["timestamp"]).timestamp() - polled.completed_at) < 1
    assert payload["timestamp"].endswith("Z")
    job = payload["data"]
    assert job == polled.to_dict() and call["path"] == "/hooks/video"  # the object the client polls
    assert (job["id"], job["status"], job["progress"], job["step"], job["total_steps"]) == (
        made.id, "completed", 100, 2, 2)
    assert call["headers"]["Content-Type"] == "application/json" and call["headers"]["webhook-id"].startswith("msg_")
    assert abs(int(call["headers"]["webhook-timestamp"]) - time.time()) < 30
    with pytest.raises(WebhookVerificationError):  # the check is real: another secret, or other bytes, fail it
        verified(call, "whsec_" + base64.b64encode(bytes(32)).decode())
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRET).verify(call["body"].replace(b"completed", b"failed\x20\x20\x20"), call["headers"])


def test_a_failed_job_and_a_deleted_one_call_their_webhooks_once_each(tmp_path, receiver):
    hook = receiver()
    app, backend = hooked_app(tmp_path)
    with serve_on_loopback(app) as url:
        client = openai_client(url)
        # no length: the fake backend answers an image, and the job fails
        failed = client.videos.create(prompt="a still fox", extra_body={"webhook_url": hook.url})
        backend.hold_before_step = 0  # the next one waits before its first step
        try:
            held = client.videos.create(prompt="a held fox", extra_body={"frames": 2, "webhook_url": hook.url})
            client.videos.delete(held.id)
        finally:
            backend.hold_before_step = None
        calls = hook.wait_for(2)  # and no third: the deleted job's end is not told again
    by_id = {payload["data"]["id"]: payload for payload in map(verified, calls)}
    assert {payload["type"] for payload in by_id.values()} == {"video.failed"}
    assert by_id[failed.id]["data"]["status"] == "failed"
    assert by_id[failed.id]["data"]["error"]["code"] == "unsupported_input"
    assert by_id[held.id]["data"]["status"] == "failed" and by_id[held.id]["data"]["error"] == {
        "code": "cancelled", "message": "the video was deleted before it finished"}
    assert len({call["headers"]["webhook-id"] for call in calls}) == 2


def test_a_receiver_failing_the_first_tries_gets_a_later_one_after_a_doubling_back_off(tmp_path, receiver, caplog):
    """An error answer, a try that times out, a redirect (never followed): each tried again,
    after 0.1, 0.2 then 0.4 s, under one webhook-id; the fourth try is delivered."""
    hook = receiver([500, ("hang", 2.0), 302])
    app, backend = hooked_app(tmp_path, attempts=4, retry_s=0.1, timeout_s=0.5)
    with serve_on_loopback(app) as url, caplog.at_level("INFO", logger="loraswap.server"):
        client = openai_client(url)
        made = client.videos.create(prompt="a fox", extra_body={"frames": 2, "webhook_url": hook.url})
        calls = hook.wait_for(4)
        with sqlite3.connect(tmp_path / "videos.sqlite3") as db:
            owed = db.execute("SELECT id FROM webhooks").fetchall()
    assert [call["path"] for call in calls] == ["/hooks/video"] * 4, "the redirect's Location is never called"
    assert len({call["headers"]["webhook-id"] for call in calls}) == 1
    assert all(verified(call)["data"]["id"] == made.id for call in calls)
    assert "failed (try 1 of 4): answered HTTP 500; trying again in 0.1 s" in caplog.text
    assert "failed (try 2 of 4): no answer within 0.5 s; trying again in 0.2 s" in caplog.text
    assert "failed (try 3 of 4): answered HTTP 302 (redirects are not followed); trying again in 0.4 s" in caplog.text
    assert "delivered (try 4)" in caplog.text and owed == [], "a delivered webhook leaves the state folder"
    gaps = [later["at"] - earlier["at"] for earlier, later in zip(calls, calls[1:])]
    # waited as told (the log lines above say the doubling): 0.1; the timeout (counted from the
    # connect, a little before the receiver's clock) + 0.2; 0.4. The one upper bound is loose: a
    # loaded CI machine may be late, never early.
    assert 0.1 <= gaps[0] < 2.0 and gaps[1] >= 0.5 + 0.2 - 0.05 and gaps[2] >= 0.4, gaps


def test_a_receiver_that_never_answers_2xx_is_given_up_after_the_attempts(tmp_path, receiver, caplog):
    hook = receiver([500] * 10)
    app, backend = hooked_app(tmp_path, attempts=3, retry_s=0.02)
    with serve_on_loopback(app) as url, caplog.at_level("INFO", logger="loraswap.server"):
        openai_client(url).videos.create(prompt="a fox", extra_body={"frames": 2, "webhook_url": hook.url})
        hook.wait_for(3)
    assert "given up after 3 tries: answered HTTP 500" in caplog.text


def test_a_restart_between_the_jobs_end_and_the_delivery_still_delivers(tmp_path, receiver, monkeypatch):
    hook = receiver()
    never = threading.Event()

    def stuck(*args):  # the first server dies before its try is done
        never.wait(30)
        return webhooks.Failure("stopped")

    try:
        with monkeypatch.context() as patch:
            patch.setattr(webhooks, "try_once", stuck)
            app, backend = hooked_app(tmp_path)
            with TestClient(app) as client:
                made = client.post("/v1/videos", files=form(prompt="a fox", frames=2, webhook_url=hook.url)).json()
                deadline = time.monotonic() + 10
                while client.get(f"/v1/videos/{made['id']}").json()["status"] != "completed":
                    assert time.monotonic() < deadline, "the job never completed"
                    time.sleep(0.01)
        with sqlite3.connect(tmp_path / "videos.sqlite3") as db:
            owed = db.execute("SELECT video_id, attempts FROM webhooks").fetchall()
        assert owed == [(made["id"], 0)] and hook.calls == [], "owed across the restart, not tried"
        app, backend = hooked_app(tmp_path)
        with TestClient(app):
            [call] = hook.wait_for(1)
    finally:
        never.set()
    payload = verified(call)
    assert (payload["data"]["id"], payload["type"]) == (made["id"], "video.completed")
    with sqlite3.connect(tmp_path / "videos.sqlite3") as db:
        assert db.execute("SELECT * FROM webhooks").fetchall() == []


def test_one_host_gets_one_try_at_a_time_and_a_slow_one_holds_up_no_other(tmp_path, receiver):
    slow, fast = receiver([("hang", 0.6), ("hang", 0.6)]), receiver()
    app, backend = hooked_app(tmp_path, timeout_s=5.0)
    with serve_on_loopback(app) as url:
        client = openai_client(url)
        for target in (slow.url, slow.url, fast.url):
            client.videos.create(prompt="a fox", extra_body={"frames": 2, "webhook_url": target})
        first, second = slow.wait_for(2)
        [other] = fast.wait_for(1)
    assert slow.most_at_once == 1 and second["at"] - first["at"] >= 0.6, "one try at a time to one host"
    assert other["at"] < second["at"], "another host's webhook does not wait behind the slow host's"


def test_logs_show_a_webhook_url_as_its_origin_only(tmp_path, receiver, caplog):
    """Slack's, Discord's and Zapier's webhook URLs hold their token in the path."""
    hook = receiver([500])
    token_url = hook.origin + "/services/T0001/B0001/SECRETTOKEN?key=QUERYSECRET"
    app, backend = hooked_app(tmp_path)
    with serve_on_loopback(app) as url, caplog.at_level("DEBUG", logger="loraswap"):
        openai_client(url).videos.create(prompt="a fox", extra_body={"frames": 2, "webhook_url": token_url})
        [failed, call] = hook.wait_for(2)
    assert call["path"] == "/services/T0001/B0001/SECRETTOKEN?key=QUERYSECRET", "the receiver gets the URL whole"
    assert f"to {hook.origin} failed (try 1 of 8): answered HTTP 500" in caplog.text
    assert f"to {hook.origin} delivered (try 2)" in caplog.text
    assert "SECRETTOKEN" not in caplog.text and "QUERYSECRET" not in caplog.text and "T0001" not in caplog.text


# ---------------------------------------------------------------- bounded
def test_the_webhooks_owed_are_capped_per_key_and_in_all_deleting_frees_nothing(tmp_path, receiver):
    """A key making and deleting jobs (no GPU spent) still owes a webhook per job until it is
    delivered: past --webhook-pending-per-key its next job is refused (503), while another key's
    is made, until --webhook-pending (all keys) is reached."""
    hook = receiver([500] * 50)  # never delivered while the test runs
    app, backend = hooked_app(tmp_path, api_keys=("sk-a", "sk-b"), pending=3, pending_per_key=2, retry_s=60)
    key = {name: {"authorization": f"Bearer sk-{name}"} for name in "ab"}
    backend.hold_before_step = 0  # the jobs stay unfinished
    try:
        with TestClient(app) as client:
            def create(who):
                return client.post("/v1/videos", headers=key[who], files=form(prompt="a fox", frames=2,
                                                                               webhook_url=hook.url))

            made = [create("a"), create("a")]
            assert [answer.status_code for answer in made] == [200, 200]
            client.delete(f"/v1/videos/{made[0].json()['id']}", headers=key["a"])
            hook.wait_for(1)  # the deleted job's webhook, owed until delivered
            refused = create("a")
            assert refused.status_code == 503 and "--webhook-pending-per-key" in refused.json()["error"]["message"]
            assert create("b").status_code == 200, "another key's job is made"
            full = create("b")
            assert full.status_code == 503 and "--webhook-pending)" in full.json()["error"]["message"]
            listed = client.get("/v1/videos", headers=key["a"]).json()["data"]
            assert [job["id"] for job in listed] == [made[1].json()["id"]], "a refused job is not made"
    finally:
        backend.hold_before_step = None
        backend.resume.set()


def test_a_server_starts_whatever_the_state_folder_holds_of_its_webhooks(tmp_path, monkeypatch, caplog):
    """A row that cannot be read is dropped (its removal failing too), a table that cannot be
    read logged: the server starts and serves either way."""
    app, backend = hooked_app(tmp_path)
    with TestClient(app):
        pass
    with sqlite3.connect(tmp_path / "videos.sqlite3") as db:
        db.execute("INSERT INTO webhooks VALUES ('msg_x', 'video_x', 'https://h/x', 'p', 'many', 0.0, NULL)")

    def unwritable(self, delivery_id):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(VideoState, "remove_delivery", unwritable)
    with caplog.at_level("INFO", logger="loraswap.server"):
        app, backend = hooked_app(tmp_path)
        with TestClient(app) as client:
            assert client.get("/health").status_code == 200
        assert "dropping webhook 'msg_x'" in caplog.text and "removing its row failed: disk I/O error" in caplog.text

        def unreadable(self):
            raise sqlite3.DatabaseError("database disk image is malformed")

        monkeypatch.setattr(VideoState, "deliveries", unreadable)
        app, backend = hooked_app(tmp_path)
        with TestClient(app) as client:
            assert client.get("/health").status_code == 200
        assert "the webhooks owed cannot be read from the state folder" in caplog.text


# ---------------------------------------------------------------- refused
def test_a_name_that_rebinds_to_loopback_is_refused_where_the_socket_opens_and_given_up_at_once(
        tmp_path, monkeypatch, caplog):
    """With `*` allowed, a name answers a public address, then 127.0.0.1 (DNS rebinding): the
    address is checked where the socket opens, so nothing reaches the listener on loopback, and
    a refusal by the rules is not tried again."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    accepted, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                accepted.append(listener.accept())
            except TimeoutError:
                pass

    threading.Thread(target=accept, daemon=True).start()
    port, real, answers, connects = listener.getsockname()[1], socket.getaddrinfo, [], []

    def rebinding(host, *args, **kwargs):
        if host != "rebind.example":
            return real(host, *args, **kwargs)
        answers.append("8.8.8.8" if not answers else "127.0.0.1")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answers[-1], port))]

    connect = httpcore.SyncBackend.connect_tcp

    def faked(self, host, *args, **kwargs):  # nothing leaves the machine: the public address refuses
        if host == "8.8.8.8":
            connects.append(host)
            raise httpcore.ConnectError("[Errno 111] Connection refused")
        return connect(self, host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    monkeypatch.setattr(httpcore.SyncBackend, "connect_tcp", faked)
    app, backend = hooked_app(tmp_path, allow=["*"], attempts=8)
    try:
        with serve_on_loopback(app) as url, caplog.at_level("INFO", logger="loraswap.server"):
            openai_client(url).videos.create(prompt="a fox", extra_body={
                "frames": 2, "webhook_url": f"https://rebind.example:{port}/hook"})
            logged(caplog, "given up")
            time.sleep(0.3)
    finally:
        stop.set()
        listener.close()
    assert accepted == [] and connects == ["8.8.8.8"] and answers == ["8.8.8.8", "127.0.0.1"]
    assert "given up after 2 tries: rebind.example resolves to 127.0.0.1, a loopback address" in caplog.text


def test_a_webhook_past_the_rules_is_refused_when_the_job_is_made(tmp_path, receiver):
    hook = receiver()
    app, backend = fake_app(state_dir=tmp_path / "open", webhooks=WebhookConfig(secret=SECRET, allow=["*"]))
    with serve_on_loopback(app) as url:
        client = openai_client(url)
        refusals = {}
        for target in (hook.url, "https://10.1.2.3/hook", "https://localhost/hook", "https://169.254.169.254/x"):
            with pytest.raises(openai.BadRequestError) as refused:
                client.videos.create(prompt="a fox", extra_body={"frames": 2, "webhook_url": target})
            refusals[target] = str(refused.value)
        listed = client.videos.list().data
    assert "plain http is called only on a host --webhook-allow names without a wildcard" in refusals[hook.url]
    assert "10.1.2.3 is a private address" in refusals["https://10.1.2.3/hook"]
    assert "localhost is a loopback address" in refusals["https://localhost/hook"]
    assert "--webhook-allow localhost" in refusals["https://localhost/hook"]
    assert "a cloud-metadata address" in refusals["https://169.254.169.254/x"]
    assert listed == [] and hook.calls == [] and backend.generated == [], "nothing made, nothing called"


def test_a_webhook_on_a_server_without_a_secret_is_refused_naming_the_flag(tmp_path):
    app, backend = fake_app(state_dir=tmp_path)
    with TestClient(app) as client:
        answer = client.post("/v1/videos", files=form(prompt="a fox", frames=2, webhook_url="https://example.com/h"))
    assert answer.status_code == 400 and "--webhook-secret" in answer.text and "LORASWAP_WEBHOOK_SECRET" in answer.text
    assert backend.generated == []
