"""Names of adapters elsewhere (URLs, Civitai AIRs, buckets): the id each is served under,
weights after them, what is refused, and what an error may show of them."""

import pickle

import pytest

from loraswap.adapters.naming.specs import adapter_with_weight, parse_adapter_specs
from loraswap.adapters.reference import AdapterRef, UrlReference, as_refs, check_id, parse_reference, shown
from loraswap.engine.request import GenerateRequest
from loraswap.errors import BadRequest

SIGNED = "https://cdn.example.com/loras/style.safetensors?X-Amz-Signature=SECRET123&X-Amz-Expires=600"


def test_each_reference_has_the_id_it_is_served_under():
    loras = parse_adapter_specs(f"plain/id:0.5, {SIGNED}:0.7, civitai:827184@2514310, "
                                "urn:air:sdxl:lora:civitai:11@22:0.2, s3://my-bucket/loras/x.safetensors")
    url_id = loras[1].adapter_id
    assert [(ref.adapter_id, ref.scale) for ref in loras] == [
        ("plain/id", 0.5), (url_id, 0.7), ("civitai:827184@2514310", 1.0), ("civitai:11@22", 0.2),
        ("s3:my-bucket/loras/x.safetensors", 1.0)]
    assert url_id.startswith("url:") and len(url_id) == 36 and "SECRET" not in url_id
    assert loras[1].url == SIGNED, "the ref carries the URL behind its id"
    assert "SECRET" not in repr(loras[1]) and "SECRET" not in repr(loras[1].where), "never in a repr (a log line)"
    assert AdapterRef.named(SIGNED).adapter_id == url_id and AdapterRef.named(url_id).adapter_id == url_id
    assert AdapterRef.named(SIGNED.replace("SECRET123", "OTHER")).adapter_id != url_id, \
        "a URL is its own key, signature and all"
    assert parse_reference("urn:air:flux1:lora:civitai:11@22").ecosystem == "flux1"
    assert loras[4].where.bucket == "my-bucket" and loras[2].where.version == 2514310, "where the file is, in the ref"
    assert adapter_with_weight("https://h.example:8443/a.safetensors", None).scale == 1.0
    assert parse_adapter_specs("https://h.example:8443/a.safetensors:0.25")[0].scale == 0.25


def test_a_url_id_named_by_its_id_carries_no_url():
    assert AdapterRef.named("url:" + "0" * 32).url is None
    assert check_id("url:" + "0" * 32) == "url:" + "0" * 32


def test_a_url_is_carried_in_its_ref_under_its_own_id_only():
    """What a Ray replica or a context-parallel rank gets: the request, pickled, its refs whole."""
    url = "https://cdn.example.com/handed.safetensors?sig=S"
    adapter_id = parse_reference(url).adapter_id
    assert AdapterRef.of_id(adapter_id).url is None, "an id alone carries no URL"
    with pytest.raises(BadRequest, match="another's"):
        AdapterRef.of_id("url:" + "0" * 32).with_url(url)
    ref = AdapterRef.of_id(adapter_id, 0.5).with_url(url)
    assert ref == AdapterRef(adapter_id, 0.5) and ref.url == url
    request = GenerateRequest(prompt="x", loras=[ref, ("plain/id", 1.0)])
    handed = pickle.loads(pickle.dumps(request))  # as Ray and torch.distributed send it to another process
    assert handed.loras[0].url == url and handed.loras[1] == AdapterRef("plain/id")
    assert [ref.url for ref in handed.model_copy(update={"seed": 1}).loras] == [url, None]


def test_pairs_are_made_refs_by_their_ids_checked():
    """The convenience of scripts, tests and a request kept as JSON: `(id, weight)` pairs."""
    refs = as_refs([("style", 1), ("civitai:1@2", 0.5), {"path": "s3:my-bucket/k.safetensors", "scale": 0.2}])
    assert refs == [AdapterRef("style", 1.0), AdapterRef("civitai:1@2", 0.5),
                    AdapterRef("s3:my-bucket/k.safetensors", 0.2)]
    assert refs[1].where.model == 1 and refs[2].where.key == "k.safetensors" and refs[0].source == "name"
    with pytest.raises(BadRequest, match="invalid adapter id"):
        GenerateRequest(prompt="x", loras=[("../etc/passwd", 1.0)])
    kept = GenerateRequest(prompt="x", loras=[AdapterRef.named(SIGNED)]).model_dump_json()
    assert "SECRET" not in kept and GenerateRequest.model_validate_json(kept).loras[0].url is None, \
        "kept as JSON, a request holds ids and weights: never a URL"


