"""Webhooks' rules and tries, without a server: the URL rules named in each refusal (checked on
the URL's text when a job is made, with no DNS lookup), Standard Webhooks' payload and
signature (checked with `standardwebhooks`), every try checking the URL again and giving up at
once where the rules refuse, a back-off that doubles up to an hour, a DNS lookup held to the
try's time, and URLs shown in logs as their origin only."""

import base64
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import pytest
from standardwebhooks import Webhook

from loraswap.cli.settings import BY_NAME, SettingsError, server_config
from loraswap.errors import BadRequest
from loraswap.server.config import WebhookConfig
from loraswap.server.videos import webhooks
from loraswap.server.videos.webhook_rules import check_webhook_url, origin

SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
VIDEO = "video_" + "0" * 32


@pytest.mark.parametrize(("url", "allow", "says"), [
    ("https://evil.example/hook", ["hooks.example"], "host evil.example is not allowed; start the server with "
                                                     "--webhook-allow evil.example"),
    ("ftp://127.0.0.1/hook", ["127.0.0.1"], "only http(s)://HOST[:PORT] URLs are called"),
    ("https://user:pw@127.0.0.1/hook", ["127.0.0.1"], "carries a user name or password"),
    ("http://[::1]:9/hook", ["*"], "plain http"),
    ("https://[::1]:9/hook", ["*"], "::1 is a loopback address"),
    ("https://[::ffff:10.0.0.1]/hook", ["*"], "a private address"),
    ("https://app.localhost/hook", ["*"], "app.localhost is a loopback address"),
    ("https://127.0.0.1/" + "x" * 2100, ["127.0.0.1"], "the most is 2048"),
])
def test_check_webhook_url_names_the_rule(url, allow, says):
    with pytest.raises(BadRequest) as refused:
        check_webhook_url(url, WebhookConfig(secret=SECRET, allow=allow))
    assert says in refused.value.message and "pw" not in refused.value.message


def test_a_named_loopback_host_and_a_public_one_pass_with_no_dns_lookup(monkeypatch):
    """The job's request thread never waits on a resolver: a name is checked as each try connects."""
    def no_lookup(*args, **kwargs):
        raise AssertionError("a DNS lookup when the job is made")

    monkeypatch.setattr(socket, "getaddrinfo", no_lookup)
    check_webhook_url("http://127.0.0.1:9/hook?token=x", WebhookConfig(secret=SECRET, allow=["127.0.0.1"]))
    check_webhook_url("https://8.8.8.8/hook", WebhookConfig(secret=SECRET, allow=["*"]))
    check_webhook_url("https://hooks.example/hook", WebhookConfig(secret=SECRET, allow=["*"]))
    check_webhook_url("https://localhost/hook", WebhookConfig(secret=SECRET, allow=["localhost"]))


def test_the_secret_is_a_standard_one_and_its_flag_never_prints_it():
    assert BY_NAME["webhook-secret"].env == "LORASWAP_WEBHOOK_SECRET" and BY_NAME["webhook-secret"].secret
    assert server_config({"webhook-secret": SECRET, "webhook-allow": ["hooks.example"]}).webhooks.allow == [
        "hooks.example"]
    for bad in ("whsec_c2hvcnQ=", "not-prefixed-" + SECRET[6:], "whsec_%%%"):
        with pytest.raises(SettingsError) as wrong:
            server_config({"webhook-secret": bad})
        assert "--webhook-secret: a webhook secret is whsec_" in str(wrong.value) and bad not in str(wrong.value)


def test_the_caps_of_the_webhooks_owed_are_settings():
    assert (BY_NAME["webhook-pending"].env, BY_NAME["webhook-pending-per-key"].env) == (
        "LORASWAP_WEBHOOK_PENDING", "LORASWAP_WEBHOOK_PENDING_PER_KEY")
    config = server_config({"webhook-pending": 10, "webhook-pending-per-key": 3}).webhooks
    assert (config.pending, config.pending_per_key) == (10, 3)
    assert (WebhookConfig().pending, WebhookConfig().pending_per_key) == (1024, 32)


@pytest.mark.parametrize("status,kind", [("completed", "video.completed"), ("failed", "video.failed")])
def test_the_payload_is_standard_webhooks_event_and_its_signed_headers_verify(status, kind):
    job = {"id": VIDEO, "object": "video", "status": status}
    delivery = webhooks.owed(VIDEO, "https://hooks.example/x", job, 1_750_000_000.25, owner="k")
    headers = webhooks.signed_headers(SECRET, delivery, time.time())
    payload = Webhook(SECRET).verify(delivery.payload.encode(), headers)
    assert payload == json.loads(delivery.payload) == {"type": kind, "timestamp": "2025-06-15T15:06:40.250000Z",
                                                       "data": job}
    assert datetime.fromisoformat(payload["timestamp"]).timestamp() == 1_750_000_000.25
    assert (delivery.owner, delivery.attempts, delivery.next_at) == ("k", 0, 1_750_000_000.25)


