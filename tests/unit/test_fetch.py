"""fetch.py against real HTTP servers on 127.0.0.1: what is fetched, what is refused, and that a
refused fetch never reached the host (the server's log) nor leaked a token into its message."""

import hashlib
import io
import pickle
import shutil
import socket
import ssl
import subprocess
import time

import httpcore
import pytest
import torch
from safetensors.torch import save_file
from support.servers import free_port
from support.web import Web, body, drip, redirect, slow, status, stream

from loraswap.adapters.sources.fetch import FetchRules, allowed_host, check_url, display_url, fetch_file, fetch_json
from loraswap.errors import AdapterForbidden, AdapterInvalid, AdapterNotFound, AdapterUnavailable

BIG = 64 * 2**20  # far more than loopback socket buffers hold: a hang-up leaves most of it unsent
CAP = 2**20


@pytest.fixture(scope="module")
def lora(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("lora") / "a.safetensors"
    torch.manual_seed(0)
    save_file({"unet.down.lora_A.weight": torch.randn(4, 64), "unet.down.lora_B.weight": torch.randn(64, 4)}, path)
    return path.read_bytes()


@pytest.fixture
def web(lora):
    web = Web({"/a.safetensors": body(lora, {"ETag": '"v1"'}),
               "/r1": redirect("/a.safetensors"), "/r2": redirect("/r1"), "/r3": redirect("/r2"),
               "/api": body(b'{"files": [1, 2]}'), "/html": body(b"<!DOCTYPE html><html></html>"),
               "/404": status(404), "/410": status(410), "/401": status(401), "/403": status(403),
               "/418": status(418), "/500": status(500), "/503": status(503), "/headers": body(b"{}")})
    yield web
    web.close()


@pytest.fixture
def connects(monkeypatch) -> list[str]:
    """The hosts sockets were opened to (after fetch.py's checks)."""
    seen, original = [], httpcore.SyncBackend.connect_tcp

    def recorded(self, host, port, *args, **kwargs):
        seen.append(host)
        return original(self, host, port, *args, **kwargs)
    monkeypatch.setattr(httpcore.SyncBackend, "connect_tcp", recorded)
    return seen


def named(web: Web, *more: str) -> FetchRules:
    return FetchRules(allow=(f"127.0.0.1:{web.port}", *more), max_bytes=CAP, read_timeout=2.0)


def test_a_file_is_fetched_whole_with_its_digest_and_no_query_kept(web, lora, tmp_path):
    dest = tmp_path / "part"
    got = fetch_file(web.url("/a.safetensors?token=SECRET"), dest, named(web), "style/a")
    assert dest.read_bytes() == lora
    assert (got.path, got.size, got.sha256, got.etag) == (dest, len(lora), hashlib.sha256(lora).hexdigest(), '"v1"')
    assert got.final_url == web.url("/a.safetensors")
    assert web.paths() == ["/a.safetensors?token=SECRET"]  # the query is sent, only never shown


def test_patterns_match_host_or_host_port_case_insensitively():
    assert allowed_host("CDN.Example.com", 443, ("*.example.com",))
    assert allowed_host("cdn.example.com", 8443, ("cdn.example.com:8443",))
    assert not allowed_host("cdn.example.com", 443, ("cdn.example.com:8443",))
    assert not allowed_host("example.com.evil.org", 443, ("*.example.com",))
    assert allowed_host("anything.org", 443, ("*",))
    assert allowed_host("::1", 8443, ("[::1]:8443",))
    assert not allowed_host("x.org", 443, ())


def test_display_url_keeps_scheme_host_port_path_only():
    assert display_url("https://u:SECRET@Host.COM:8443/a/b.safetensors?token=SECRET#f") == \
        "https://host.com:8443/a/b.safetensors"
    assert display_url("http://[::1]/x?sig=SECRET") == "http://[::1]/x"
    assert display_url("http://[::1") == "(an unparseable URL)"


def test_plain_http_needs_a_pattern_naming_the_host(web, lora, tmp_path):
    for allow in (("*",), ("127.0.0.*",)):
        with pytest.raises(AdapterForbidden, match=f"plain http.*--url-allow 127.0.0.1:{web.port}") as refused:
            fetch_file(web.url("/a.safetensors"), tmp_path / "x", FetchRules(allow, CAP), "a")
        assert refused.value.status == 403
    with pytest.raises(AdapterForbidden, match="host 127.0.0.1 is not allowed.*--url-allow 127.0.0.1$"):
        fetch_file(web.url("/a.safetensors"), tmp_path / "x", FetchRules(("127.0.0.1:1",), CAP), "a")
    assert web.log == []  # refused before any request
    for allow in ((f"127.0.0.1:{web.port}",), ("127.0.0.1",)):
        assert fetch_file(web.url("/a.safetensors"), tmp_path / "x", FetchRules(allow, CAP), "a").size == len(lora)


def test_other_schemes_and_userinfo_are_refused(web, tmp_path, connects):
    rules = FetchRules(("*", f"127.0.0.1:{web.port}"), CAP)
    for url in ("file:///etc/passwd", "ftp://example.com/a.safetensors", "gopher://example.com/",
                "data:application/octet-stream;base64,AAAA", f"http://user:SECRET@127.0.0.1:{web.port}/a.safetensors"):
        with pytest.raises(AdapterForbidden) as refused:
            fetch_file(url, tmp_path / "x", rules, "a")
        assert "SECRET" not in str(refused.value)
    assert connects == [] and web.log == []


def test_loopback_is_refused_under_star_and_reached_when_named(web, lora, tmp_path, connects):
    star = FetchRules(("*",), CAP)
    for url in (f"https://127.0.0.1:{web.port}/a.safetensors", f"https://localhost:{web.port}/a.safetensors"):
        with pytest.raises(AdapterForbidden, match="loopback address") as refused:
            fetch_file(url, tmp_path / "x", star, "a")
        assert f"--url-allow {url.split('/')[2]}" in refused.value.fix
    assert connects == [] and web.log == []
    rules = FetchRules((f"localhost:{web.port}",), CAP)
    got = fetch_file(web.url("/a.safetensors", "localhost"), tmp_path / "x", rules, "a")
    assert got.sha256 == hashlib.sha256(lora).hexdigest() and web.log[0]["host"] == f"localhost:{web.port}"
    assert connects == ["127.0.0.1"]  # the checked address itself, not the name resolved again


@pytest.mark.parametrize("ip", ["169.254.169.254", "[fd00:ec2::254]", "100.100.100.200", "[::ffff:169.254.169.254]",
                                "10.0.0.1", "192.168.1.1", "172.16.0.1", "100.64.0.1", "0.0.0.0", "224.0.0.1",
                                "[::1]", "[fe80::1]", "[64:ff9b::a9fe:a9fe]"])
def test_private_and_metadata_addresses_are_refused_without_a_connection(ip, tmp_path, connects):
    with pytest.raises(AdapterForbidden, match="address"):
        fetch_file(f"https://{ip}/latest/meta-data", tmp_path / "x", FetchRules(("*",), CAP), "a")
    assert connects == []


def test_an_ip_named_literally_is_connected_to(tmp_path, connects, monkeypatch):
    def refuse(self, host, *args, **kwargs):
        connects.append(host)
        raise httpcore.ConnectError("[Errno 111] Connection refused")
    monkeypatch.setattr(httpcore.SyncBackend, "connect_tcp", refuse)
    with pytest.raises(AdapterUnavailable, match="could not connect"):
        fetch_file("https://10.0.0.1/a.safetensors", tmp_path / "x", FetchRules(("*", "10.0.0.1"), CAP), "a")
    assert connects == ["10.0.0.1"]

    def silent(self, host, *args, **kwargs):
        raise httpcore.ConnectTimeout("timed out")
    monkeypatch.setattr(httpcore.SyncBackend, "connect_tcp", silent)
    with pytest.raises(AdapterUnavailable, match="its host did not answer within 10 s"):
        fetch_file("https://10.0.0.1/a.safetensors", tmp_path / "x", FetchRules(("10.0.0.1",), CAP), "a")


def test_only_the_public_addresses_of_a_name_are_connected_to(tmp_path, monkeypatch, connects):
    def resolve(host, port, *args, **kwargs):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ("169.254.169.254", "8.8.8.8")]

    def refuse(self, host, *args, **kwargs):
        connects.append(host)
        raise httpcore.ConnectError("[Errno 111] Connection refused")
    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.setattr(httpcore.SyncBackend, "connect_tcp", refuse)
    with pytest.raises(AdapterUnavailable, match="could not connect"):
        fetch_file("https://mixed.example/a.safetensors", tmp_path / "x", FetchRules(("*",), CAP), "a")
    assert connects == ["8.8.8.8"]  # the public one alone (the connect is faked: nothing leaves the machine)


