"""`<lora:NAME:WEIGHT>` in prompts: read as A1111 reads its extra networks, cut out of the text,
merged with the header, `model` and `loras` by the one parse of every API (over a FakeBackend
that records what the engine gets), refused with the tag named when it asks for what this
server does not do, and left alone with --prompt-adapter-tags off."""

import base64
import json
import time

import pytest
from fastapi.testclient import TestClient
from support.fakes import fake_app
from support.images import encode, noise
from support.servers import form

from loraswap.adapters.naming.prompt_tags import take_adapter_tags
from loraswap.adapters.reference import as_refs
from loraswap.errors import BadRequest
from loraswap.media.metadata import AdapterUse, ImageRecord

URL_ID = "url:" + "0123456789abcdef" * 2


@pytest.mark.parametrize("prompt,text,loras", [
    ("<lora:outline:1> a red circle", " a red circle", [("outline", 1.0)]),
    ("a red circle <lora:outline>", "a red circle ", [("outline", 1.0)]),  # no weight: 1
    ("a <lyco:night:0.4>, red <lora:styles/anime:-0.5> circle", "a , red  circle",  # only the tag is cut (A1111)
     [("night", 0.4), ("styles/anime", -0.5)]),
    ("<lora:outline:0.7:0.7>", "", [("outline", 0.7)]),  # text encoder and UNet weights alike
    ("<lora:outline:te=0.3>", "", [("outline", 0.3)]),  # the UNet's weight is the text encoder's
    ("<lora:outline:0.5:unet=0.5>", "", [("outline", 0.5)]),
    ("<lora:outline:te=0.5:unet=0.5>", "", [("outline", 0.5)]),
    ("a <3 b, x < y: z >, <lora outline> <:x>", "a <3 b, x < y: z >, <lora outline> <:x>", []),  # no tags
    ("<lora:a:1><lora:a:0.5>", "", [("a", 1.0), ("a", 0.5)]),  # a repeat stays: the blend's check refuses it
    ("<lora:owner/name@v1:2e-1>", "", [("owner/name@v1", 0.2)]),
    # the ids of files elsewhere, colons and all, as the server's own infotext writes them
    ("<lora:civitai:123@456:0.8> a", " a", [("civitai:123@456", 0.8)]),
    ("<lora:civitai:123@456>", "", [("civitai:123@456", 1.0)]),
    (f"<lora:{URL_ID}:1>", "", [(URL_ID, 1.0)]),
    (f"<lora:url:{'1' * 32}>", "", [("url:" + "1" * 32, 1.0)]),  # hex digits that are all digits: still the id
    ("<lora:s3:bucket/styles/k=v.safetensors:0.5>", "", [("s3:bucket/styles/k=v.safetensors", 0.5)]),
    ("<lora:s3://bucket/k.safetensors:0.5>", "", [("s3:bucket/k.safetensors", 0.5)]),
    ("<lora:url:0.5> <lora:civitai:2>", " ", [("url", 0.5), ("civitai", 2.0)]),  # folder adapters of those names
])
def test_tags_are_cut_out_and_name_adapters_in_order(prompt, text, loras):
    assert take_adapter_tags(prompt, None) == (text, as_refs(loras))


@pytest.mark.parametrize("prompt,words", [
    ("<hypernet:agm:1.1> a fox", "'<hypernet:agm:1.1>' is an A1111 extra network this server does not apply"),
    ("<LORA:outline:1>", "'<LORA:outline:1>' is an A1111 extra network"),  # A1111 knows lora and lyco only
    ("<lora:outline:1:0.5>", "different weights (1 and 0.5)"),
    ("<lora:outline:unet=0>", "different weights (1 and 0)"),
    ("<lora:outline:1:1:16>", "a rank to cut the adapter to (dyn)"),
    ("<lora:outline:dyn=16>", "a rank to cut the adapter to (dyn)"),
    ("<lora:outline:1:role=char>", "the argument role="),
    ("<lora:outline:strong>", "the weight 'strong' is not a number"),
    ("<lora:outline:te=x>", "the weight 'x' is not a number"),
    ("<lora:outline:١>", "is not a number"),  # digits of another script: not ASCII
    ("<lora:outline:11>", "out of range"),
    ("<lora:outline:nan>", "out of range"),
    ("<lora::1>", "names no adapter"),
    ("<lora:te=1>", "names no adapter"),
    ("<lora:../secrets:1>", "invalid adapter id"),
    ("<lora:https://host/a.safetensors>", "is not a number"),  # a URL's colon splits it, as in A1111
    ("<lora:civitai:123@456:1:0.5>", "different weights (1 and 0.5)"),
    ("<lora:civitai:12x@4:1>", "is not a number"),  # no Civitai id: an adapter `civitai` of weight 12x@4
])
def test_a_tag_that_asks_for_what_the_server_does_not_do_is_refused_naming_it(prompt, words):
    with pytest.raises(BadRequest, match=words.replace("(", r"\(").replace(")", r"\)")):
        take_adapter_tags(prompt, None)


