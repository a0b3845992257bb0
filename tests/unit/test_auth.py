"""API keys: `Authorization: Bearer KEY` on generation routes, admin keys on the adapter
routes, health open unless asked; 401 before any body is read; keys never logged."""

import base64
import io
import logging

import httpx
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from support.errors import error_message
from support.fakes import fake_app, serve_on_loopback

from loraswap.adapters.reference import as_refs
from loraswap.server import auth
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig

API, OTHER_API, ADMIN = "sk-api-0123456789", "sk-api-second", "sk-admin-abcdef"
GENERATION = [("post", "/", {"json": {"inputs": "a fox"}}),
              ("post", "/models/style", {"json": {"inputs": "a fox"}}),
              ("post", "/v1/images/generations", {"json": {"prompt": "a fox"}})]
ADMIN_ROUTES = [("get", "/adapters", {}), ("post", "/adapters/style/load", {}), ("delete", "/adapters/style", {})]
HEALTH = [("get", "/health", {}), ("get", "/ready", {}), ("get", "/metrics", {})]


def bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def call(client, route, key=None, headers=None):
    method, path, kwargs = route
    return getattr(client, method)(path, headers={**(headers or {}), **(bearer(key) if key else {})}, **kwargs)


def assert_unauthorized(response):
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    assert "Authorization: Bearer" in error_message(response)
    if response.request.url.path.startswith("/v1/"):  # OpenAI's code for a wrong key; none for a missing one
        wrong = "the key sent is not valid here" in error_message(response)
        assert response.json()["error"]["code"] == ("invalid_api_key" if wrong else None)


def test_generation_routes_ask_for_a_key_before_reading_the_body():
    app, backend = fake_app(api_keys=[API, OTHER_API])
    client = TestClient(app)
    for route in GENERATION:
        assert_unauthorized(call(client, route))
        assert_unauthorized(call(client, route, key="sk-wrong"))
        assert_unauthorized(call(client, route, headers={"authorization": API}))  # no scheme
        assert call(client, route, key=API).status_code == 200
        assert call(client, route, key=OTHER_API).status_code == 200
    assert len(backend.generated) == 6, "only requests with a key reached the backend"
    # a body that is not JSON, or too large, is not even read without a key
    for content in (b"{not json", b"x" * 100_000):
        refused = client.post("/", content=content, headers={"content-type": "application/json"})
        assert_unauthorized(refused)
    assert client.post("/", content=b"{not json", headers=bearer(API)).status_code == 400
    assert len(backend.generated) == 6


def test_keys_are_compared_in_constant_time_against_every_key(monkeypatch):
    calls = []

    def spy(a, b):
        calls.append((a, b))
        return a == b

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    app, _ = fake_app(api_keys=[API, OTHER_API], admin_keys=[ADMIN])
    assert TestClient(app).post("/", json={"inputs": "x"}, headers=bearer(API)).status_code == 200
    assert len(calls) == 3, "no early exit: the time does not say which key matched"


def test_admin_routes_ask_for_an_admin_key_which_generation_takes_too():
    app, backend = fake_app(api_keys=[API], admin_keys=[ADMIN])
    client = TestClient(app)
    for route in ADMIN_ROUTES:
        assert_unauthorized(call(client, route))
        refused = call(client, route, key=API)
        assert_unauthorized(refused)
        assert "admin key" in refused.json()["error"]
        assert call(client, route, key=ADMIN).status_code == 200
    assert backend.kept == ["style"] and backend.evicted == ["style"]
    loaded = client.post("/adapters/style/load", headers=bearer(ADMIN)).json()
    assert loaded == {"id": "style", "cached": "host", "kept": True, "bytes": 10, "layers": 1, "model": "fake"}
    assert client.delete("/adapters/style", headers=bearer(ADMIN)).json() == {"id": "style", "cached": "disk",
                                                                             "kept": False}
    for route in GENERATION:
        assert call(client, route, key=ADMIN).status_code == 200


def test_without_admin_keys_the_adapter_routes_take_an_api_key():
    app, _ = fake_app(api_keys=[API])
    client = TestClient(app)
    for route in ADMIN_ROUTES:
        assert_unauthorized(call(client, route))
        assert call(client, route, key=API).status_code == 200


def test_admin_keys_alone_leave_generation_open():
    app, _ = fake_app(admin_keys=[ADMIN])
    client = TestClient(app)
    assert client.post("/", json={"inputs": "x"}).status_code == 200
    assert_unauthorized(client.get("/adapters"))


def test_health_routes_are_open_unless_auth_health():
    app, _ = fake_app(api_keys=[API])
    client = TestClient(app)
    for route in HEALTH:
        assert call(client, route).status_code == 200
    app, _ = fake_app(api_keys=[API], admin_keys=[ADMIN], auth_health=True)
    client = TestClient(app)
    for route in HEALTH:
        assert_unauthorized(call(client, route))
        assert call(client, route, key=API).status_code == 200
        assert call(client, route, key=ADMIN).status_code == 200
    with pytest.raises(ValueError, match="no key is set"):
        ServerConfig(auth_health=True)


def test_a_server_without_keys_is_open():
    app, backend = fake_app()
    client = TestClient(app)
    for route in GENERATION + ADMIN_ROUTES + HEALTH:
        assert call(client, route).status_code == 200, route
    assert len(backend.generated) == 3


