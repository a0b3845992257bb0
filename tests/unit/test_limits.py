"""One table of request limits (`limits.LIMITS`) drives the checks of every API, their
messages and the OpenAPI schema; both APIs parse into one request."""

import math

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from support.errors import error_message
from support.fakes import fake_app

from loraswap.engine.request import GenerateRequest
from loraswap.errors import BadRequest
from loraswap.server.config import ServerConfig
from loraswap.server.requests.limits import LIMITS, check_limits

CONFIG = {"max_width": 320, "max_height": 256, "max_steps": 7, "max_prompt_chars": 50, "max_images": 3}


def properties_named(node, name: str) -> list[dict]:
    """Every JSON Schema property called `name` under `node` (the non-null branch of an optional one)."""
    found = []
    if isinstance(node, dict):
        for key, prop in (node.get("properties") or {}).items():
            if key == name:
                found += [b for b in prop.get("anyOf", [prop]) if b.get("type") != "null"]
        for value in node.values():
            found += properties_named(value, name)
    elif isinstance(node, list):
        for value in node:
            found += properties_named(value, name)
    return found


def test_every_limit_is_published_with_the_servers_bounds():
    config = ServerConfig(**CONFIG)
    app, _ = fake_app(**CONFIG)
    bodies = [operation["requestBody"] for path in ("/", "/v1/images/generations", "/v1/videos")
              for operation in app.openapi()["paths"][path].values() if "requestBody" in operation]
    for limit in LIMITS:
        for name in limit.names:
            published = properties_named(bodies, name)
            assert published, f"{name} is not in any request body"
            for prop in published:
                assert limit.schema(config).items() <= prop.items(), (name, prop)
    width = properties_named(bodies, "width")
    assert len(width) == 2 and all(w["maximum"] == 320 and w["multipleOf"] == 8 for w in width), \
        "parameters.width and parameters.target_size.width"
    assert properties_named(bodies, "n")[0]["maximum"] == 3
    assert properties_named(bodies, "inputs")[0]["maxLength"] == 50


@pytest.mark.parametrize("field,good,bad,message", [
    ("width", 320, 328, "width 328 must be a multiple of 8 between 8 and 320"),
    ("width", 8, 12, "width 12 must be a multiple of 8 between 8 and 320"),
    ("height", 256, 264, "height 264 must be a multiple of 8 between 8 and 256"),
    ("num_inference_steps", 7, 8, "num_inference_steps 8 must be between 1 and 7"),
    ("num_inference_steps", 1, 0, "num_inference_steps 0 must be between 1 and 7"),
    ("prompt", "x" * 50, "x" * 51, "the prompt has 51 characters; the limit is 50"),
    ("inputs", "x", " \n", "the prompt is empty"),
    ("negative_prompt", "", "x" * 51, "the negative prompt has 51 characters; the limit is 50"),
    ("guidance_scale", 50.0, 50.5, "guidance_scale 50.5 must be between 0 and 50"),
    ("guidance_scale", 0, math.nan, "guidance_scale nan must be between 0 and 50"),
    ("seed", 2**63 - 1, 2**63, f"seed {2**63} must be between 0 and {2**63 - 1}"),
    ("n", 3, 4, "n must be between 1 and 3"),
    ("size", "auto", "big", "size 'big' must look like '1024x1024' (WIDTHxHEIGHT) or be 'auto'"),
    ("response_format", "url", "link", "response_format must be 'b64_json' or 'url', not 'link'"),
])
def test_a_value_past_a_bound_gets_the_tables_message_and_the_bound_passes(field, good, bad, message):
    config = ServerConfig(**CONFIG)
    check_limits({field: good}, config)
    with pytest.raises(BadRequest) as refused:
        check_limits({field: bad}, config)
    assert refused.value.message == message


def test_guidance_and_seed_bounds_are_the_engines():
    by_name = {limit.names[0]: limit for limit in LIMITS}
    config = ServerConfig()
    for limit, field, past in ((by_name["guidance_scale"], "guidance", 0.01), (by_name["seed"], "seed", 1)):
        low, high = limit.bounds(config)
        GenerateRequest(prompt="x", **{field: low})
        GenerateRequest(prompt="x", **{field: high})
        for value in (low - past, high + past):
            with pytest.raises(ValidationError):
                GenerateRequest(prompt="x", **{field: value})