def test_the_address_is_checked_at_connect_time(web, lora, tmp_path, monkeypatch, connects):
    """A public-looking name that resolves to loopback (DNS rebinding) is caught where the socket opens."""
    real = socket.getaddrinfo

    def rebinding(host, port, *args, **kwargs):
        return real("127.0.0.1" if host == "files.example" else host, port, *args, **kwargs)
    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    with pytest.raises(AdapterForbidden, match="files.example resolves to 127.0.0.1, a loopback address"):
        fetch_file(f"https://files.example:{web.port}/a.safetensors", tmp_path / "x", FetchRules(("*",), CAP), "a")
    assert connects == [] and web.log == []
    got = fetch_file(f"http://files.example:{web.port}/a.safetensors", tmp_path / "x",
                     FetchRules(("files.example",), CAP), "a")
    assert got.size == len(lora) and connects == ["127.0.0.1"]


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for the name `localhost` (no IP address in it)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl makes the test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", key, "-out", cert, "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost"], check=True, capture_output=True)
    return cert, key


@pytest.fixture
def tls_web(certificate, lora, web):
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*certificate)
    tls_web = Web({"/a.safetensors": body(lora), "/down": redirect(web.url("/a.safetensors", "localhost"))}, context)
    yield tls_web
    tls_web.close()


