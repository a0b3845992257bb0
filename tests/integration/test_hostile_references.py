"""Hostile adapter references against real servers (tiny-sd) on loopback, with their exact
inputs: each is answered with the status and words it should be, nothing it names is kept
unless it was accepted, no log line shows a signature, one key's URL adapters are not
another's, and the server goes on serving the same image as before.

`flagless`: a server with no URL, Civitai or bucket flags, served by uvicorn with its access
log on. `keyed`: keys K1 and K2 and no admin key, URLs and a Civitai mirror on a test web
server."""

import io
import json
import logging
import threading
import time
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi.testclient import TestClient
from PIL import Image
from support.images import encode, noise, pixels_of
from support.servers import free_port, wait_ready
from support.web import Web, body

from loraswap.adapters.reference import UrlReference
from loraswap.engine.config.engine import EngineConfig
from loraswap.server.access_log import HideQuery
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig

K1, K2 = {"authorization": "Bearer key-one"}, {"authorization": "Bearer key-two"}
PLAIN = {"inputs": "a lighthouse", "parameters": {"num_inference_steps": 1, "seed": 3, "width": 64, "height": 64}}
SIGNED = "http%3A%2F%2F127.0.0.1%3A18080%2Fa.safetensors%3FX-Amz-Signature%3DSECRET"


def long_url(i: int) -> str:
    """A distinct 2,000-character URL."""
    tail = f"/{i:06d}.safetensors?X-Amz-Signature=SECRET"
    return "https://cdn.example.com/" + "x" * (2000 - len(tail) - 24) + tail


def error_message(answer: httpx.Response) -> str:
    """The error's words, in the HF routes' shape or OpenAI's."""
    error = answer.json()["error"]
    return error if isinstance(error, str) else error["message"]


def url_id(url: str) -> str:
    return UrlReference(url).adapter_id


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(self.format(record))


@contextmanager
def logged(logger_name: str, *filters):
    """Every line `logger_name` writes while inside, through `filters` as the server's config has them."""
    handler = Lines()
    handler.setFormatter(logging.Formatter("%(message)s"))
    for f in filters:
        handler.addFilter(f)
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


@pytest.fixture(scope="module")
def folder(adapter_factory, tmp_path_factory):
    folder = tmp_path_factory.mktemp("folder")
    path = adapter_factory("style", "tiny-sd", rank=8, targets="all", seed=31, folder=folder)
    return folder, path.read_bytes()


@pytest.fixture(scope="module")
def flagless_server(folder, tmp_path_factory):
    app = create_app(ServerConfig(engines=[EngineConfig(model="tiny-sd", adapters=folder[0], compile=False,
                                                        warmup=False,
                                                        download_dir=tmp_path_factory.mktemp("downloads"))]))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="info",
                                           log_config=None, access_log=True))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.config.port}"
    deadline = time.monotonic() + 120
    while not server.started or httpx.get(url + "/ready").status_code != 200:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield url, app
    server.should_exit = True
    thread.join(10)


def sha256s(data: bytes) -> list[str]:
    """The SHA-256 of each adapter file the image's record names."""
    return [a["sha256"] for a in json.loads(Image.open(io.BytesIO(data)).text["loraswap"])["adapters"]]


def styled(post, headers=None) -> bytes:
    response = post("/", json=PLAIN, headers={"accept": "image/png", "lora": "style", **(headers or {})})
    assert response.status_code == 200, response.text
    return response.content


@pytest.fixture
def flagless(flagless_server):
    """The flagless server; afterwards it still serves the same image with the folder's adapter."""
    url, app = flagless_server

    def post(path, **kwargs):
        return httpx.post(url + path, timeout=60, **kwargs)

    before = styled(post)
    yield url, post
    assert styled(post) == before


def test_refused_urls_are_not_kept_whatever_names_them(flagless, flagless_server):
    url, post = flagless
    book = flagless_server[1].state.urls  # the app's URLs (`server/url_book.py`)
    urls = [long_url(i) for i in range(31)]
    before = book.size()
    with_loras = {**PLAIN, "parameters": {**PLAIN["parameters"], "loras": [{"path": u} for u in urls]}}
    answers = [post("/", json=with_loras),
               post("/", json=PLAIN, headers={"lora": ", ".join(urls[:5])}),  # (a head of at most 16 KiB)
               post("/v1/images/generations", json={"prompt": "x", "model": ", ".join(urls)}),
               post("/models/" + urls[0].replace("?", "%3F"), json=PLAIN),
               post("/adapters/" + urls[1].replace("?", "%3F") + "/load"),
               httpx.delete(url + "/adapters/" + urls[2].replace("?", "%3F"))]
    for answer in answers:
        assert answer.status_code == 403, answer.text
        assert "does not fetch adapters from url references. Start it with --url-allow HOST" in answer.text
    assert book.size() == before, "nothing a refused request named is kept"
    assert all(book.url(url_id(u)) is None for u in urls)