def test_both_apis_parse_into_one_request():
    app, backend = fake_app(**CONFIG)
    client = TestClient(app)
    hf = {"inputs": "a fox", "parameters": {"negative_prompt": "blur", "num_inference_steps": 3,
                                            "guidance_scale": 2.5, "width": 64, "height": 32, "seed": 9}}
    openai = {"prompt": "a fox", "negative_prompt": "blur", "num_inference_steps": 3, "guidance_scale": 2.5,
              "size": "64x32", "seed": 9}
    assert client.post("/", json=hf, headers={"lora": "style:0.5, second:0.25"}).status_code == 200
    assert client.post("/models/style", json=hf, headers={"lora": "second:0.25, style:0.5"}).status_code == 200
    assert client.post("/v1/images/generations", json={**openai, "model": "style:0.5, second:0.25"}).status_code == 200
    assert client.post("/v1/images/generations", json={**openai, "model": "style"},
                       headers={"lora": "second:0.25, style:0.5"}).status_code == 200
    expected = GenerateRequest(prompt="a fox", negative_prompt="blur", steps=3, guidance=2.5, width=64, height=32,
                               seed=9, loras=[("style", 0.5), ("second", 0.25)], output="image")
    requests = [request for request, _ in backend.generated]
    assert requests[0] == requests[2] == expected
    # the route's adapter and the header's: the header gives an adapter it names its weight
    header_first = expected.with_loras([("second", 0.25), ("style", 0.5)])
    assert requests[1] == requests[3] == header_first
    target = {"inputs": "a fox", "parameters": {"target_size": {"width": 64, "height": 32}, "seed": 9}}
    assert client.post("/models/fake", json=target).status_code == 200
    assert client.post("/v1/images/generations", json={"prompt": "a fox", "model": "fake", "size": "64x32",
                                                        "seed": 9}).status_code == 200
    (hf_target, hf_model), (openai_size, openai_model) = backend.generated[4:]
    assert hf_target == openai_size and hf_model == openai_model == "fake", "a hosted model's name is the model"


@pytest.mark.parametrize("hf,openai", [
    ({"width": 100}, {"size": "100x64"}),
    ({"num_inference_steps": 8}, {"num_inference_steps": 8}),
    ({"seed": -1}, {"seed": -1}),
    ({"guidance_scale": 51.0}, {"guidance_scale": 51.0}),
    ({"target_size": {"width": 64, "height": 512}}, {"size": "64x512"}),
])
def test_both_apis_refuse_a_value_with_the_same_message(hf, openai):
    app, backend = fake_app(**CONFIG)
    client = TestClient(app)
    by_hf = client.post("/", json={"inputs": "a fox", "parameters": hf})
    by_openai = client.post("/v1/images/generations", json={"prompt": "a fox", **openai})
    assert by_hf.status_code == by_openai.status_code == 400
    assert error_message(by_hf) == error_message(by_openai)  # each in its API's body
    assert backend.generated == []


def test_openai_images_count_their_seeds_up_and_stay_in_bounds():
    app, backend = fake_app(**CONFIG)
    client = TestClient(app)
    answer = client.post("/v1/images/generations", json={"prompt": "a fox", "n": 3, "seed": 5})
    assert answer.status_code == 200 and len(answer.json()["data"]) == 3
    assert [request.seed for request, _ in backend.generated] == [5, 6, 7]
    past = client.post("/v1/images/generations", json={"prompt": "a fox", "n": 2, "seed": 2**63 - 1})
    assert past.status_code == 400 and "seed" in past.json()["error"]["message"]
    assert len(backend.generated) == 3


def test_the_openai_body_is_capped_like_the_hf_body():
    app, backend = fake_app(max_body_bytes=1024)
    client = TestClient(app)
    for path, body in (("/", {"inputs": "x" * 2000}), ("/v1/images/generations", {"prompt": "x" * 2000})):
        refused = client.post(path, json=body)
        assert refused.status_code == 400 and "the limit is 1024" in error_message(refused)
    not_json = client.post("/v1/images/generations", content=b"{", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and '"prompt"' in not_json.json()["error"]["message"]
    assert backend.generated == []