def test_tls_is_verified_for_the_name_while_the_checked_ip_is_connected_to(tls_web, certificate, lora, tmp_path,
                                                                            monkeypatch, connects):
    rules = FetchRules((f"localhost:{tls_web.port}", f"127.0.0.1:{tls_web.port}"), CAP)
    with pytest.raises(AdapterUnavailable, match="certificate verify failed"):  # httpx's trust store: not ours
        fetch_file(tls_web.url("/a.safetensors", "localhost"), tmp_path / "x", rules, "a")
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0]))  # as httpx honours it, so does fetch.py
    got = fetch_file(tls_web.url("/a.safetensors", "localhost"), tmp_path / "x", rules, "a")
    assert got.sha256 == hashlib.sha256(lora).hexdigest() and connects == ["127.0.0.1", "127.0.0.1"]
    with pytest.raises(AdapterUnavailable, match="certificate verify failed"):  # the name checked, not the IP
        fetch_file(tls_web.url("/a.safetensors", "127.0.0.1"), tmp_path / "x", rules, "a")
    assert tls_web.sni == ["localhost", "localhost", None]  # no SNI for an IP literal


def test_https_is_not_downgraded_to_http_by_a_redirect(tls_web, web, certificate, tmp_path, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0]))
    rules = FetchRules((f"localhost:{tls_web.port}", "*"), CAP)
    with pytest.raises(AdapterForbidden, match=f"https://localhost:{tls_web.port}/down redirected to http://.*plain"):
        fetch_file(tls_web.url("/down", "localhost"), tmp_path / "x", rules, "a")
    assert tls_web.paths() == ["/down"] and web.log == []
    named_too = FetchRules(rules.allow + (f"localhost:{web.port}",), CAP)
    assert fetch_file(tls_web.url("/down", "localhost"), tmp_path / "x", named_too, "a").final_url == \
        web.url("/a.safetensors", "localhost")


