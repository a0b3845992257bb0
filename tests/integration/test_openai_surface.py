"""OpenAI's conventions with the real `openai` client, against a server on loopback (over a
backend whose image is a function of its seed, and the demo model): errors in OpenAI's body
(the client shows the server's words), `GET /v1/models`, and `response_format: "url"` (the
image kept for the key that made it, until its TTL)."""

import base64
import io
import shutil
import time

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from support.fakes import FakeBackend, serve_on_loopback
from support.images import encode, noise

from loraswap.adapters.reference import AdapterRef
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import GenerateResult
from loraswap.errors import Overloaded
from loraswap.models.families import demo
from loraswap.server.app import create_app
from loraswap.server.auth import key_digest
from loraswap.server.config import ServerConfig
from loraswap.server.images import kept as kept_images
from loraswap.server.url_book import NamedUrls

K1, K2, ADMIN = "sk-one-0123456789", "sk-two-0123456789", "sk-admin-0123456789"
TTL = 600.0


class SeededBackend(FakeBackend):
    """The fake backend, its image noise drawn from the request's seed: two requests agree
    byte for byte only when their seeds do."""

    def __init__(self, adapters: list[dict] | None = None):
        super().__init__()
        self.adapters = adapters or []
        self.overloaded = False

    async def generate(self, request, model, is_disconnected, on_step=None) -> GenerateResult:
        if self.overloaded:
            raise Overloaded("the queue is full (64 requests waiting); retry")
        self.generated.append((request, model))
        pixels = np.random.default_rng(request.seed).integers(0, 256, (16, 16, 3), dtype=np.uint8)
        return GenerateResult(Image.fromarray(pixels), request.seed or 0, 0.0, 0.01)

    async def list_adapters(self) -> dict:
        return {"model": "fake", "models": ["fake"], "adapters": self.adapters}


@pytest.fixture
def served(tmp_path):
    """(url, app, backend): a server with two API keys, adapters listed as models."""
    adapters = [{"id": "outline", "cached": "host", "base_model": "fake", "model": "fake"},
                {"id": "styles/striped", "cached": "disk", "model": None},
                {"id": "url:" + "0" * 32, "cached": "disk", "model": None}]  # a URL no key here has named
    backend = SeededBackend(adapters)
    app = create_app(ServerConfig(api_keys=[K1, K2], state_dir=tmp_path, image_url_ttl_s=TTL,
                                  list_adapters_as_models=True), backend=backend)
    with serve_on_loopback(app) as url:
        yield url, app, backend


def client(url: str, key: str = K1) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def test_the_openai_client_shows_the_servers_message(served):
    url, _, backend = served
    with pytest.raises(openai.BadRequestError) as bad:
        client(url).images.generate(prompt="a fox", size="big")
    message = "size 'big' must look like '1024x1024' (WIDTHxHEIGHT) or be 'auto'"
    assert bad.value.message == f"Error code: 400 - {message}" and message in str(bad.value)
    assert (bad.value.type, bad.value.code, bad.value.param) == ("invalid_request_error", "bad_request", "size")
    with pytest.raises(openai.NotFoundError) as missing:
        client(url).videos.retrieve("video_" + "0" * 32)
    assert "no video 'video_00000000" in missing.value.message and missing.value.code == "video_not_found"
    with pytest.raises(openai.AuthenticationError) as wrong_key:
        client(url, "sk-wrong").images.generate(prompt="a fox")
    assert "the key sent is not valid here" in wrong_key.value.message and wrong_key.value.code == "invalid_api_key"
    missing = httpx.get(url + "/v1/models").json()["error"]  # OpenAI: code null for a missing key
    assert "no key was sent" in missing["message"] and missing["code"] is None
    with pytest.raises(openai.BadRequestError) as invalid:  # pydantic's own refusal of a query parameter
        client(url).videos.download_content("video_" + "0" * 32, variant="spritesheet")
    assert "variant" in invalid.value.message and invalid.value.param == "variant"
    # a 503 keeps its Retry-After; a server error is OpenAI's server_error
    backend.overloaded = True
    busy = httpx.post(url + "/v1/images/generations", json={"prompt": "a fox"}, headers=bearer(K1))
    assert busy.status_code == 503 and busy.headers["retry-after"] == "2"
    assert busy.json() == {"error": {"message": "the queue is full (64 requests waiting); retry",
                                     "type": "server_error", "param": None, "code": "overloaded"}}
    # an unknown route under /v1 too; the Hugging Face routes and the server's own keep {"error": "..."}
    assert httpx.get(url + "/v1/nothing-here", headers=bearer(K1)).json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(url + "/", json={"inputs": ""}, headers=bearer(K1)).json() == {"error": "the prompt is empty"}
    assert httpx.get(url + "/adapters").json()["error"].startswith("this route needs an API key")


