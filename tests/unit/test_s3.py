"""S3 as an adapter source, against moto's S3 server on 127.0.0.1 (a real HTTP endpoint): the object
fetched whole, missing ones 404, pickles and oversized objects refused having read (almost) nothing,
bad or missing credentials refused without quoting them, an unreachable, silent or failing store 502."""

import hashlib
import io
import pickle
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3
import botocore.response
import pytest
import torch
from moto.core import enable_iam_authentication
from moto.server import ThreadedMotoServer
from safetensors.torch import load_file, save
from support.servers import free_port

from loraswap.adapters.sources import s3
from loraswap.adapters.sources.s3 import S3Settings, fetch_s3
from loraswap.errors import AdapterForbidden, AdapterInvalid, AdapterNotFound, AdapterUnavailable

BUCKET = "adapters"
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


@pytest.fixture(scope="module")
def endpoint():
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture(autouse=True)
def aws_env(monkeypatch, tmp_path):
    """Fake credentials, and nothing of this machine's own AWS setup (files, profile, instance role)."""
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_MAX_ATTEMPTS",
                 "AWS_RETRY_MODE", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3.s3_client.cache_clear()  # a client keeps the credentials it was made with: each test makes its own
    yield
    s3.s3_client.cache_clear()


@pytest.fixture(scope="module")
def store(endpoint):
    """A client of the test's own to put objects; the bucket made once."""
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    client.create_bucket(Bucket=BUCKET)
    return client


@pytest.fixture
def bytes_read(monkeypatch):
    """How many body bytes botocore handed to loraswap, over all reads."""
    count = [0]
    read = botocore.response.StreamingBody.read

    def counting(self, amt=None):
        out = read(self, amt)
        count[0] += len(out)
        return out

    monkeypatch.setattr(botocore.response.StreamingBody, "read", counting)
    return count


def _adapter() -> bytes:
    torch.manual_seed(0)
    tensors = {"unet.up.lora_A.weight": torch.randn(4, 320), "unet.up.lora_B.weight": torch.randn(1280, 1024)}
    return save(tensors, metadata={"format": "pt"})  # ~5 MiB: several chunks