def test_keys_file(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# one key a line\n\n  {OTHER_API}  \n{API}\n")
    app, _ = fake_app(api_keys_file=keys)
    client = TestClient(app)
    assert client.post("/", json={"inputs": "x"}, headers=bearer(API)).status_code == 200
    assert client.post("/", json={"inputs": "x"}, headers=bearer(OTHER_API)).status_code == 200
    assert_unauthorized(client.post("/", json={"inputs": "x"}, headers=bearer("# one key a line")))
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="holds no key"):
        fake_app(api_keys_file=empty)
    with pytest.raises(ValueError, match="cannot be read"):
        fake_app(api_keys_file=tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="api key 2") as refused:
        fake_app(api_keys=[API, "has a space"])
    assert "has a space" not in str(refused.value), "the error names the key's place, not the key"


def test_keys_are_never_logged_nor_echoed(caplog):
    with caplog.at_level(logging.DEBUG):
        config = ServerConfig(api_keys=[API], admin_keys=[ADMIN])
        app, _ = fake_app(api_keys=[API], admin_keys=[ADMIN])
        client = TestClient(app)
        texts = [client.post("/", json={"inputs": "x"}, headers=bearer(ADMIN + "x")).text,
                 client.get("/adapters", headers=bearer(API)).text, client.get("/openapi.json").text]
        client.post("/", json={"inputs": "x"}, headers=bearer(API))
    for text in [*texts, caplog.text, repr(config), repr(app.state.keys)]:
        assert API not in text and ADMIN not in text


@pytest.mark.parametrize("host,keys,warns", [("0.0.0.0", {}, True), ("::", {}, True), ("example.org", {}, True),
                                             ("0.0.0.0", {"admin_keys": [ADMIN]}, True),
                                             ("0.0.0.0", {"api_keys": [API]}, False), ("127.0.0.1", {}, False),
                                             ("::1", {}, False), ("localhost", {}, False)])
def test_a_warning_when_listening_beyond_loopback_without_a_key(caplog, host, keys, warns):
    with caplog.at_level(logging.WARNING, logger="loraswap.server"):
        fake_app(host=host, **keys)
    warned = [r.getMessage() for r in caplog.records if "without an API key" in r.getMessage()]
    assert bool(warned) == warns, warned
    if warns:
        assert host in warned[0] and "--api-key" in warned[0]


def test_openapi_documents_the_bearer_scheme_where_a_key_is_needed():
    def security(schema, path, method):
        operation = schema["paths"][path][method]
        return operation.get("security"), "401" in operation["responses"]

    open_schema = create_app(ServerConfig()).openapi()
    scheme = open_schema["components"]["securitySchemes"]["bearer"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    assert security(open_schema, "/", "post") == (None, False)
    keyed = create_app(ServerConfig(api_keys=[API], admin_keys=[ADMIN])).openapi()
    for path, method in (("/", "post"), ("/models/{model_id}", "post"), ("/v1/images/generations", "post"),
                         ("/adapters", "get"), ("/adapters/{adapter_id}/load", "post"),
                         ("/adapters/{adapter_id}", "delete")):
        assert security(keyed, path, method) == ([{"bearer": []}], True), path
    assert security(keyed, "/health", "get") == (None, False)
    health = create_app(ServerConfig(api_keys=[API], auth_health=True)).openapi()
    assert security(health, "/metrics", "get") == ([{"bearer": []}], True)


@pytest.fixture
def keyed_server():
    """A real server on loopback (over a FakeBackend) that asks for API_KEY."""
    app, backend = fake_app(api_keys=[API])
    with serve_on_loopback(app) as url:
        yield url, backend


def test_the_openai_and_huggingface_clients_send_the_key(keyed_server, monkeypatch):
    import huggingface_hub.constants
    import openai
    from huggingface_hub import InferenceClient

    url, backend = keyed_server
    response = openai.OpenAI(base_url=url + "/v1", api_key=API, max_retries=0).images.generate(
        model="style", prompt="a fox", response_format="b64_json", size="64x64")
    assert Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json))).size == (8, 8)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0).images.generate(prompt="a fox")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the suite is offline; this is loopback
    image = InferenceClient(model=url, token=API).text_to_image("a fox", seed=3)
    assert image.size == (8, 8)
    with pytest.raises(Exception) as refused:
        InferenceClient(model=url, token="hf_wrong").text_to_image("a fox")
    assert "401" in str(refused.value)
    assert [(r.prompt, r.loras, r.seed) for r, _ in backend.generated] == [("a fox", as_refs([("style", 1.0)]), None),
                                                                          ("a fox", [], 3)]
    assert httpx.post(url + "/", json={"inputs": "x"}).status_code == 401


def test_the_access_log_hides_every_query_string():
    import logging

    from loraswap.server.access_log import HideQuery, log_config

    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "POST", "/v1/videos/x?api_key=SECRET&variant=v", "1.1", 401), None)
    assert HideQuery().filter(record) and "SECRET" not in record.getMessage()
    assert record.getMessage() == '127.0.0.1:5 - "POST /v1/videos/x?(query hidden) HTTP/1.1" 401'
    config = log_config()
    assert config["handlers"]["access"]["filters"] == ["hide_query"]
    assert config["filters"]["hide_query"]["()"] is HideQuery