def test_models_lists_the_hosted_models_and_the_adapters_this_key_may_use(served):
    url, _, _ = served
    listed = client(url).models.list()
    assert [m.id for m in listed.data] == ["fake", "outline", "styles/striped"], \
        "a url: id whose URL this key never named is left out"
    assert {m.object for m in listed.data} == {"model"} and {m.owned_by for m in listed.data} == {"loraswap"}
    assert [getattr(m, "parent", None) for m in listed.data] == [None, "fake", None]
    assert client(url).models.retrieve("styles/striped").id == "styles/striped"  # a slash in the id
    assert client(url).models.retrieve("fake").created == listed.data[0].created
    with pytest.raises(openai.NotFoundError) as unknown:
        client(url).models.retrieve("nope")
    assert "the model 'nope' does not exist" in str(unknown.value) and unknown.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        client(url, "sk-wrong").models.list()


def test_a_remote_adapter_is_listed_to_the_key_that_named_it_and_to_admins_alone(tmp_path):
    reference = AdapterRef.named("https://files.example/loras/fox.safetensors")
    remote = [reference.adapter_id, "civitai:123@456", "s3:bucket/loras/a.safetensors"]
    backend = SeededBackend([{"id": "outline", "cached": "disk", "model": None}] +
                            [{"id": adapter_id, "cached": "host", "model": "fake"} for adapter_id in remote])
    app = create_app(ServerConfig(api_keys=[K1, K2], admin_keys=[ADMIN], state_dir=tmp_path,
                                  list_adapters_as_models=True), backend=backend)
    named = NamedUrls(app.state.urls, key_digest(app.state.owner_secret, K2.encode()))  # K2's accepted request named it
    named.hold(reference)
    named.release(accepted=True)
    with serve_on_loopback(app) as url:
        assert [m.id for m in client(url, K1).models.list().data] == ["fake", "outline"], "another key's fetches"
        assert [m.id for m in client(url, K2).models.list().data] == ["fake", "outline", reference.adapter_id]
        assert [m.id for m in client(url, ADMIN).models.list().data] == ["fake", "outline", *remote]
        with pytest.raises(openai.NotFoundError):
            client(url, K1).models.retrieve("civitai:123@456")
        admin_listing = httpx.get(url + "/adapters", headers=bearer(ADMIN)).json()["adapters"]
        assert [row["id"] for row in admin_listing] == ["outline", *remote], "the same rule as GET /adapters"