def test_redirects_are_followed_up_to_the_limit(web, lora, tmp_path):
    got = fetch_file(web.url("/r3?token=SECRET"), tmp_path / "x", named(web), "a")
    assert got.final_url == web.url("/a.safetensors") and got.size == len(lora)
    with pytest.raises(AdapterUnavailable, match="redirected more than 2 times") as refused:
        fetch_file(web.url("/r3?token=SECRET"), tmp_path / "x", FetchRules(named(web).allow, CAP, max_redirects=2), "a")
    assert refused.value.status == 502 and "SECRET" not in str(refused.value)


def test_every_redirect_is_checked_again(web, tmp_path, connects):
    web.routes["/away"] = redirect(web.url("/a.safetensors", "localhost"))
    web.routes["/metadata"] = redirect("https://169.254.169.254/latest/meta-data")
    web.routes["/file"] = redirect("file:///etc/passwd")
    with pytest.raises(AdapterForbidden, match="redirected to .*localhost.* not allowed"):
        fetch_file(web.url("/away"), tmp_path / "x", named(web), "a")
    with pytest.raises(AdapterForbidden, match="plain http"):  # "*" does not turn a redirect into plain http
        fetch_file(web.url("/away"), tmp_path / "x", named(web, "*"), "a")
    with pytest.raises(AdapterForbidden, match="cloud-metadata address"):
        fetch_file(web.url("/metadata"), tmp_path / "x", named(web, "*"), "a")
    with pytest.raises(AdapterForbidden, match="only https"):
        fetch_file(web.url("/file"), tmp_path / "x", named(web, "*"), "a")
    assert web.paths() == ["/away", "/away", "/metadata", "/file"]  # nothing fetched from where they pointed
    assert connects == ["127.0.0.1"] * 4


def test_authorization_is_dropped_when_a_redirect_leaves_the_host(web, tmp_path):
    web.routes["/same"] = redirect("/headers")
    web.routes["/other"] = redirect(web.url("/headers", "localhost"))
    rules = named(web, f"localhost:{web.port}")
    secret = {"Authorization": "Bearer SECRET", "Cookie": "s=SECRET", "X-Trace": "1"}
    assert fetch_json(web.url("/same"), rules, "a", secret) == {}
    assert fetch_json(web.url("/other"), rules, "a", secret) == {}
    seen = [(entry["path"], entry["headers"].get("Authorization"), entry["headers"].get("Cookie"),
             entry["headers"].get("X-Trace")) for entry in web.log]
    assert seen == [("/same", "Bearer SECRET", "s=SECRET", "1"), ("/headers", "Bearer SECRET", "s=SECRET", "1"),
                    ("/other", "Bearer SECRET", "s=SECRET", "1"), ("/headers", None, None, "1")]


def test_the_size_cap_stops_the_stream(web, lora, tmp_path):
    head = lora[:8 + int.from_bytes(lora[:8], "little")]  # a real header, then far too much data
    web.routes["/chunked"] = stream(web, "/chunked", head, BIG)
    web.routes["/declared"] = stream(web, "/declared", head, BIG, content_length=BIG)
    for path in ("/chunked", "/declared"):
        dest = tmp_path / "part"
        with pytest.raises(AdapterInvalid, match=f"larger than {CAP} bytes.*--max-adapter-mb"):
            fetch_file(web.url(path), dest, named(web), "a")
        record = web.wait_stream(path)
        assert not dest.exists() and record["hung_up"] and record["sent"] < BIG / 2, record


def test_a_lying_content_length_bounds_what_is_read(web, tmp_path):
    web.routes["/lying"] = stream(web, "/lying", b"x" * 1000, 8 * CAP, content_length=1000)
    got = fetch_file(web.url("/lying"), tmp_path / "x", named(web), "a", safetensors=False)
    assert got.size == 1000 and (tmp_path / "x").read_bytes() == b"x" * 1000


def torch_zip() -> bytes:
    out = io.BytesIO()
    torch.save({"weight": torch.zeros(64)}, out)
    return out.getvalue()


