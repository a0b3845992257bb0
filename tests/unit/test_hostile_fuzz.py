"""Property-based: whatever JSON a client sends to a generation route, in whichever of its
fields (lone surrogates, numbers at float's edge, deep nesting, wrong types, adapter
references of every shape in `loras`, `model` and the `lora` header), and whatever an
adapter route's path names (`/adapters/{id}/load`, `DELETE /adapters/{id}`,
`/models/{id}`, %-encoded or not), the answer is never a 5xx and always `{"error": ...}`
when refused, and once answered no request still holds a URL. Over a FakeBackend,
in-process: the classes of input that once reached a 500 (a tokenizer's TypeError,
RecursionError, OverflowError, a type Civitai's parser did not expect) are generated again,
in bounded time."""

import json
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.fakes import fake_app
from support.images import encode, noise

ROUTES = {  # route -> the fields its body names
    "/": ("inputs", "parameters"),
    "/v1/images/generations": ("prompt", "negative_prompt", "model", "n", "size", "seed", "num_inference_steps",
                               "guidance_scale", "loras", "image_loras", "response_format"),
    "/v1/videos": ("prompt", "model", "seconds", "size", "fps", "frames", "num_frames", "seed",
                   "num_inference_steps", "loras"),
    "/v1/images/edits": ("prompt", "negative_prompt", "model", "n", "size", "seed", "num_inference_steps",
                         "guidance_scale", "strength", "loras"),
}
FORMS = ("/v1/videos", "/v1/images/edits")  # multipart forms: every field as text, lists as JSON text
HF_PARAMETERS = ("negative_prompt", "num_inference_steps", "guidance_scale", "width", "height", "seed", "strength",
                 "target_size", "loras", "prompt")

SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)  # half a UTF-16 pair, alone unless its other half follows
text = st.text(alphabet=st.one_of(SURROGATES, st.characters()), max_size=12)
EDGES = st.sampled_from([1e308, -1e308, 1.7976931348623157e308, 2**63, 2**64 + 1, 1e-9, 5e-324, 0, -1])
numbers = st.one_of(EDGES, st.integers(), st.floats(allow_nan=False))
leaves = st.one_of(st.none(), st.booleans(), numbers, text)
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                      max_leaves=8)
DEPTHS = st.integers(1, 5000)
# adapter references of every shape: URLs (ports, userinfo, commas, %-escapes, signatures),
# Civitai ids and AIRs (other scripts' digits), buckets, `url:` ids, each with or without a weight
DIGITS = st.sampled_from(["1", "22", "\u0661", "\u0661\u0660", "\uff11", "0" * 13, "", "-1"])
HOSTS = st.sampled_from(["h.example", "127.0.0.1", "127.0.0.1:18080", "[::1]", "[::1", "[x]", "]", "h:\u0661\u0662",
                         "user:pw@h", "h:99999", "", "h:port", "h,k"])
PIECES = st.text(alphabet="/,:?#%@=&.;ab \t\u0661\u00e9", max_size=12)
WEIGHTS = st.sampled_from(["", ":0.5", ":\u0661", ":nan", ":1e999", ":-0", ":", ":1_0", ": 1"])
references = st.one_of(
    st.builds("{}{}/{}{}".format, st.sampled_from(["https://", "http://", "HTTP://", "s3://", "gs://", "ftp://"]),
              HOSTS, PIECES, WEIGHTS),
    st.builds("civitai:{}@{}{}".format, DIGITS, DIGITS, WEIGHTS),
    st.builds("urn:air:{}:{}:civitai:{}@{}{}".format, st.sampled_from(["sd1", "flux1", "", "\u00dc"]),
              st.sampled_from(["lora", "checkpoint", ""]), DIGITS, DIGITS, WEIGHTS),
    st.builds("url:{}{}".format, st.text(alphabet="0123456789abcdefg", max_size=33), WEIGHTS),
    st.builds("{}{}".format, st.sampled_from(["style", "a/b", "../x", "C:\\x", "owner/name@rev"]), WEIGHTS),
    text)
specs = st.lists(references, max_size=4).flatmap(lambda refs: st.sampled_from([", ".join(refs), ",".join(refs)]))
loras = st.lists(st.fixed_dictionaries({"path": references}, optional={"scale": st.one_of(numbers, text)}),
                 max_size=4)
