"""Downloads through a real server (in this process) against hostile upstreams and a shared
download folder: a download is served only under this server's own rules, a refused file is
deleted and never listed, a starting server leaves another's download in flight alone, and
every fetch (S3 too) ends at --download-timeout-s, however many requests wait for it. Each
case: its status and message, the server still serving, and nothing valid lost."""

import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save
from support.headers import crowded_safetensors
from support.servers import wait_ready
from support.web import Web, body, drip

from loraswap.engine.config.engine import EngineConfig
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig
from loraswap.server.fetch_pool import FETCH_THREADS

PARAMETERS = {"width": 64, "height": 64, "seed": 7, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def style(adapter_factory, tmp_path_factory) -> bytes:
    return adapter_factory("style", "tiny-sd", rank=8, targets="all", seed=31,
                           folder=tmp_path_factory.mktemp("style")).read_bytes()


def _trickle(web: Web, data: bytes, seconds: float, gate: threading.Event | None = None):
    """The whole file, in ten pieces over `seconds`: slow, but it arrives; with `gate`, the pieces
    after the first only once it is set."""
    def route(handler):
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        step = -(-len(data) // 10)
        for start in range(0, len(data), step):
            handler.wfile.write(data[start:start + step])
            handler.wfile.flush()
            if gate is not None:
                gate.wait(60)
            web.stop.wait(seconds / 10)
    return route


@pytest.fixture(scope="module")
def web(style, adapter_factory, tmp_path_factory):
    folder = tmp_path_factory.mktemp("refused")
    wrong_base = adapter_factory("other", "tiny-sd", rank=4, seed=3, base_model="another/model", folder=folder)
    server = Web({
        "/w.safetensors": body(style),
        "/kept.safetensors": body(style),
        "/junk.safetensors": body(save({"junk.key.weight": torch.ones(4, 4)})),
        "/wrong-base.safetensors": body(wrong_base.read_bytes()),
        "/truncated.safetensors": body(style[:len(style) // 2]),
        "/huge-header.safetensors": body(crowded_safetensors(20 * 2**20)),
    })
    server.routes["/drip29.safetensors"] = drip(server, style[:64], len(style), 29.0)
    yield server
    server.close()


def _client(download_dir, **engine) -> TestClient:
    app = create_app(ServerConfig(engines=[EngineConfig(model="tiny-sd", download_dir=download_dir, **engine)]))
    client = TestClient(app, raise_server_exceptions=False)
    client.__enter__()
    wait_ready(client, 120)
    return client


def _post(client: TestClient, *paths: str):
    loras = {"loras": [{"path": path} for path in paths]} if paths else {}
    return client.post("/", json={"inputs": "a lighthouse", "parameters": {**PARAMETERS, **loras}})


def _listed(client: TestClient) -> set[str]:
    return {row["id"] for row in client.get("/adapters").json()["adapters"]}


def _files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_a_download_is_served_only_by_a_server_whose_own_rules_pass_it(web, tmp_path):
    """Server A (--url-allow 127.0.0.1:PORT) fetches into the shared folder; server B
    (--url-allow '*', which never allows loopback) answers 403 for the same URL and its id,
    lists neither, exactly as with an empty folder (where the id alone, whose URL that server
    never saw, is not found); A goes on serving it, fetched once."""
    shared, url = tmp_path / "downloads", web.url("/w.safetensors")
    a = _client(shared, url_allow=[f"127.0.0.1:{web.port}"])
    b = _client(shared, url_allow=["*"])
    empty = _client(tmp_path / "empty", url_allow=["*"])
    try:
        first = _post(a, url)
        assert first.status_code == 200, first.text
        url_id = next(i for i in _listed(a) if i.startswith("url:"))
        for server in (b, empty):
            for named in (url, url_id):
                refused = _post(server, named)
                if server is empty and named == url_id:  # each server its own URLs: this one never saw it
                    assert refused.status_code == 404 and "no longer cached" in refused.json()["error"], refused.text
                    continue
                assert refused.status_code == 403, refused.text
                assert "plain http" in refused.json()["error"]
        assert "plain http" in _post(b, url_id).json()["error"], "its record's URL is checked, cached or not"
        assert url_id not in _listed(b), "a server lists only what it may serve"
        assert _post(b).status_code == 200, "B still serves"
        again = _post(a, url)
        assert again.status_code == 200 and again.content == first.content
        assert web.paths().count("/w.safetensors") == 1, "fetched once, nothing lost"
    finally:
        for client in (a, b, empty):
            client.__exit__(None, None, None)


@pytest.fixture(scope="module")
def served(web, tmp_path_factory):
    downloads = tmp_path_factory.mktemp("downloads")
    client = _client(downloads, url_allow=[f"127.0.0.1:{web.port}"], download_timeout_s=2)
    yield client, downloads
    client.__exit__(None, None, None)


@pytest.mark.parametrize(("path", "status", "phrase"), [
    ("/junk.safetensors", 400, "is not a weight of any adapter kind"),
    ("/wrong-base.safetensors", 422, "another/model"),
    ("/truncated.safetensors", 400, "adapter 'url:"),
    ("/huge-header.safetensors", 400, "header"),
], ids=["junk-keys", "wrong-base", "truncated", "huge-header"])
def test_a_refused_download_is_deleted_and_never_listed(served, web, path, status, phrase):
    client, downloads = served
    kept = _post(client, web.url("/kept.safetensors"))
    assert kept.status_code == 200, kept.text
    kept_files = _files(downloads)
    refused = _post(client, web.url(path))
    assert refused.status_code == status and phrase in refused.json()["error"], refused.text
    assert _files(downloads) == kept_files, "its file is gone; the valid one stays"
    assert len([i for i in _listed(client) if i.startswith("url:")]) == 1, "only the valid download is listed"
    again = _post(client, web.url("/kept.safetensors"))
    assert again.status_code == 200 and again.content == kept.content, "the server still serves, nothing lost"


@pytest.fixture(scope="module")
def two_models(adapter_factory, tmp_path_factory):
    """A server hosting tiny-sd and tiny-sdxl, and a host serving adapters for each, for a model it
    does not host (tiny-flux, declared) and for none (tiny-flux's layers, nothing declared)."""
    folder = tmp_path_factory.mktemp("two-models")
    files = {name: adapter_factory(name, preset, rank=4, seed=seed, base_model=base, folder=folder).read_bytes()
             for name, preset, seed, base in [("for-sd", "tiny-sd", 500, "tiny-sd"),
                                              ("for-sdxl", "tiny-sdxl", 501, "tiny-sdxl"),
                                              ("for-flux", "tiny-flux", 502, "tiny-flux"),
                                              ("flux-undeclared", "tiny-flux", 503, None)]}
    web = Web({f"/{name}.safetensors": body(data) for name, data in files.items()})
    downloads = tmp_path_factory.mktemp("downloads")
    engines = [EngineConfig(model=model, download_dir=downloads, url_allow=[f"127.0.0.1:{web.port}"])
               for model in ("tiny-sd", "tiny-sdxl")]
    client = TestClient(create_app(ServerConfig(engines=engines)), raise_server_exceptions=False)
    client.__enter__()
    wait_ready(client, 120)
    yield client, web, downloads
    client.__exit__(None, None, None)
    web.close()


def _url_id(url: str) -> str:
    return "url:" + hashlib.sha256(url.encode()).hexdigest()[:32]


def _post_to(client: TestClient, model: str | None, *paths: str):
    body = {"inputs": "a lighthouse", "parameters": {**PARAMETERS, "loras": [{"path": path} for path in paths]}}
    return client.post(f"/models/{model}" if model else "/", json=body)


@pytest.mark.parametrize(("name", "phrase"), [("for-flux", "made for tiny-flux"),
                                              ("flux-undeclared", "fit none of the hosted models")])
def test_a_download_no_hosted_model_takes_is_deleted_on_a_two_model_server(two_models, name, phrase):
    """Routing refuses it (422) for every hosted model: its file goes, and it is never listed."""
    client, web, downloads = two_models
    before, url = _files(downloads), web.url(f"/{name}.safetensors")
    refused = _post_to(client, None, url)
    assert refused.status_code == 422 and phrase in refused.json()["error"], refused.text
    assert _files(downloads) == before, "its file is gone"
    assert _url_id(url) not in _listed(client), "never listed"
    assert _post_to(client, None).status_code == 200, "the server still serves"


def test_a_download_refused_for_the_model_named_stays_for_the_model_it_fits(two_models):
    """A tiny-sdxl adapter posted to /models/tiny-sd, or blended with a tiny-sd one: 422, but
    another hosted model takes it, so its download stays, listed, and serves tiny-sdxl without
    being fetched again."""
    client, web, downloads = two_models
    sdxl, sd = web.url("/for-sdxl.safetensors"), web.url("/for-sd.safetensors")
    named = _post_to(client, "tiny-sd", sdxl)
    assert named.status_code == 422 and "not for tiny-sd" in named.json()["error"], named.text
    blended = _post_to(client, None, sd, sdxl)
    assert blended.status_code == 422 and "one base model" in blended.json()["error"], blended.text
    assert {_url_id(sdxl), _url_id(sd)} <= _listed(client), "both downloads stay, listed"
    served = _post_to(client, None, sdxl)
    assert served.status_code == 200, served.text
    assert web.paths().count("/for-sdxl.safetensors") == 1 and web.paths().count("/for-sd.safetensors") == 1


def test_a_request_whose_adapter_is_cached_never_waits_behind_downloads(web, style, tmp_path):
    """48 requests each name a URL that drips (more than the download pool's threads); a request
    naming a URL adapter already downloaded is answered while all 48 still wait."""
    client = _client(tmp_path / "downloads", url_allow=[f"127.0.0.1:{web.port}"], download_timeout_s=60)
    stop = threading.Event()
    for i in range(48):
        web.routes[f"/slow{i}.safetensors"] = drip(web, style[:64], len(style), 1.0, stop=stop)
    try:
        cached = _post(client, web.url("/kept.safetensors"))
        assert cached.status_code == 200, cached.text
        with ThreadPoolExecutor(48) as pool:
            waiting = [pool.submit(_post, client, web.url(f"/slow{i}.safetensors")) for i in range(48)]
            deadline = time.monotonic() + 30
            while sum(path.startswith("/slow") for path in web.paths()) < FETCH_THREADS:
                assert time.monotonic() < deadline, "the download pool is full"
                time.sleep(0.01)
            again = _post(client, web.url("/kept.safetensors"))
            plain = _post(client)
            still_waiting = sum(not f.done() for f in waiting)
            stop.set()  # the hosts hang up: the 48 are answered
            statuses = {f.result().status_code for f in waiting}
        assert again.status_code == 200 and again.content == cached.content and plain.status_code == 200
        assert still_waiting == 48, "answered while every download still waited"
        assert statuses == {502}
    finally:
        stop.set()
        client.__exit__(None, None, None)


def test_forty_requests_naming_one_dripping_url_leave_the_download_pool_free(web, style, tmp_path):
    """40 requests name one URL that drips a byte a second: one download, the 39 others wait for it
    without a download thread, so a request naming another URL, not yet downloaded, is fetched
    and answered meanwhile; the 40 get the drip's failure once its host hangs up."""
    client = _client(tmp_path / "downloads", url_allow=[f"127.0.0.1:{web.port}"], download_timeout_s=60)
    stop = threading.Event()
    web.routes["/one-drip.safetensors"] = drip(web, style[:64], len(style), 1.0, stop=stop)
    web.routes["/fresh.safetensors"] = body(style)
    try:
        with ThreadPoolExecutor(40) as pool:
            waiting = [pool.submit(_post, client, web.url("/one-drip.safetensors")) for _ in range(40)]
            deadline, fetch_pool = time.monotonic() + 30, client.app.state.backend.fetch_pool
            while fetch_pool.following < 39 or "/one-drip.safetensors" not in web.paths():
                assert time.monotonic() < deadline, "the download started, the 39 others wait for it"
                time.sleep(0.01)
            started = time.monotonic()
            fresh = _post(client, web.url("/fresh.safetensors"))
            took = time.monotonic() - started
            still_waiting = sum(not f.done() for f in waiting)
            stop.set()  # the host hangs up: the 40 are answered
            statuses = {f.result().status_code for f in waiting}
        assert fresh.status_code == 200, fresh.text
        assert still_waiting == 40, f"answered in {took:.1f} s while the 40 still waited"
        assert statuses == {502} and web.paths().count("/one-drip.safetensors") == 1
    finally:
        stop.set()
        client.__exit__(None, None, None)


def test_a_url_dripping_a_byte_every_29_s_is_cut_at_the_timeout_for_every_request_waiting(served, web):
    """Eight requests name a host sending a byte every 29 s (never a read timeout), with
    --download-timeout-s 2: one fetch, cut at 2 s, and all eight answered 502 then, not one
    after the other."""
    client, downloads = served
    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _post(client, web.url("/drip29.safetensors")), range(8)))
    took = time.monotonic() - started
    assert [a.status_code for a in answers] == [502] * 8, answers[0].text
    assert all("did not send the whole answer within 2 s" in a.json()["error"] for a in answers), answers[0].text
    assert took < 20, f"{took:.1f} s: cut at the timeout, not when the host would finish (days)"
    assert web.paths().count("/drip29.safetensors") == 1
    assert not any(name.startswith(".partial-") for name in _files(downloads))
    assert _post(client).status_code == 200, "the server still serves"


def test_a_bucket_dripping_a_byte_a_second_is_cut_at_the_timeout(style, tmp_path, monkeypatch):
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true", "AWS_MAX_ATTEMPTS": "1",
                        "AWS_CONFIG_FILE": str(tmp_path / "none"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    store = Web({})
    store.routes["/team/slow.safetensors"] = drip(store, style[:64], len(style), 1.0)
    client = _client(tmp_path / "downloads", s3_endpoint_url=store.url(""), download_timeout_s=2)
    try:
        started = time.monotonic()
        answer = _post(client, "s3://team/slow.safetensors")
        took = time.monotonic() - started
        assert answer.status_code == 502, answer.text
        assert "did not send s3://team/slow.safetensors within 2 s" in answer.json()["error"]
        assert took < 20, f"{took:.1f} s: cut at the timeout, not when the store gives up (days)"
        assert _files(tmp_path / "downloads") == [] and _post(client).status_code == 200
    finally:
        client.__exit__(None, None, None)
        store.close()


def test_a_starting_server_leaves_another_servers_download_in_flight(web, style, tmp_path):
    """Server B starts on server A's download folder while A downloads (a trickle held after its
    first piece until B has started and listed its folder): A's partial file stays, A answers
    200, and B then serves the same file without fetching it."""
    shared, gate = tmp_path / "downloads", threading.Event()
    web.routes["/gated.safetensors"] = _trickle(web, style, 1.0, gate)
    url, allow = web.url("/gated.safetensors"), [f"127.0.0.1:{web.port}"]
    a = _client(shared, url_allow=allow)
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(_post, a, url)
            deadline = time.monotonic() + 30
            while not any(name.startswith(".partial-") for name in _files(shared)):
                assert time.monotonic() < deadline and not answer.done(), "A's download started"
                time.sleep(0.01)
            b = _client(shared, url_allow=allow)
            try:
                assert _listed(b) == set()  # B's folder, cleaned at its start
                assert any(name.startswith(".partial-") for name in _files(shared)), "A's partial file stays"
                assert not answer.done(), "A still downloads"
                gate.set()
                assert answer.result(timeout=60).status_code == 200, answer.result().text
                fetched = web.paths().count("/gated.safetensors")
                assert _post(b, url).status_code == 200
                assert web.paths().count("/gated.safetensors") == fetched == 1, "B found A's download"
            finally:
                gate.set()
                b.__exit__(None, None, None)
        assert hashlib.sha256((shared / next(n for n in _files(shared) if n.endswith(".safetensors"))).read_bytes()
                              ).hexdigest() == hashlib.sha256(style).hexdigest()
    finally:
        a.__exit__(None, None, None)