@pytest.mark.parametrize("head", [pickle.dumps({"weight": b"\0" * 256}), torch_zip(), b"PK\x03\x04" + bytes(60),
                                  b"<!DOCTYPE html><html>", (2).to_bytes(8, "little") + b"[]",
                                  (20).to_bytes(8, "little") + b"{not json at all\xff\xfe\xfd"],
                         ids=["pickle", "torch-zip", "zip-small-length", "html", "json-list", "not-json"])
def test_what_is_not_safetensors_is_refused_before_its_body(web, tmp_path, head):
    web.routes["/weights"] = stream(web, "/weights", head, BIG)
    dest = tmp_path / "part"
    with pytest.raises(AdapterInvalid, match="is not a safetensors file"):
        fetch_file(web.url("/weights"), dest, FetchRules(named(web).allow, 2 * BIG), "a")
    record = web.wait_stream("/weights")
    assert not dest.exists() and record["hung_up"] and record["sent"] < BIG / 2, record


def test_timeouts_and_refused_connections_are_upstream_failures(web, tmp_path):
    web.routes["/slow"] = slow(web, 10)
    rules = FetchRules(named(web).allow + (f"127.0.0.1:{(port := free_port())}",), CAP, read_timeout=0.5)
    start = time.monotonic()
    with pytest.raises(AdapterUnavailable, match="sent nothing for 0.5 s") as slow_error:
        fetch_file(web.url("/slow"), tmp_path / "x", rules, "a")
    assert time.monotonic() - start < 2 and slow_error.value.status == 502
    with pytest.raises(AdapterUnavailable, match="could not connect"):
        fetch_file(f"http://127.0.0.1:{port}/a.safetensors", tmp_path / "x", rules, "a")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("url", ["https://" + "a" * 64 + ".example.com/a.safetensors",
                                 "https://a..example.com/a.safetensors"], ids=["label-of-64", "empty-label"])
def test_a_host_name_idna_cannot_encode_is_an_unresolvable_host(url, tmp_path, connects):
    """Under --url-allow '*', a label over 63 characters or an empty one makes the resolver raise
    UnicodeError: refused as a name that does not resolve (502), never an unexpected error (500);
    the check of a cached download's URL lets it pass as it lets any unresolvable name."""
    rules = FetchRules(("*",), CAP)
    with pytest.raises(AdapterUnavailable, match="could not connect to its host") as error:
        fetch_file(url, tmp_path / "x", rules, "url:a")
    assert error.value.status == 502 and "did not resolve" in error.value.problem
    check_url(url, rules, "url:a")
    assert connects == [] and not (tmp_path / "x").exists()


@pytest.mark.parametrize("headers_too", [False, True], ids=["body", "headers"])
def test_a_host_dripping_bytes_is_cut_off_at_the_deadline(web, lora, tmp_path, headers_too):
    """A byte every 0.1 s beats a 0.5 s read timeout for ever; the whole fetch's deadline does not."""
    web.routes["/drip"] = drip(web, lora[:64], len(lora), 0.1, headers_too)
    rules = FetchRules(named(web).allow, CAP, read_timeout=0.5, total_timeout=1.0)
    start = time.monotonic()
    with pytest.raises(AdapterUnavailable, match="did not send the whole answer within 1 s") as error:
        fetch_file(web.url("/drip"), tmp_path / "x", rules, "a")
    assert 0.9 < time.monotonic() - start < 2.0 and error.value.status == 502
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(("path", "error"), [("/404", AdapterNotFound), ("/410", AdapterNotFound),
                                             ("/401", AdapterForbidden), ("/403", AdapterForbidden),
                                             ("/418", AdapterInvalid), ("/500", AdapterUnavailable),
                                             ("/503", AdapterUnavailable)])
def test_upstream_statuses_map_to_loraswap_errors(web, tmp_path, path, error):
    with pytest.raises(error, match=f"answered HTTP {path[1:]}") as raised:
        fetch_file(web.url(path), tmp_path / "x", named(web), "a")
    assert type(raised.value) is error and not (tmp_path / "x").exists()
    if path in ("/401", "/403"):
        assert "token" in raised.value.fix


