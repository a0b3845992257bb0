"""The URLs behind `url:` ids: held while a request naming them is unanswered, kept after it
only if it was accepted, in a table bounded in count and bytes that never drops a
held or pinned URL; each kept URL scoped to the keys whose accepted requests named it."""

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from support.fakes import fake_app

from loraswap.adapters.reference import AdapterRef, UrlReference
from loraswap.errors import AdapterNotFound
from loraswap.server.auth import Keys, key_owner
from loraswap.server.url_book import NamedUrls, UrlBook, scoped_refs, url_bytes


def url(i: int, length: int = 100) -> str:
    tail = f"/{i:06d}.safetensors?X-Amz-Signature=SECRET"
    return "https://cdn.example.com/" + "x" * (length - len(tail) - 24) + tail


def remember(book: UrlBook, adapter_id: str, url: str) -> None:
    """A URL kept as an accepted request's, scoped to no key."""
    book.hold(adapter_id, url)
    book.release(adapter_id, accepted=True)


def test_a_refused_request_leaves_nothing_and_an_accepted_one_is_kept():
    book = UrlBook()
    book.hold("url:a", url(1))
    book.hold("url:b", url(2))
    assert book.url("url:a") == url(1), "held: its file can be fetched while the request is unanswered"
    book.release("url:a", accepted=False)
    book.release("url:b", accepted=True, owner="k1")
    assert book.url("url:a") is None and book.url("url:b") == url(2)
    assert book.size() == (1, url_bytes(url(2)))
    assert book.owned_by("url:b", "k1") and not book.owned_by("url:b", "k2")
    book.hold("url:b", url(2))
    book.release("url:b", accepted=False, owner="k2")
    assert book.url("url:b") == url(2) and not book.owned_by("url:b", "k2"), "a refusal forgets nothing kept"


def test_a_url_two_requests_hold_stays_until_the_last_is_answered():
    book = UrlBook()
    book.hold("url:a", url(1))
    book.hold("url:a", url(1))
    book.release("url:a", accepted=False)
    assert book.url("url:a") == url(1), "the other request still needs it"
    book.release("url:a", accepted=False)
    assert book.size() == (0, 0)
    book.release("url:a", accepted=True)  # a release of nothing held keeps nothing
    assert book.size() == (0, 0)


def test_the_kept_urls_are_bounded_in_count_and_bytes_least_recently_used_first():
    each = url_bytes(url(0))
    assert each == 100 + url_bytes(""), "an ASCII URL: a byte a character"
    book = UrlBook(max_urls=3, max_bytes=5 * each)
    for i in range(5):
        remember(book, f"url:{i}", url(i))
    assert book.size() == (3, 3 * each) and book.url("url:0") is None and book.url("url:1") is None
    book.url("url:2")  # a use: now the most recently used
    remember(book, "url:5", url(5))
    assert {i for i in range(6) if book.url(f"url:{i}")} == {2, 4, 5}
    remember(book, "url:long", url(6, length=4 * each - url_bytes("")))  # 4 of the others
    assert book.size() == (2, 5 * each) and book.url("url:long") and book.url("url:5"), "within the bytes"


def test_held_and_pinned_urls_are_never_dropped_to_make_room():
    book = UrlBook(max_urls=2, max_bytes=10**6)
    book.hold("url:held", url(1))
    remember(book, "url:kept", url(2))
    assert book.pin("url:kept") and not book.pin("url:unknown")
    for i in range(10):
        remember(book, f"url:{i}", url(10 + i))
    assert book.url("url:held") and book.url("url:kept"), "a request in flight and a kept adapter still need them"
    assert {i for i in range(10) if book.url(f"url:{i}")} == {8, 9}, "they count in no bound"
    book.release("url:held", accepted=False)
    book.unpin("url:kept")  # an ordinary kept URL again, and the least recently used: it makes room
    assert book.url("url:held") is None and book.url("url:kept") is None and book.size()[0] == 2