def test_a_copy_with_other_adapters_is_checked_as_a_request_is():
    """`GenerateRequest.with_loras`: pairs made refs, refs kept whole, a bad id refused (a
    `model_copy(update=...)` would have kept any of them as given)."""
    url = "https://cdn.example.com/copied.safetensors?sig=S"
    ref = AdapterRef.named(url, 0.5)
    request = GenerateRequest(prompt="x", seed=4)
    copy = request.with_loras([ref, ("plain/id", 0.7)])
    assert copy.loras == [ref, AdapterRef("plain/id", 0.7)] and copy.loras[0] is ref and copy.loras[0].url == url
    assert (copy.prompt, copy.seed, request.loras) == ("x", 4, []), "the rest copied, the original unchanged"
    with pytest.raises(BadRequest, match="invalid adapter id"):
        request.with_loras([("../etc/passwd", 1.0)])


@pytest.mark.parametrize("name,message", [
    ("https://user:pw@h.example/x.safetensors", "no user or password"),
    ("https://h.example:port/x", "port is not a number"),
    ("https://h.example/a b", "no spaces"),
    ("urn:air:sdxl:checkpoint:civitai:1@2", "it is a checkpoint, not an adapter"),
    ("civitai:abc@2", "civitai:MODEL@VERSION"),
    ("civitai:1@2:abc", "civitai:MODEL@VERSION"),
    ("s3://my-bucket/../etc/passwd", "'..' in an object key"),
    ("ftp://h.example/x.safetensors", "invalid adapter id"),
    ("gs://my-bucket/x.safetensors", "s3://BUCKET/KEY .*--s3-endpoint-url https://storage.googleapis.com"),
    ("x:99", "out of range"),
    (SIGNED + ":99", "out of range"),
    ("civitai:١@١", "civitai:MODEL@VERSION .*ASCII digits"),  # Arabic-Indic digits: no civitai:1@1
    ("urn:air:sd1:lora:civitai:١١@22", "ASCII digits"),
    ("civitai:1@2:١", "ASCII digits"),
    ("style:١", "the weight after ':' must be a number"),
    ("style:1_0", "must be a number"),
    ("https://h.example:١٢/a.safetensors", "port is not a number"),
    ("https://user:pw@[::1/a.safetensors", "'https://\\(an unreadable host\\)': its host is not a name or an address"),
    ("http://[x]/a.safetensors", "its host is not a name or an address"),
])
def test_bad_references_are_refused_saying_why(name, message):
    with pytest.raises(BadRequest, match=message) as refused:
        parse_adapter_specs(name)
    assert "SECRET" not in refused.value.message and "pw@" not in refused.value.message


@pytest.mark.parametrize("adapter_id", ["url:short", "url:" + "g" * 32, "civitai:1", "s3:UPPER/x", "civitai:1@2@3"])
def test_ids_that_look_remote_but_are_malformed_are_refused(adapter_id):
    with pytest.raises(BadRequest):
        check_id(adapter_id)


def test_what_an_error_shows_of_a_url():
    assert shown(SIGNED) == "https://cdn.example.com/loras/style.safetensors"
    assert shown("https://user:pw@h.example:8443/a?token=T") == "https://h.example:8443/a"


def test_a_comma_inside_a_url_is_the_urls_and_a_port_is_no_weight():
    """A URL's own commas (no space after them) and its port stay in it; its weight follows a
    colon after its path; a URL is separated from the next adapter by ', '."""
    def url_id(url):
        return UrlReference(url).adapter_id

    def pairs(value):
        return [(ref.adapter_id, ref.scale) for ref in parse_adapter_specs(value)]

    assert pairs("https://h/a,b.safetensors") == [(url_id("https://h/a,b.safetensors"), 1.0)]
    assert pairs("http://127.0.0.1:18080") == [(url_id("http://127.0.0.1:18080"), 1.0)]
    assert pairs("http://127.0.0.1:18080/a.safetensors:0.5, https://h/a,b.safetensors:0.25, "
                 "style:0.3,other") == [
        (url_id("http://127.0.0.1:18080/a.safetensors"), 0.5), (url_id("https://h/a,b.safetensors"), 0.25),
        ("style", 0.3), ("other", 1.0)]
    assert pairs("style:0.5,https://h/a.safetensors") == [
        ("style", 0.5), (url_id("https://h/a.safetensors"), 1.0)], "an id's comma ends it"


def test_a_signature_percent_encoded_into_a_path_is_not_shown():
    assert shown("https://h.example/a.safetensors%3FX-Amz-Signature%3DSECRET") == "https://h.example/a.safetensors"
    assert shown("https://h.example/a%253fsig%253DSECRET/b") == "https://h.example/a"