@pytest.mark.parametrize("method,path,status", [
    ("POST", f"/adapters/{SIGNED}/load", 403), ("DELETE", f"/adapters/{SIGNED}", 403),
    ("POST", f"/models/{SIGNED}", 403)])
def test_no_log_line_shows_a_signature_in_the_path(flagless, method, path, status):
    url, _ = flagless
    with logged("uvicorn.access", HideQuery()) as access, logged("loraswap") as app_lines:
        answer = httpx.request(method, url + path, json=PLAIN, timeout=60)
        deadline = time.monotonic() + 10
        while not access:  # the access line is written once the response is sent
            assert time.monotonic() < deadline, "no access log line"
            time.sleep(0.01)
    assert answer.status_code == status and "url references" in answer.json()["error"], answer.text
    assert "SECRET" not in answer.text
    assert any(f"{method} /" in line and "(query hidden)" in line for line in access), access
    assert not [line for line in access + app_lines if "SECRET" in line or "Signature" in line]


def test_an_unexpected_error_on_a_signed_path_is_logged_without_the_signature(flagless_server, monkeypatch):
    url, app = flagless_server
    monkeypatch.setattr(app.state.backend, "keep_adapter", lambda adapter_id: 1 / 0)
    with logged("loraswap") as lines:
        answer = httpx.post(f"{url}/adapters/{SIGNED}/load", timeout=60)
    assert (answer.status_code, answer.json()) == (500, {"error": "internal server error"})
    assert len(lines) == 1 and "SECRET" not in lines[0], "its traceback included"
    first = lines[0].splitlines()[0]
    assert first == "unhandled error on POST /adapters/http://127.0.0.1:18080/a.safetensors?(query hidden)"


@pytest.mark.parametrize("header,named", [("https://h/a,b.safetensors", "https://h/a,b.safetensors"),
                                          ("http://127.0.0.1:18080", "http://127.0.0.1:18080")])
def test_a_url_in_the_lora_header_is_one_adapter_and_its_port_no_weight(flagless, header, named):
    _, post = flagless
    answer = post("/", json=PLAIN, headers={"lora": header})
    assert answer.status_code == 403, answer.text
    assert answer.json()["error"].startswith(f"adapter '{url_id(named)}': this server does not fetch")


@pytest.mark.parametrize("path,fields", [("/v1/images/edits", {"prompt": b"a \xff\xfe cat"}),
                                         ("/v1/videos", {"prompt": b"a cat", "size": b"\xc0\xaf"})])
def test_a_form_field_that_is_not_utf8_is_refused(flagless, path, fields):
    _, post = flagless
    files = {name: (None, value) for name, value in fields.items()}
    files["image"] = ("i.png", encode(noise(64, 64)), "image/png")
    answer = post(path, files=files if path.endswith("edits") else {k: v for k, v in files.items() if k != "image"})
    assert answer.status_code == 400, answer.text
    name = next(iter(n for n, v in fields.items() if not _utf8(v)))
    assert f"the field '{name}' is not UTF-8 text" in error_message(answer)


def _utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("path,payload,phrase", [
    ("/v1/images/generations", {"json": {"prompt": "x", "loras": [{"path": "civitai:١@١"}]}}, "ASCII digits"),
    ("/v1/images/generations", {"json": {"prompt": "x", "model": "civitai:١@١"}}, "ASCII digits"),
    ("/v1/images/generations", {"json": {"prompt": "x", "size": "١٠٢٤x١٠٢٤"}},
     "size '١٠٢٤x١٠٢٤' must look like '1024x1024'"),
    ("/v1/videos", {"files": {"prompt": (None, "x"), "size": (None, "١٠٢٤x١٠٢٤".encode())}},
     "size '١٠٢٤x١٠٢٤' must look like '1024x1024'"),
])
def test_ids_and_sizes_take_ascii_digits_only(flagless, path, payload, phrase):
    _, post = flagless
    answer = post(path, **payload)
    assert answer.status_code == 400, answer.text
    assert phrase in error_message(answer)


