"""The URLs behind `url:` ids: held while a request naming them is unanswered, kept after it
only if it was accepted, in a table bounded in count and bytes that never drops a
held or pinned URL; each kept URL scoped to the keys whose accepted requests named it."""

import pytest

from loraswap.adapters.naming.references import NamedUrls, UrlReference, adapter_id_of, reference_of, url_book
from loraswap.adapters.sources.url_book import UrlBook, url_bytes


def url(i: int, length: int = 100) -> str:
    tail = f"/{i:06d}.safetensors?X-Amz-Signature=SECRET"
    return "https://cdn.example.com/" + "x" * (length - len(tail) - 24) + tail


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
        book.remember(f"url:{i}", url(i))
    assert book.size() == (3, 3 * each) and book.url("url:0") is None and book.url("url:1") is None
    book.url("url:2")  # a use: now the most recently used
    book.remember("url:5", url(5))
    assert {i for i in range(6) if book.url(f"url:{i}")} == {2, 4, 5}
    book.remember("url:long", url(6, length=4 * each - url_bytes("")))  # 4 of the others
    assert book.size() == (2, 5 * each) and book.url("url:long") and book.url("url:5"), "within the bytes"


def test_held_and_pinned_urls_are_never_dropped_to_make_room():
    book = UrlBook(max_urls=2, max_bytes=10**6)
    book.hold("url:held", url(1))
    book.remember("url:kept", url(2))
    assert book.pin("url:kept") and not book.pin("url:unknown")
    for i in range(10):
        book.remember(f"url:{i}", url(10 + i))
    assert book.url("url:held") and book.url("url:kept"), "a request in flight and a kept adapter still need them"
    assert {i for i in range(10) if book.url(f"url:{i}")} == {8, 9}, "they count in no bound"
    book.release("url:held", accepted=False)
    book.unpin("url:kept")  # an ordinary kept URL again, and the least recently used: it makes room
    assert book.url("url:held") is None and book.url("url:kept") is None and book.size()[0] == 2


def test_a_requests_named_urls_are_held_until_it_is_released():
    before = url_book().size()
    first, second = url(101), url(102)
    named = NamedUrls(owner="k1")
    ids = [adapter_id_of(first, named), adapter_id_of(second, named), adapter_id_of(first, named)]
    assert ids[0] == ids[2] == UrlReference(first).adapter_id and reference_of(ids[1]).url == second
    assert named.named_by_url(ids[0]) and not named.by_id
    assert adapter_id_of(ids[1], named) == ids[1] and named.by_id == {ids[1]}, "named by its id too"
    named.release(accepted=False)
    named.release(accepted=True)  # a second release does nothing
    assert reference_of(ids[0]) is None and reference_of(ids[1]) is None and url_book().size() == before


@pytest.mark.parametrize("accepted", [True, False])
def test_an_accepted_requests_urls_are_scoped_to_its_key(accepted):
    named = NamedUrls(owner="k1")
    adapter_id = adapter_id_of(url(200 + accepted), named)
    named.release(accepted=accepted)
    assert url_book().owned_by(adapter_id, "k1") is accepted and not url_book().owned_by(adapter_id, "k2")