def test_errors_never_carry_a_token_or_query(web, tmp_path):
    web.routes["/slow"] = slow(web, 10)
    rules = FetchRules(named(web).allow, CAP, read_timeout=0.5, max_redirects=1)
    secret = {"Authorization": "Bearer SECRET"}
    errors = []
    for url in [web.url(p + "?token=SECRET") for p in ("/404", "/401", "/500", "/slow", "/html", "/r3")] + \
               [f"https://127.0.0.1:{web.port}/x?token=SECRET", "ftp://h/x?token=SECRET",
                f"http://127.0.0.1:{free_port()}/x?token=SECRET"]:
        with pytest.raises((AdapterForbidden, AdapterNotFound, AdapterInvalid, AdapterUnavailable)) as raised:
            fetch_file(url, tmp_path / "x", rules, url, secret)  # even an id that is the URL itself
        errors.append(raised.value)
    assert len(errors) == 9
    for error in errors:
        assert "SECRET" not in str(error) and "token" not in error.adapter_id and "://" in error.adapter_id
    with pytest.raises(AdapterForbidden) as raised:
        fetch_file(web.url("/x", "u:SECRET@127.0.0.1"), tmp_path / "x", rules, "a")
    assert "SECRET" not in str(raised.value)


def test_json_answers_are_parsed_and_capped(web):
    rules = named(web)
    assert fetch_json(web.url("/api?token=SECRET"), rules, "civitai:1@2") == {"files": [1, 2]}
    with pytest.raises(AdapterInvalid, match="did not answer JSON"):
        fetch_json(web.url("/html"), rules, "civitai:1@2")
    with pytest.raises(AdapterInvalid, match="is over 8 B"):
        fetch_json(web.url("/api"), rules, "civitai:1@2", max_bytes=8)
    with pytest.raises(AdapterNotFound):
        fetch_json(web.url("/404"), rules, "civitai:1@2")
    assert web.log[0]["headers"]["Accept"] == "application/json"


def test_a_host_dripping_a_byte_every_29_s_is_cut_by_the_total_deadline(web, lora, tmp_path):
    """Under a 30 s read timeout a byte every 29 s never times out a read: the fetch's own total
    deadline ends it."""
    web.routes["/drip29"] = drip(web, lora[:64], len(lora), 29.0)
    rules = FetchRules(named(web).allow, CAP, read_timeout=30.0, total_timeout=1.5)
    start = time.monotonic()
    with pytest.raises(AdapterUnavailable, match="did not send the whole answer within 1.5 s"):
        fetch_file(web.url("/drip29"), tmp_path / "x", rules, "a")
    assert 1.4 < time.monotonic() - start < 3.0 and not (tmp_path / "x").exists()


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_room_is_reserved_before_the_bytes_are_written(web, tmp_path, declared):
    """The download cache's budget: a declared length is reserved whole before the body; a body of
    no length a MiB ahead as it comes; the file keeps exactly the bytes received."""
    head, total = b"\x02\x00\x00\x00\x00\x00\x00\x00{}", 3 * 2**20 + 5
    web.routes["/big"] = stream(web, "/big", head, total, content_length=total if declared else None)
    dest, calls = tmp_path / "x", []

    def reserve(size, ahead):
        calls.append((size, ahead, dest.stat().st_size))  # (asked, ahead, bytes on disk then)

    fetched = fetch_file(web.url("/big"), dest, FetchRules(named(web).allow, 8 * 2**20), "a", reserve=reserve)
    assert fetched.size == total == dest.stat().st_size
    assert all(size >= on_disk for size, _, on_disk in calls), "reserved before written"
    if declared:
        assert calls[0] == (total, 0, 0), "the whole declared size, before a byte of the body"
    else:
        assert calls[0][2] == 0 and calls[-1][0] == total and {ahead for _, ahead, _ in calls} == {2**20}