def test_a_safetensors_object_is_fetched_whole(store, endpoint, tmp_path):
    data = _adapter()
    store.put_object(Bucket=BUCKET, Key="style/anime.safetensors", Body=data)
    dest = tmp_path / "partial"
    size, sha256 = fetch_s3(BUCKET, "style/anime.safetensors", dest, S3Settings(endpoint_url=endpoint),
                            "s3:adapters/style/anime.safetensors")
    assert dest.read_bytes() == data
    assert (size, sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert load_file(dest)["unet.up.lora_B.weight"].shape == (1280, 1024)


@pytest.mark.parametrize("bucket,key", [(BUCKET, "no/such.safetensors"), ("no-such-bucket", "a.safetensors")])
def test_a_missing_key_or_bucket_is_404(store, endpoint, tmp_path, bucket, key):
    dest = tmp_path / "partial"
    with pytest.raises(AdapterNotFound) as caught:
        fetch_s3(bucket, key, dest, S3Settings(endpoint_url=endpoint), f"s3:{bucket}/{key}")
    assert caught.value.status == 404 and caught.value.adapter_id == f"s3:{bucket}/{key}"
    assert f"s3://{bucket}/{key} does not exist" in caught.value.message
    assert ("NoSuchKey" if bucket == BUCKET else "NoSuchBucket") in caught.value.message
    assert not dest.exists()


@pytest.mark.parametrize("kind,data", [
    ("pickle", pickle.dumps({"w": list(range(200_000))})),
    ("torch.save zip", (lambda b: (torch.save({"w": torch.zeros(100_000)}, b), b.getvalue())[1])(io.BytesIO())),
    ("header not JSON", (50).to_bytes(8, "little") + b"x" * 50 + bytes(100_000)),
])
def test_a_non_safetensors_object_is_refused_having_read_its_head(store, endpoint, tmp_path, bytes_read, kind, data):
    store.put_object(Bucket=BUCKET, Key="bad.ckpt", Body=data)
    dest = tmp_path / "partial"
    with pytest.raises(AdapterInvalid, match="is not a safetensors file") as caught:
        fetch_s3(BUCKET, "bad.ckpt", dest, S3Settings(endpoint_url=endpoint), "s3:adapters/bad.ckpt")
    assert caught.value.status == 400 and "s3://adapters/bad.ckpt" in caught.value.message
    assert not dest.exists()
    assert bytes_read[0] <= 58, f"{kind}: {bytes_read[0]} of {len(data)} bytes read"


def test_an_object_over_the_cap_is_refused_before_its_body_is_read(store, endpoint, tmp_path, bytes_read):
    data = _adapter()
    store.put_object(Bucket=BUCKET, Key="big.safetensors", Body=data)
    dest = tmp_path / "partial"
    with pytest.raises(AdapterInvalid, match=f"larger than {2**20} bytes") as caught:
        fetch_s3(BUCKET, "big.safetensors", dest, S3Settings(endpoint_url=endpoint, max_bytes=2**20),
                 "s3:adapters/big.safetensors")
    assert "--max-adapter-mb" in caught.value.fix
    assert bytes_read[0] == 0 and not dest.exists()


def test_the_cap_holds_while_streaming_when_the_store_understates_the_size(store, endpoint, tmp_path, bytes_read,
                                                                          monkeypatch):
    data = _adapter()
    store.put_object(Bucket=BUCKET, Key="big.safetensors", Body=data)
    client = s3.s3_client(S3Settings(endpoint_url=endpoint, max_bytes=2**20))  # the one fetch_s3 will use
    get_object = client.get_object
    monkeypatch.setattr(client, "get_object",  # ContentLength says 1 KiB; the body goes on
                        lambda **kwargs: {**get_object(**kwargs), "ContentLength": 1024})
    dest = tmp_path / "partial"
    with pytest.raises(AdapterInvalid, match=f"larger than {2**20} bytes"):
        fetch_s3(BUCKET, "big.safetensors", dest, S3Settings(endpoint_url=endpoint, max_bytes=2**20),
                 "s3:adapters/big.safetensors")
    assert not dest.exists()
    assert 2**20 < bytes_read[0] <= 2**20 + s3.CHUNK, "stopped one chunk past the cap, not at the end"


def _forbidden(endpoint, tmp_path, key_id: str, secret: str) -> AdapterForbidden:
    dest = tmp_path / "partial"
    with pytest.raises(AdapterForbidden) as caught:
        fetch_s3(BUCKET, "style/anime.safetensors", dest, S3Settings(endpoint_url=endpoint),
                 "s3:adapters/style/anime.safetensors")
    assert not dest.exists()
    error = caught.value
    assert error.status == 403 and error.adapter_id == "s3:adapters/style/anime.safetensors"
    assert "AWS_ACCESS_KEY_ID" in error.fix and "AWS_PROFILE" in error.fix
    assert secret not in error.message and key_id not in error.message
    return error


def test_wrong_credentials_are_refused_naming_no_key_or_secret(store, endpoint, tmp_path, monkeypatch):
    store.put_object(Bucket=BUCKET, Key="style/anime.safetensors", Body=_adapter())
    iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                       aws_secret_access_key="testing")
    iam.create_user(UserName="no-rights")  # a real user of the store with no policy: may read nothing
    keys = iam.create_access_key(UserName="no-rights")["AccessKey"]
    with enable_iam_authentication():  # moto checks keys and policies only when told to
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        assert "InvalidAccessKeyId" in _forbidden(endpoint, tmp_path, "AKIAUNKNOWNKEY000000", SECRET).message
        s3.s3_client.cache_clear()
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", keys["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", keys["SecretAccessKey"])
        error = _forbidden(endpoint, tmp_path, keys["AccessKeyId"], keys["SecretAccessKey"])
        assert "AccessDenied" in error.message