def test_a_requests_named_urls_are_held_until_it_is_released():
    book = UrlBook()
    first, second = url(101), url(102)
    named = NamedUrls(book, owner="k1")
    refs = [AdapterRef.named(first), AdapterRef.named(second), AdapterRef.named(first)]
    for ref in refs:
        named.hold(ref)
    ids = [ref.adapter_id for ref in refs]
    assert ids[0] == ids[2] == UrlReference(first).adapter_id and book.url(ids[1]) == second
    assert named.named_by_url(ids[0]) and named.url(ids[1]) == second and book.held() == 2
    named.hold(AdapterRef.named(ids[1]))  # named by its id too: nothing to hold
    named.release(accepted=False)
    named.release(accepted=True)  # a second release does nothing
    assert book.url(ids[0]) is None and book.url(ids[1]) is None and book.size() == (0, 0)


@pytest.mark.parametrize("accepted", [True, False])
def test_an_accepted_requests_urls_are_scoped_to_its_key(accepted):
    book = UrlBook()
    named = NamedUrls(book, owner="k1")
    ref = AdapterRef.named(url(200 + accepted))
    named.hold(ref)
    named.release(accepted=accepted)
    assert book.owned_by(ref.adapter_id, "k1") is accepted and not book.owned_by(ref.adapter_id, "k2")


def _request(book: UrlBook, key: str) -> SimpleNamespace:
    """What `scoped_refs` reads of a request: its key, and the app's keys and book."""
    state = SimpleNamespace(urls=book, keys=Keys(api=(b"k1", b"k2")), owner_secret=b"a state folder's secret")
    return SimpleNamespace(app=SimpleNamespace(state=state), headers={"authorization": f"Bearer {key}"})


def test_a_url_id_named_by_its_id_gets_its_url_within_the_keys_scope():
    book, signed = UrlBook(), url(300)
    first = _request(book, "k1")
    named = NamedUrls(book, owner=key_owner(first))
    [[by_url]] = scoped_refs(first, named, [[AdapterRef.named(signed, 0.5)]])
    assert by_url.url == signed and named.named_by_url(by_url.adapter_id)
    [[by_id, again]] = scoped_refs(first, named, [[AdapterRef.named(by_url.adapter_id), by_url]])
    assert by_id.url == signed and by_id.scale == 1.0 and again is by_url, "named by URL in the request: filled in"
    named.release(accepted=True)
    [[later]] = scoped_refs(first, None, [[AdapterRef.named(by_url.adapter_id, 0.3)]])
    assert later.url == signed and later.scale == 0.3, "the key that named the URL may name its id later"
    with pytest.raises(AdapterNotFound, match="this API key has named no URL with this id"):
        scoped_refs(_request(book, "k2"), NamedUrls(book, "other"), [[AdapterRef.named(by_url.adapter_id)]])


def test_two_apps_in_one_process_keep_separate_books():
    """No URL lives in a module: each app owns its book, and a URL one app's requests named
    reaches the other in no ref."""
    (first, first_backend), (second, second_backend) = fake_app(), fake_app()
    assert first.state.urls is not second.state.urls
    signed = "https://cdn.example.com/separate.safetensors?X-Amz-Signature=SECRET"
    adapter_id = AdapterRef.named(signed).adapter_id
    with TestClient(first) as one, TestClient(second) as two:
        assert one.post("/", json={"inputs": "a fox"}, headers={"lora": signed}).status_code == 200
        assert one.post("/", json={"inputs": "a fox"}, headers={"lora": adapter_id}).status_code == 200
        assert two.post("/", json={"inputs": "a fox"}, headers={"lora": adapter_id}).status_code == 200
    assert [request.loras[0].url for request, _ in first_backend.generated] == [signed, signed]
    assert [request.loras[0].url for request, _ in second_backend.generated] == [None], "the other app's URL"
    assert first.state.urls.url(adapter_id) == signed and second.state.urls.url(adapter_id) is None