PICTURE = encode(noise(32, 32))
# what each field usually holds, so that a body often passes every other check and reaches the
# one a hostile value is in (a prompt the tokenizer reads, seconds times fps)
prompts = st.one_of(st.just("a fox"), text)
PLAUSIBLE = {
    "inputs": prompts, "prompt": prompts, "negative_prompt": prompts,
    "num_inference_steps": st.integers(1, 2), "guidance_scale": st.floats(0, 20), "strength": st.floats(0.01, 1),
    "width": st.sampled_from([16, 64]), "height": st.sampled_from([16, 64]), "seed": st.integers(0, 2**31),
    "n": st.integers(1, 2), "size": st.sampled_from(["64x64", "auto", "16x32"]), "response_format": st.just("b64_json"),
    "seconds": st.one_of(numbers, st.sampled_from(["4", "1e308", "-0", "1e-300"])), "fps": st.integers(1, 30),
    "frames": st.integers(1, 9), "num_frames": st.integers(1, 9),
    "loras": loras, "image_loras": loras, "model": specs,
}


def value_of(draw, name: str):
    plausible = PLAUSIBLE.get(name)
    return draw(plausible) if plausible is not None and draw(st.integers(0, 3)) else draw(values)


@st.composite
def bodies(draw, route: str) -> dict:
    """Keyword arguments of `TestClient.post`: a JSON body, or a multipart form."""
    fields = draw(st.lists(st.sampled_from(ROUTES[route]), unique=True, max_size=5))
    body = {name: value_of(draw, name) for name in fields}
    body.setdefault("inputs" if route == "/" else "prompt", draw(prompts))
    if route == "/" and draw(st.booleans()):
        names = draw(st.lists(st.sampled_from(HF_PARAMETERS), unique=True, max_size=4))
        body["parameters"] = {name: value_of(draw, name) for name in names}
    deep = None
    if draw(st.integers(0, 9)) == 0:  # now and then, a field nested deep
        depth = draw(DEPTHS)
        deep = "[" * depth + "]" * depth
    if route in FORMS:
        if deep:
            body["loras"] = deep
        form = {name: (None, (value if isinstance(value, str) else json.dumps(value)).encode("utf-8", "surrogatepass"))
                for name, value in body.items()}  # a lone surrogate as the bytes a hostile client may send
        if route == "/v1/images/edits":
            form["image"] = ("i.png", PICTURE, "image/png")
        return {"files": form}
    encoded = json.dumps(body)  # ensure_ascii: a lone surrogate travels as valid JSON, \ud800
    if deep:
        encoded = encoded[:-1] + ', "deep": ' + deep + "}"
    headers = {"content-type": "application/json"}
    if draw(st.integers(0, 3)) == 0:  # the `lora` header, as the bytes a client may send
        headers["lora"] = _header_value(draw(specs))
    return {"content": encoded.encode(), "headers": headers}


def _header_value(spec: str) -> bytes:
    return spec.encode("utf-8", "surrogatepass").replace(b"\r", b"").replace(b"\n", b"")


@pytest.fixture(scope="module")
def client():
    app, _ = fake_app(max_width=64, max_height=64, max_steps=2)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@pytest.mark.slow  # 1,000 requests
@pytest.mark.parametrize("route", list(ROUTES))
def test_no_json_body_reaches_a_server_error(client, route):
    @settings(max_examples=250, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(bodies(route))
    def check(body: dict):
        response = client.post(route, **body)
        assert response.status_code < 500, (str(body)[:300], response.text)
        if response.status_code >= 400:
            assert response.json()["error"]
        assert client.app.state.urls.held() == 0, "an answered request holds no URL"

    check()


ADAPTER_ROUTES = ("load", "delete", "models")


@pytest.mark.slow  # 300 requests
def test_no_adapter_route_path_reaches_a_server_error(client):
    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(references, st.sampled_from(ADAPTER_ROUTES), st.sampled_from(["", "/:@,;=", "/:@,;=?#%"]))
    def check(reference: str, route: str, safe: str):
        name = quote(reference.encode("utf-8", "surrogatepass"), safe=safe)  # raw, or %-encoded as a client may
        if route == "load":
            response = client.post(f"/adapters/{name}/load")
        elif route == "delete":
            response = client.delete(f"/adapters/{name}")
        else:
            response = client.post(f"/models/{name}", json={"inputs": "a fox"})
        assert response.status_code < 500, (reference, route, response.text)
        if response.status_code >= 400:
            assert response.json()["error"]
        assert client.app.state.urls.held() == 0, "an answered request holds no URL"

    check()