# ---------------------------------------------------------------- two keys, URLs and Civitai allowed
@pytest.fixture(scope="module")
def web(folder):
    _, data = folder
    server = Web({})
    bad_hash = {"id": 31, "modelId": 11, "baseModel": "SD 1.5", "files": [
        {"name": "style.safetensors", "type": "Model", "primary": True, "metadata": {"format": "SafeTensor"},
         "hashes": {"SHA256": 5}, "downloadUrl": server.url("/loras/style.safetensors")}]}
    server.routes.update({"/loras/style.safetensors": body(data), "/loras/a,b.safetensors": body(data),
                          "/api/v1/model-versions/31": body(json.dumps(bad_hash).encode())})
    yield server
    server.close()


@pytest.fixture(scope="module")
def keyed_server(folder, web, tmp_path_factory):
    engine = EngineConfig(model="tiny-sd", adapters=folder[0], compile=False, warmup=False,
                          download_dir=tmp_path_factory.mktemp("downloads"), url_allow=[f"127.0.0.1:{web.port}"],
                          civitai_api=web.url("/api"))
    client = TestClient(create_app(ServerConfig(engines=[engine], api_keys=["key-one", "key-two"])),
                        raise_server_exceptions=False)
    client.__enter__()
    wait_ready(client)
    yield client
    client.__exit__(None, None, None)


@pytest.fixture
def keyed(keyed_server):
    before = styled(keyed_server.post, K1)
    yield keyed_server
    assert styled(keyed_server.post, K2) == before


def test_civitai_answering_a_hash_that_is_no_string_is_a_502_naming_it(keyed, web):
    answer = keyed.post("/", json={**PLAIN, "parameters": {**PLAIN["parameters"], "loras": [
        {"path": "civitai:11@31"}]}}, headers=K1)
    assert answer.status_code == 502, answer.text
    assert answer.json()["error"].startswith("adapter 'civitai:11@31': Civitai's answer is malformed: "
                                             "files[0].hashes.SHA256 is 5 (a number), not a string.")
    assert "civitai:11@31" not in keyed.get("/adapters", headers=K1).text
    assert "/loras/style.safetensors" not in web.paths(), "nothing downloaded on a malformed answer"


def test_a_comma_in_a_url_in_the_header_is_part_of_the_url(keyed, web):
    comma = web.url("/loras/a,b.safetensors")
    with_url = keyed.post("/", json=PLAIN, headers={**K1, "accept": "image/png", "lora": comma})
    assert with_url.status_code == 200, with_url.text
    folders = styled(keyed.post, K1)
    # the same file as the folder's style, weight 1: the same pixels; each record names its own id, the same file
    assert np.array_equal(pixels_of(with_url.content), pixels_of(folders))
    assert sha256s(with_url.content) == sha256s(folders) and len(sha256s(folders)[0]) == 64
    assert "/loras/a,b.safetensors" in web.paths()


def test_one_keys_url_adapter_is_neither_listed_used_nor_evicted_by_another(keyed, web):
    signed = web.url("/loras/style.safetensors?X-Amz-Signature=K1SECRET")
    adapter_id = url_id(signed)
    image = keyed.post("/", json=PLAIN, headers={**K1, "accept": "image/png", "lora": signed})
    assert image.status_code == 200, image.text
    assert adapter_id in keyed.get("/adapters", headers=K1).text
    listing = keyed.get("/adapters", headers=K2)
    assert listing.status_code == 200 and adapter_id not in listing.text and "style" in listing.text
    assert "/loras/" not in listing.text and "K1SECRET" not in listing.text
    refusals = [keyed.post("/", json=PLAIN, headers={**K2, "lora": adapter_id}),
                keyed.post("/v1/images/generations", json={"prompt": "x", "model": adapter_id}, headers=K2),
                keyed.delete(f"/adapters/{adapter_id}", headers=K2),
                keyed.post(f"/adapters/{adapter_id}/load", headers=K2)]
    for refused in refusals:
        assert refused.status_code == 404, refused.text
        assert "this API key has named no URL with this id. Name the adapter by its URL" in refused.text
    rows = {row["id"]: row for row in keyed.get("/adapters", headers=K1).json()["adapters"]}
    assert rows[adapter_id]["cached"] != "disk", "still cached: another key's DELETE evicted nothing"
    by_id = keyed.post("/", json=PLAIN, headers={**K1, "accept": "image/png", "lora": adapter_id})
    assert by_id.status_code == 200 and by_id.content == image.content, "the key that named it uses it by id"
    assert keyed.post("/", json=PLAIN, headers={**K2, "lora": signed}).status_code == 200, "naming the URL is enough"
    assert adapter_id in keyed.get("/adapters", headers=K2).text
    assert keyed.delete(f"/adapters/{adapter_id}", headers=K1).status_code == 200