def test_every_try_checks_the_url_again_and_a_refusal_by_the_rules_is_final():
    """A row changed by hand, or flags changed since the job was made: refused at the try, never
    connected, and never tried again; the failure names the URL by its origin alone."""
    for url, allow, says in (("https://10.1.2.3/hook", ["*"], "10.1.2.3 resolves to 10.1.2.3, a private address"),
                             ("https://elsewhere.example:8443/x/TOKEN", ["hooks.example"],
                              "webhook_url https://elsewhere.example:8443: host elsewhere.example is not allowed"),
                             ("http://8.8.8.8/x/TOKEN", ["*"], "plain http")):
        delivery = webhooks.owed(VIDEO, url, {"id": "x", "status": "completed"}, 0.0)
        failure = webhooks.try_once(delivery, WebhookConfig(secret=SECRET, allow=allow))
        assert failure is not None and says in failure.why and failure.final, failure
        assert "TOKEN" not in failure.why


def test_a_failure_that_may_pass_later_is_not_final(monkeypatch):
    import httpcore

    def refused(self, host, *args, **kwargs):
        raise httpcore.ConnectError("[Errno 111] Connection refused")

    monkeypatch.setattr(httpcore.SyncBackend, "connect_tcp", refused)
    delivery = webhooks.owed(VIDEO, "https://8.8.8.8/hook", {"id": "x", "status": "completed"}, 0.0)
    failure = webhooks.try_once(delivery, WebhookConfig(secret=SECRET, allow=["*"]))
    assert failure == webhooks.Failure("the connection failed ([Errno 111] Connection refused)", final=False)


def test_the_back_off_doubles_and_never_waits_more_than_an_hour():
    assert [webhooks.retry_wait(n, 5.0) for n in range(1, 6)] == [5.0, 10.0, 20.0, 40.0, 80.0]
    assert webhooks.retry_wait(10, 5.0) == 2560.0 and webhooks.retry_wait(11, 5.0) == 3600.0
    assert webhooks.retry_wait(30, 3600.0) == webhooks.MAX_WAIT_S == 3600.0


def test_a_dns_lookup_that_hangs_is_held_to_the_tries_time(monkeypatch):
    """The lookup runs on the resolver's thread, waited for until the try's deadline: the try's
    thread comes back in time, the try fails as a timeout (tried again later)."""
    real, release = socket.getaddrinfo, threading.Event()

    def hanging(host, *args, **kwargs):
        if host == "slow.example":
            release.wait(5)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    delivery = webhooks.owed(VIDEO, "https://slow.example/hook", {"id": "x", "status": "completed"}, 0.0)
    with ThreadPoolExecutor(1) as resolver:
        started = time.monotonic()
        failure = webhooks.try_once(delivery, WebhookConfig(secret=SECRET, allow=["*"], timeout_s=0.3), resolver)
        took = time.monotonic() - started
        release.set()
    assert failure == webhooks.Failure("no answer within 0.3 s", final=False) and took < 1.5, took


def test_a_log_shows_a_url_as_its_origin():
    assert origin("https://hooks.slack.com/services/T0/B0/SECRET?x=1") == "https://hooks.slack.com"
    assert origin("https://user:pw@hooks.example:8443/x") == "https://hooks.example:8443"
    assert origin("http://[::1]:9/x") == "http://[::1]:9" and origin("::not a url") == "(an unparseable URL)"


class _Rows:
    """A state folder's webhooks table, in memory."""

    def __init__(self):
        self.rows = {}

    def save_delivery(self, row):
        self.rows[row["id"]] = row


def test_a_jobs_slot_is_held_from_when_it_is_made_to_its_delivery_per_key_and_in_all():
    state = _Rows()
    sender = webhooks.WebhookSender(WebhookConfig(secret=SECRET, pending=3, pending_per_key=1), state)
    sender.reserve("video_a1", "key-a")
    with pytest.raises(webhooks.WebhooksFull, match="this API key's video jobs owe 1 webhooks"):
        sender.reserve("video_a2", "key-a")
    with pytest.raises(RuntimeError), sender.reserving("video_b1", "key-b"):
        raise RuntimeError("the job was not made")  # its slot given back
    sender.reserve("video_b1", "key-b")
    with pytest.raises(webhooks.WebhooksFull):  # one key-b slot, given back once, taken once
        sender.reserve("video_b2", "key-b")
    sender.send(webhooks.owed("video_a1", "https://h.example/x", {"status": "failed"}, 0.0, "key-a"))
    assert list(state.rows.values())[0]["owner"] == "key-a", "kept with its owner"
    with pytest.raises(webhooks.WebhooksFull, match="this API key's video jobs owe 1 webhooks"):
        sender.reserve("video_a3", "key-a")  # the job ended (or was deleted): its webhook is still owed
    sender.reserve("video_c1", None)  # no API keys: only the total counts
    with pytest.raises(webhooks.WebhooksFull, match="the video jobs owe 3 webhooks .* the most this server keeps"):
        sender.reserve("video_c2", None)
    sender.reserve("video_c3", None, capped=False)  # found unfinished at a start: owed already, past the cap
