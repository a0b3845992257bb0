"""Adapters named by URL and by Civitai AIR in a request body's `loras`, against real HTTP
servers the tests start: the same image as the same file in the adapter folder, one
download however often it is named, a download kept across a restart, and each refusal a
4xx naming what to fix, with nothing fetched from a host that is not allowed."""

import base64
import hashlib
import json

import pytest
from fastapi.testclient import TestClient
from support.images import pixels_of
from support.servers import wait_ready
from support.web import Web, body, send

from loraswap.engine.config.engine import EngineConfig
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig

PROMPT = {"prompt": "a lighthouse", "size": "64x64", "seed": 7, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def files(adapter_factory, tmp_path_factory):
    folder = tmp_path_factory.mktemp("folder")
    path = adapter_factory("style", "tiny-sd", rank=8, targets="all", seed=31, folder=folder)
    data = path.read_bytes()
    return folder, data, hashlib.sha256(data).hexdigest()


def _civitai_version(web: Web, version: int, sha256: str) -> bytes:
    return json.dumps({"id": version, "modelId": 11, "baseModel": "SD 1.5", "air": f"urn:air:sd1:lora:civitai:11@"
                       f"{version}", "files": [
                           {"name": "style.pt", "type": "Model", "metadata": {"format": "PickleTensor"},
                            "downloadUrl": web.url("/api/download/pickle"), "hashes": {}},
                           {"name": "style.safetensors", "type": "Model", "primary": True,
                            "metadata": {"format": "SafeTensor"}, "hashes": {"SHA256": sha256.upper()},
                            "downloadUrl": web.url(f"/api/download/models/{version}")}]}).encode()


@pytest.fixture(scope="module")
def web(files):
    _, data, sha256 = files
    server = Web({})
    server.routes.update({
        "/loras/style.safetensors": body(data),
        "/loras/pickle.safetensors": body(b"\x80\x04\x95" + b"\x00" * 64),
        "/api/v1/model-versions/22": body(_civitai_version(server, 22, sha256)),
        "/api/v1/model-versions/23": body(_civitai_version(server, 23, "0" * 64)),  # a hash that does not match
        "/api/download/models/22": lambda h: send(h, 302, headers={"Location": "/storage/style.safetensors"}),
        "/api/download/models/23": body(data),
        "/storage/style.safetensors": body(data),
    })
    yield server
    server.close()


def _client(folder, download_dir, **engine):
    app = create_app(ServerConfig(engines=[EngineConfig(model="tiny-sd", adapters=folder, download_dir=download_dir,
                                                        **engine)]))
    client = TestClient(app, raise_server_exceptions=False)
    client.__enter__()
    wait_ready(client, 120)
    return client


def _cache_misses(client) -> float:
    return sum(float(line.split()[-1]) for line in client.get("/metrics").text.splitlines()
               if line.startswith("loraswap_adapter_cache_misses_total"))


def _image(client, **extra) -> bytes:
    """The answer's pixels: the file's record names the adapter as the request did."""
    response = client.post("/v1/images/generations", json={**PROMPT, **extra})
    assert response.status_code == 200, response.text
    return pixels_of(base64.b64decode(response.json()["data"][0]["b64_json"])).tobytes()


@pytest.fixture(scope="module")
def served(files, web, tmp_path_factory):
    folder, _, _ = files
    downloads = tmp_path_factory.mktemp("downloads")
    client = _client(folder, downloads, url_allow=[f"127.0.0.1:{web.port}"], civitai_api=web.url("/api"))
    yield client, downloads
    client.__exit__(None, None, None)


def test_a_url_in_loras_gives_the_folder_files_image_and_is_fetched_once(served, web):
    client, _ = served
    signed = web.url("/loras/style.safetensors?X-Signature=SECRET")
    local = _image(client, model="style:0.8")
    assert _image(client, loras=[{"path": signed, "scale": 0.8}]) == local
    assert _image(client, image_loras=[{"path": signed, "scale": 0.8}]) == local, "Together's name for the list"
    misses = _cache_misses(client)
    hf = client.post("/", json={"inputs": "a lighthouse", "parameters": {
        "width": 64, "height": 64, "seed": 7, "num_inference_steps": 2, "loras": [{"path": signed, "scale": 0.8}]}})
    assert hf.status_code == 200
    assert _cache_misses(client) == misses, "read once: using a download leaves its file as the cache knows it"
    assert web.paths().count("/loras/style.safetensors?X-Signature=SECRET") == 1, "one download"
    rows = {row["id"]: row for row in client.get("/adapters").json()["adapters"]}
    url_rows = [row for row in rows.values() if row["source"] == "url"]
    assert len(url_rows) == 1 and url_rows[0]["id"].startswith("url:") and "SECRET" not in json.dumps(rows)
    assert rows["style"]["source"] == "folder"


def test_a_civitai_air_is_resolved_downloaded_and_checked(served, web):
    client, _ = served
    local = _image(client, model="style")
    assert _image(client, loras=[{"path": "urn:air:sd1:lora:civitai:11@22"}]) == local
    assert "/api/download/pickle" not in web.paths(), "the SafeTensor file, never the pickle"
    rows = {row["id"]: row for row in client.get("/adapters").json()["adapters"]}
    assert rows["civitai:11@22"]["source"] == "civitai"
    refused = client.post("/v1/images/generations", json={**PROMPT, "loras": [{"path": "civitai:11@23"}]})
    assert refused.status_code == 400
    assert "does not match the SHA256 Civitai lists" in refused.json()["error"]["message"]
    assert "civitai:11@23" not in {row["id"] for row in client.get("/adapters").json()["adapters"]}


def test_downloads_survive_a_restart_and_delete_removes_them(served, files, web):
    client, downloads = served
    signed = web.url("/loras/style.safetensors?X-Signature=SECRET")
    _image(client, loras=[{"path": signed}])
    url_id = next(row["id"] for row in client.get("/adapters").json()["adapters"] if row["source"] == "url")
    fetched = len(web.log)
    restarted = _client(files[0], downloads, url_allow=[f"127.0.0.1:{web.port}"])
    try:
        assert url_id in {row["id"] for row in restarted.get("/adapters").json()["adapters"]}
        assert _image(restarted, model=url_id) == _image(restarted, model="style"), "served by its id from disk"
        assert len(web.log) == fetched, "nothing fetched again"
        assert restarted.delete(f"/adapters/{url_id}").status_code == 200
        assert url_id not in {row["id"] for row in restarted.get("/adapters").json()["adapters"]}
    finally:
        restarted.__exit__(None, None, None)


@pytest.mark.parametrize("path,status,phrase", [
    ("/loras/pickle.safetensors", 400, "not a safetensors file"),
    ("/loras/missing.safetensors", 404, "adapter 'url:"),
])
def test_bad_files_upstream_are_refused_and_the_server_keeps_serving(served, web, path, status, phrase):
    client, _ = served
    response = client.post("/v1/images/generations", json={**PROMPT, "loras": [{"path": web.url(path)}]})
    assert response.status_code == status and phrase in response.json()["error"]["message"], response.text
    assert _image(client, model="style")


def test_each_source_is_refused_until_its_flag_names_it(files, web, tmp_path):
    client = _client(files[0], tmp_path / "downloads")
    before = len(web.log)
    try:
        for path, flag in ((web.url("/loras/style.safetensors"), "--url-allow"), ("civitai:11@22", "--civitai")):
            response = client.post("/v1/images/generations", json={**PROMPT, "loras": [{"path": path}]})
            assert response.status_code == 403 and flag in response.json()["error"]["message"], response.text
        anywhere = _client(files[0], tmp_path / "other", url_allow=["*"])
        try:  # `*` is any public host: never loopback
            response = anywhere.post("/v1/images/generations", json={**PROMPT, "loras": [
                {"path": web.url("/loras/style.safetensors").replace("http://", "https://")}]})
            assert response.status_code == 403, response.text
        finally:
            anywhere.__exit__(None, None, None)
        assert len(web.log) == before, "nothing was fetched from a host not allowed"
    finally:
        client.__exit__(None, None, None)


def test_an_object_in_a_bucket_gives_the_folder_files_image(files, tmp_path, monkeypatch):
    import boto3
    from moto.server import ThreadedMotoServer
    from support.servers import free_port

    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                        "AWS_CONFIG_FILE": str(tmp_path / "none"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    port = free_port()
    store = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    store.start()
    endpoint = f"http://127.0.0.1:{port}"
    bucket = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    bucket.create_bucket(Bucket="team-loras")
    bucket.put_object(Bucket="team-loras", Key="sd/style.safetensors", Body=files[1])
    client = _client(files[0], tmp_path / "downloads", s3_endpoint_url=endpoint)
    try:
        assert _image(client, loras=[{"path": "s3://team-loras/sd/style.safetensors", "scale": 0.6}]) == \
            _image(client, model="style:0.6")
        rows = {row["id"]: row for row in client.get("/adapters").json()["adapters"]}
        assert rows["s3:team-loras/sd/style.safetensors"]["source"] == "s3"
        missing = client.post("/v1/images/generations", json={**PROMPT, "loras": [{"path": "s3://team-loras/no"}]})
        assert missing.status_code == 404, missing.text
    finally:
        client.__exit__(None, None, None)
        store.stop()