def test_images_that_cannot_be_kept_are_a_507_the_client_does_not_retry(served, monkeypatch):
    url, app, backend = served
    monkeypatch.setattr(kept_images.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    retrying = openai.OpenAI(base_url=url + "/v1", api_key=K1, max_retries=2)
    with pytest.raises(openai.InternalServerError) as full:
        retrying.images.generate(prompt="a fox", response_format="url")
    assert full.value.status_code == 507 and "b64_json" in full.value.message
    assert full.value.response.headers["x-should-retry"] == "false"
    assert backend.generated == [], "refused before generating, and asked once"
    monkeypatch.undo()
    # an image kept for the first of two, when the second fails: deleted, as no one has its URL
    real, calls = backend.generate, []

    async def second_fails(request, *args, **kwargs):
        calls.append(request.seed)
        if len(calls) == 2:
            raise Overloaded("the queue is full (64 requests waiting); retry")
        return await real(request, *args, **kwargs)

    monkeypatch.setattr(backend, "generate", second_fails)
    with pytest.raises(openai.APIStatusError):
        client(url).images.generate(prompt="a fox", response_format="url", n=2)
    assert len(calls) == 2 and list(app.state.kept_images.folder.rglob("*.png")) == []


def test_models_without_the_flag_are_the_hosted_models_alone(tmp_path):
    backend = SeededBackend([{"id": "outline", "cached": "disk", "model": None}])
    app = create_app(ServerConfig(state_dir=tmp_path), backend=backend)
    with serve_on_loopback(app) as url:
        assert [m.id for m in client(url, "unused").models.list().data] == ["fake"]
        with pytest.raises(openai.NotFoundError):
            client(url, "unused").models.retrieve("outline")


def test_an_image_by_url_is_the_b64_images_bytes_for_its_key_alone_until_its_ttl(served):
    url, app, _ = served
    by_url = client(url).images.generate(prompt="a fox", response_format="url", n=2, size="64x64",
                                         extra_body={"seed": 5})
    inline = client(url).images.generate(prompt="a fox", response_format="b64_json", n=2, size="64x64",
                                         extra_body={"seed": 5})
    links = [item.url for item in by_url.data]
    assert all(link.startswith(url + "/v1/images/files/") and link.endswith(".png") for link in links)
    fetched = [httpx.get(link, headers=bearer(K1)) for link in links]
    assert [f.status_code for f in fetched] == [200, 200] and fetched[0].headers["content-type"] == "image/png"
    assert [f.content for f in fetched] == [base64.b64decode(item.b64_json) for item in inline.data]
    assert fetched[0].content != fetched[1].content, "seed 5 and seed 6"
    # another key, and no key: as for an unknown id
    other = httpx.get(links[0], headers=bearer(K2))
    assert other.status_code == 404 and other.json()["error"]["code"] == "image_not_found"
    assert httpx.get(links[0]).status_code == 401
    # past its TTL: 404, and the file is gone (the clock of the app's kept images moved on)
    kept = app.state.kept_images
    files = sorted(kept.folder.rglob("*.png"))
    assert len(files) == 2
    clock = kept.clock
    kept.clock = lambda: clock() + TTL + 1
    assert httpx.get(links[0], headers=bearer(K1)).status_code == 404
    assert not any(path.exists() for path in files)


def test_a_webp_by_url_is_a_webp_file(served):
    url, _, _ = served
    link = client(url).images.generate(prompt="a fox", response_format="url", output_format="webp",
                                       extra_body={"seed": 4}).data[0].url
    assert link.endswith(".webp")
    fetched = httpx.get(link, headers=bearer(K1))
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/webp"
    assert Image.open(io.BytesIO(fetched.content)).format == "WEBP"


def test_an_edit_by_url_too(served):
    url, _, backend = served
    picture = ("fox.png", encode(noise(32, 32)), "image/png")
    by_url, inline = (client(url, K2).images.edit(image=picture, prompt="a fox", response_format=answer,
                                                  extra_body={"seed": 3}) for answer in ("url", "b64_json"))
    fetched = httpx.get(by_url.data[0].url, headers=bearer(K2))
    assert fetched.status_code == 200 and fetched.content == base64.b64decode(inline.data[0].b64_json)
    assert [request.seed for request, _ in backend.generated] == [3, 3]
    assert httpx.get(by_url.data[0].url, headers=bearer(K1)).status_code == 404


def test_the_demo_models_image_by_url_is_its_b64_image(tmp_path):
    """The real engine (the 32-pixel demo model and its `outline` adapter): the same seed
    gives the same file by URL as inline, the record in it included."""
    engine = EngineConfig(model="demo", adapters=demo.ADAPTERS, compile=False, warmup=False)
    app = create_app(ServerConfig(engines=[engine], api_keys=[K1, K2], state_dir=tmp_path))
    with serve_on_loopback(app) as url:
        deadline = time.monotonic() + 60
        while httpx.get(url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "the demo model did not load"
            time.sleep(0.05)
        body = {"model": "outline", "prompt": "a red circle at the left on white", "extra_body": {"seed": 3}}
        by_url = client(url).images.generate(response_format="url", **body)
        inline = client(url).images.generate(response_format="b64_json", **body)
        fetched = httpx.get(by_url.data[0].url, headers=bearer(K1))
        assert fetched.status_code == 200 and fetched.content == base64.b64decode(inline.data[0].b64_json)
        assert Image.open(io.BytesIO(fetched.content)).size == (32, 32)
        assert httpx.get(by_url.data[0].url, headers=bearer(K2)).status_code == 404
        with pytest.raises(openai.NotFoundError) as unknown:
            client(url).images.generate(model="nope", prompt="a red circle")
        assert "adapter 'nope': no such adapter" in str(unknown.value) and unknown.value.code == "adapter_not_found"


def test_an_image_by_url_survives_a_restart(tmp_path):
    """A server started again on the same state folder serves the images the last one kept,
    to the same key (the key's digest is the folder's secret's, kept there too)."""
    def start():
        return create_app(ServerConfig(api_keys=[K1, K2], state_dir=tmp_path), backend=SeededBackend())

    with serve_on_loopback(start()) as url:
        link = client(url).images.generate(prompt="a fox", response_format="url", extra_body={"seed": 8}).data[0].url
        before = httpx.get(link, headers=bearer(K1)).content
    with serve_on_loopback(start()) as url:
        again = url + "/v1/" + link.split("/v1/", 1)[1]  # the new server's port
        assert httpx.get(again, headers=bearer(K1)).content == before
        assert httpx.get(again, headers=bearer(K2)).status_code == 404
