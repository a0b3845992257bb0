"""One place shapes an error's body (`server/error_bodies.py`): OpenAI's on every `/v1/*` route,
whatever raised it (a known error, a validation error, a route not found, a crash), and
`{"error": "..."}` elsewhere; the OpenAPI document says which each route answers."""

from fastapi.testclient import TestClient
from support.fakes import fake_app

from loraswap.errors import AdapterNotFound, Overloaded
from loraswap.server.error_bodies import error_body, error_code, is_openai_path, route_path


def test_only_the_v1_routes_take_openais_shape():
    assert [is_openai_path(p) for p in ("/v1", "/v1/models", "/v1/images/files/x", "/", "/v10/x", "/models/v1/x",
                                        "/adapters/v1")] == [True, True, True, False, False, False, False]
    assert error_body("/v1/models/x", 404, "gone", "model_not_found") == {
        "error": {"message": "gone", "type": "invalid_request_error", "param": None, "code": "model_not_found"}}
    assert error_body("/v1/images/generations", 503, "busy", "overloaded", "n")["error"]["type"] == "server_error"
    assert error_body("/v1/videos", 401, "no key")["error"]["code"] is None  # OpenAI's for a missing key
    assert error_body("/v1/videos", 401, "wrong key", "invalid_api_key")["error"]["code"] == "invalid_api_key"
    assert error_body("/models/v1", 404, "gone", "adapter_not_found") == {"error": "gone"}
    # behind a proxy mounting the app under a root path, the route's own path decides
    assert route_path({"path": "/api/v1/models", "root_path": "/api"}) == "/v1/models"
    assert route_path({"path": "/v1/models", "root_path": ""}) == "/v1/models"


def test_a_known_errors_code_is_its_own_and_a_subclass_naming_none_is_named_by_its_class():
    class QueueFull(Overloaded):
        pass

    assert error_code(AdapterNotFound("x", "no such adapter", "Check the id")) == "adapter_not_found"
    assert error_code(Overloaded("busy")) == "overloaded" and error_code(QueueFull("busy")) == "queue_full"


def test_a_crash_on_a_v1_route_is_a_plain_500_in_openais_shape(monkeypatch):
    app, backend = fake_app()

    async def boom(*args, **kwargs):
        raise RuntimeError("a secret in a traceback")

    monkeypatch.setattr(backend, "generate", boom)
    with TestClient(app, raise_server_exceptions=False) as client:
        openai = client.post("/v1/images/generations", json={"prompt": "a fox"})
        hf = client.post("/", json={"inputs": "a fox"})
    assert (openai.status_code, openai.json()) == (500, {"error": {
        "message": "internal server error", "type": "server_error", "param": None, "code": None}})
    assert (hf.status_code, hf.json()) == (500, {"error": "internal server error"})


def test_the_openapi_document_names_each_routes_error_body():
    app, _ = fake_app(api_keys=["sk-a"])
    schema = app.openapi()
    error = schema["components"]["schemas"]["OpenAIError"]["properties"]["error"]
    assert error["required"] == ["message", "type", "param", "code"]
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            refs = {answer["content"]["application/json"]["schema"]["$ref"]
                    for status, answer in operation["responses"].items() if status != "200" and "content" in answer}
            expected = "#/components/schemas/OpenAIError" if path.startswith("/v1/") else "#/components/schemas/Error"
            assert refs <= {expected}, (path, refs)
    assert set(schema["paths"]["/v1/models/{model_id}"]["get"]["responses"]) == {"200", "401", "404", "503"}
    assert set(schema["paths"]["/v1/images/files/{name}"]["get"]["responses"]) == {"200", "401", "404"}
