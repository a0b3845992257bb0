"""Names of adapters elsewhere (URLs, Civitai AIRs, buckets): the id each is served under,
weights after them, what is refused, and what an error may show of them."""

import pytest

from loraswap.adapters.naming.references import (
    UrlReference,
    adapter_id_of,
    check_id,
    parse_reference,
    reference_of,
    remember_urls,
    shown,
    urls_of,
)
from loraswap.adapters.naming.specs import adapter_with_weight, parse_adapter_specs
from loraswap.errors import BadRequest

SIGNED = "https://cdn.example.com/loras/style.safetensors?X-Amz-Signature=SECRET123&X-Amz-Expires=600"


def test_each_reference_has_the_id_it_is_served_under():
    loras = parse_adapter_specs(f"plain/id:0.5, {SIGNED}:0.7, civitai:827184@2514310, "
                                "urn:air:sdxl:lora:civitai:11@22:0.2, s3://my-bucket/loras/x.safetensors")
    url_id = loras[1][0]
    assert loras == [("plain/id", 0.5), (url_id, 0.7), ("civitai:827184@2514310", 1.0), ("civitai:11@22", 0.2),
                     ("s3:my-bucket/loras/x.safetensors", 1.0)]
    assert url_id.startswith("url:") and len(url_id) == 36 and "SECRET" not in url_id
    assert reference_of(url_id).url == SIGNED, "this process remembers the URL behind its id"
    assert adapter_id_of(SIGNED) == url_id and adapter_id_of(url_id) == url_id
    assert adapter_id_of(SIGNED.replace("SECRET123", "OTHER")) != url_id, "a URL is its own key, signature and all"
    assert parse_reference("urn:air:flux1:lora:civitai:11@22").ecosystem == "flux1"
    assert adapter_with_weight("https://h.example:8443/a.safetensors", None)[1] == 1.0
    assert parse_adapter_specs("https://h.example:8443/a.safetensors:0.25")[0][1] == 0.25


def test_a_url_id_unseen_by_this_process_has_no_reference():
    assert reference_of("url:" + "0" * 32) is None
    assert check_id("url:" + "0" * 32) == "url:" + "0" * 32


def test_a_url_handed_over_is_remembered_under_its_own_id_only():
    """What a Ray replica gets from the ingress: the URL behind a `url:` id it never saw."""
    url = "https://cdn.example.com/handed.safetensors?sig=S"
    adapter_id = parse_reference(url).adapter_id
    assert reference_of(adapter_id) is None and urls_of([adapter_id]) == {}
    with pytest.raises(BadRequest, match="another's"):
        remember_urls({"url:" + "0" * 32: url})
    assert reference_of("url:" + "0" * 32) is None
    remember_urls({adapter_id: url})
    assert reference_of(adapter_id).url == url and urls_of([adapter_id, "plain/id"]) == {adapter_id: url}


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

    assert parse_adapter_specs("https://h/a,b.safetensors") == [(url_id("https://h/a,b.safetensors"), 1.0)]
    assert parse_adapter_specs("http://127.0.0.1:18080") == [(url_id("http://127.0.0.1:18080"), 1.0)]
    assert parse_adapter_specs("http://127.0.0.1:18080/a.safetensors:0.5, https://h/a,b.safetensors:0.25, "
                               "style:0.3,other") == [
        (url_id("http://127.0.0.1:18080/a.safetensors"), 0.5), (url_id("https://h/a,b.safetensors"), 0.25),
        ("style", 0.3), ("other", 1.0)]
    assert parse_adapter_specs("style:0.5,https://h/a.safetensors") == [
        ("style", 0.5), (url_id("https://h/a.safetensors"), 1.0)], "an id's comma ends it"


def test_a_signature_percent_encoded_into_a_path_is_not_shown():
    assert shown("https://h.example/a.safetensors%3FX-Amz-Signature%3DSECRET") == "https://h.example/a.safetensors"
    assert shown("https://h.example/a%253fsig%253DSECRET/b") == "https://h.example/a"