def test_a_tag_in_the_negative_prompt_is_refused_not_applied():
    with pytest.raises(BadRequest, match="the negative prompt holds the tag '<lora:night:1>'"):
        take_adapter_tags("a fox", "blur <lora:night:1>")


def test_a_long_tag_is_named_cut_short():
    with pytest.raises(BadRequest) as refused:
        take_adapter_tags(f"<hypernet:{'x' * 5000}>", None)
    assert len(refused.value.message) < 400


@pytest.fixture
def fake():
    app, backend = fake_app()
    with TestClient(app) as client:
        yield client, backend


def test_every_api_takes_the_tags_out_of_its_prompt(fake):
    client, backend = fake
    assert client.post("/", json={"inputs": "<lora:a:0.5> a fox"}).status_code == 200
    image = base64.b64encode(encode(noise(16, 16))).decode()
    assert client.post("/", json={"inputs": image, "parameters": {"prompt": "<lora:a> a fox"}}).status_code == 200
    assert client.post("/v1/images/generations", json={"prompt": "a fox <lyco:b:0.25>"}).status_code == 200
    assert client.post("/sdapi/v1/txt2img", json={"prompt": "<lora:c:2> a fox", "seed": 1}).status_code == 200
    made = [(request.prompt, request.loras) for request, _ in backend.generated]
    assert made == [(" a fox", as_refs([("a", 0.5)])), (" a fox", as_refs([("a", 1.0)])),
                    ("a fox ", as_refs([("b", 0.25)])), (" a fox", as_refs([("c", 2.0)]))]


def test_tags_merge_with_the_model_the_body_and_the_header_each_later_one_winning(fake):
    client, backend = fake
    body = {"prompt": "<lora:a:0.5><lora:b:0.5> x", "model": "m:0.1, a:0.2",
            "loras": [{"path": "b", "scale": 0.7}, {"path": "c", "scale": 0.3}]}
    assert client.post("/v1/images/generations", json=body, headers={"lora": "c:0.9"}).status_code == 200
    request, model = backend.generated[-1]
    # the name's, then the prompt's, the body's and the header's: a name given again takes the later weight and place
    assert model is None and request.loras == as_refs([("m", 0.1), ("a", 0.5), ("b", 0.7), ("c", 0.9)])
    assert client.post("/v1/images/generations", json={"prompt": "<lora:a> x", "model": "fake"}).status_code == 200
    request, model = backend.generated[-1]
    assert model == "fake" and request.loras == as_refs([("a", 1.0)]), "a hosted model named, the tags its adapters"


def test_a_refused_tag_is_a_400_naming_it_and_nothing_is_generated(fake):
    client, backend = fake
    for body in ({"inputs": "<hypernet:x:1> a fox"}, {"inputs": "a fox", "parameters": {"negative_prompt": "<lora:a>"}},
                 {"inputs": "<lora:a:1:0.5> a fox"}):
        answer = client.post("/", json=body)
        assert answer.status_code == 400 and "tag '<" in answer.json()["error"], answer.text
    assert backend.generated == []


def test_with_tags_off_the_prompt_goes_to_the_encoder_untouched():
    app, backend = fake_app(prompt_adapter_tags="off")
    with TestClient(app) as client:
        prompt = "<lora:a:0.5> a fox <hypernet:x>"
        assert client.post("/", json={"inputs": prompt, "parameters": {"negative_prompt": "<lora:b>"}}).status_code \
            == 200
    request, _ = backend.generated[-1]
    assert (request.prompt, request.negative_prompt, request.loras) == (prompt, "<lora:b>", [])