def test_no_credentials_at_all_are_refused(endpoint, tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    assert "no AWS credentials" in _forbidden(endpoint, tmp_path, "testing", "testing").message


def test_an_endpoint_where_nothing_listens_is_unavailable_within_seconds(tmp_path):
    settings = S3Settings(endpoint_url=f"http://127.0.0.1:{free_port()}", connect_timeout=1, read_timeout=1)
    dest = tmp_path / "partial"
    started = time.monotonic()
    with pytest.raises(AdapterUnavailable, match="could not connect") as caught:  # after boto3's default 3 attempts
        fetch_s3(BUCKET, "a.safetensors", dest, settings, "s3:adapters/a.safetensors")
    assert time.monotonic() - started < 8
    assert caught.value.status == 502 and caught.value.adapter_id == "s3:adapters/a.safetensors"
    assert "s3://adapters/a.safetensors" in caught.value.message and not dest.exists()


def test_a_silent_store_times_out_and_a_failing_one_is_unavailable(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # the standard setting, read by boto3: no retries here
    with socket.socket() as silent:  # listens, so connects succeed; never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        settings = S3Settings(endpoint_url=f"http://127.0.0.1:{silent.getsockname()[1]}", read_timeout=0.5)
        with pytest.raises(AdapterUnavailable, match="sent nothing for 0.5 s"):
            fetch_s3(BUCKET, "a.safetensors", tmp_path / "partial", settings, "s3:adapters/a.safetensors")

    class Failing(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        settings = S3Settings(endpoint_url=f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(AdapterUnavailable, match="answered HTTP 503 SlowDown") as caught:
            fetch_s3(BUCKET, "a.safetensors", tmp_path / "partial", settings, "s3:adapters/a.safetensors")
        assert "try again later" in caught.value.fix and not (tmp_path / "partial").exists()
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("headers_too", [False, True], ids=["body", "headers"])
def test_a_store_dripping_a_byte_a_second_is_cut_at_the_total_timeout(tmp_path, headers_too):
    """A store sending one byte a second, from its answer's first header or from its body, never
    trips a per-read timeout; the object's total timeout (--download-timeout-s) shuts its socket:
    a 502 then, not when the store stops (it would drip for days), nor after boto3's retries."""
    from support.web import Web, drip

    data = _adapter()
    web = Web({})
    web.routes[f"/{BUCKET}/slow.safetensors"] = drip(web, data[:64], len(data), 1.0, headers_too=headers_too)
    settings = S3Settings(endpoint_url=web.url(""), read_timeout=5, total_timeout=2)
    dest = tmp_path / "partial"
    started = time.monotonic()
    try:
        with pytest.raises(AdapterUnavailable, match=r"did not send s3://adapters/slow.safetensors within 2 s") as e:
            fetch_s3(BUCKET, "slow.safetensors", dest, settings, "s3:adapters/slow.safetensors")
    finally:
        web.close()
    assert time.monotonic() - started < 15, "cut at the deadline, not when the store gives up"
    assert e.value.status == 502 and "--download-timeout-s" in e.value.fix and not dest.exists()
    assert web.paths().count(f"/{BUCKET}/slow.safetensors") == 1, "no retry past the deadline"


def test_retries_stop_where_their_pause_could_end_past_the_deadline(tmp_path, monkeypatch):
    """A store answering 503 SlowDown to everything, under 10 attempts (AWS_MAX_ATTEMPTS): boto3
    pauses up to 1, 2, 4, 8... s between them (a minute in all); with a 3 s total timeout no retry
    starts whose pause could end past it, so the fetch ends by then."""
    from support.web import Web, send

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "10")
    slow_down = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
    web = Web({f"/{BUCKET}/busy.safetensors": lambda handler: send(handler, 503, slow_down)})
    settings = S3Settings(endpoint_url=web.url(""), read_timeout=5, total_timeout=3)
    started = time.monotonic()
    try:
        with pytest.raises(AdapterUnavailable, match="answered HTTP 503 SlowDown") as e:
            fetch_s3(BUCKET, "busy.safetensors", tmp_path / "partial", settings, "s3:adapters/busy.safetensors")
        took = time.monotonic() - started
    finally:
        web.close()
    assert took < 3.5, f"{took:.1f} s: a retry's pause ended past the 3 s deadline"
    assert e.value.status == 502 and not (tmp_path / "partial").exists()