def test_a_video_prompt_takes_tags_too(fake):
    client, backend = fake
    job = client.post("/v1/videos", files=form(prompt="<lora:a:0.5> a fox", frames=2, size="16x16"))
    assert job.status_code == 200, job.text
    deadline = time.monotonic() + 10
    while client.get(f"/v1/videos/{job.json()['id']}").json()["status"] != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    request, _ = backend.generated[-1]
    assert (request.prompt, request.loras) == (" a fox", as_refs([("a", 0.5)]))


def test_an_infotext_s_tags_parse_back_to_its_adapters_and_weights():
    """The infotext an image carries writes each adapter as a tag (`ImageRecord.prompt_with_tags`):
    read back, they are the same adapters with the same weights, ids with colons included."""
    adapters = (AdapterUse("civitai:123@456", 0.8), AdapterUse(URL_ID, 1.0),
                AdapterUse("s3:bucket/k.safetensors", -2.5), AdapterUse("styles/anime", 0.1234567),
                AdapterUse("owner/name@v1", 1e-7))
    record = ImageRecord(prompt="a red circle", negative_prompt=None, steps=2, guidance=3.0, seed=1, width=32,
                         height=32, model="demo", adapters=adapters)
    text, loras = take_adapter_tags(record.infotext().split("\n")[0], None)
    assert loras == as_refs((a.id, a.weight) for a in adapters) and text.strip() == "a red circle"


def test_the_infotext_of_a_served_image_sent_back_makes_the_same_request(fake):
    client, backend = fake
    header = "civitai:123@456:0.8, https://files.example/a.safetensors, s3://bucket/b.safetensors:0.1234567, a:-0.5"
    first = client.post("/sdapi/v1/txt2img", json={"prompt": "a fox", "seed": 3}, headers={"lora": header})
    assert first.status_code == 200, first.text
    tagged = json.loads(first.json()["info"])["infotexts"][0].split("\n")[0]
    assert "<lora:civitai:123@456:0.8>" in tagged and "<lora:s3:bucket/b.safetensors:0.1234567>" in tagged
    again = client.post("/sdapi/v1/txt2img", json={"prompt": tagged, "seed": 3})
    assert again.status_code == 200, again.text
    (asked, _), (sent_back, _) = backend.generated[-2:]
    assert sent_back.loras == asked.loras and len(asked.loras) == 4 and sent_back.prompt.strip() == "a fox"


def test_an_empty_prompt_is_judged_once_its_tags_are_cut_out(fake):
    """One rule: A1111's routes take an empty prompt, as A1111 does (webuiapi sends "" by default),
    whether it was empty or held only tags; the other APIs refuse both."""
    client, backend = fake
    for prompt in ("", "  ", "<lora:a:0.5>"):
        answer = client.post("/sdapi/v1/txt2img", json={"prompt": prompt, "seed": 1})
        assert answer.status_code == 200, answer.text
        request, _ = backend.generated[-1]
        assert request.prompt.strip() == "" and request.loras == as_refs([("a", 0.5)] if "lora" in prompt else [])
    assert client.post("/sdapi/v1/txt2img", json={"seed": 1}).status_code == 200, "no prompt at all: webuiapi's \"\""
    made = len(backend.generated)
    too_long = client.post("/sdapi/v1/txt2img", json={"prompt": " " * 2001})
    assert too_long.status_code == 400 and "the prompt has 2001 characters; the limit is 2000" in too_long.text
    for body, words in (({"inputs": ""}, "the prompt is empty"),
                        ({"inputs": "<lora:a:0.5> "}, "the prompt is empty once its <lora:NAME:WEIGHT> tags are cut"),
                        ({"inputs": "x", "parameters": {"prompt": "<lora:a>"}}, "the prompt is empty once")):
        answer = client.post("/", json=body)
        assert answer.status_code == 400 and words in answer.json()["error"], answer.text
    answer = client.post("/v1/images/generations", json={"prompt": "<lora:a:1>"})
    assert answer.status_code == 400 and "the prompt is empty once" in answer.json()["error"]["message"]
    assert len(backend.generated) == made, "nothing generated for a refused prompt"
