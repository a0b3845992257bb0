"""Valid safetensors files whose JSON header is tens of MiB of empty tensor entries, named by URL
(a real HTTP server on 127.0.0.1, allowed with --url-allow) and from the adapter folder, on a
server with the default --max-adapter-mb: each refused with a 400 naming the header's bound, in
milliseconds and without the memory a parse would take, every time it is named; nothing of it
is kept, and the server keeps serving. Run with -s for the figures."""

import pytest
from fastapi.testclient import TestClient
from support.headers import Cost, crowded_safetensors
from support.servers import wait_ready
from support.web import Web, body

from loraswap.engine.config.engine import EngineConfig
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig

MIB = 2**20
PARAMETERS = {"width": 32, "height": 32, "seed": 7, "num_inference_steps": 2}
HEADER_MIB = {"huge-95": 95, "huge-20": 20, "crowded-8": 8}  # 8 MiB: inside the byte bound, ~136,000 entries
REFUSALS = {"huge-95": "its safetensors header is 95.0 MiB, over the 16 MiB read for files of up to 2048 MiB",
            "huge-20": "its safetensors header is 20.0 MiB, over the 16 MiB read for files of up to 2048 MiB",
            "crowded-8": "its safetensors header holds more JSON than 32,768 tensor entries would"}


@pytest.fixture(scope="module")
def served(adapter_factory, tmp_path_factory):
    folder = tmp_path_factory.mktemp("folder")
    adapter_factory("style", "tiny-sd", rank=4, seed=5, folder=folder)
    files = {name: crowded_safetensors(mib * MIB) for name, mib in HEADER_MIB.items()}  # served from memory
    for name, data in files.items():
        (folder / f"{name}.safetensors").write_bytes(data)
    web = Web({f"/{name}.safetensors": body(data) for name, data in files.items()})
    downloads = tmp_path_factory.mktemp("downloads")
    app = create_app(ServerConfig(engines=[EngineConfig(model="tiny-sd", adapters=folder, download_dir=downloads,
                                                        url_allow=[f"127.0.0.1:{web.port}"])]))
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_ready(client, 120)
        yield client, web, downloads
    web.close()


def _post(client, lora: str | None):
    loras = [{"path": lora}] if lora else []
    return client.post("/", json={"inputs": "a fox", "parameters": {**PARAMETERS, "loras": loras}})


@pytest.mark.parametrize("name", list(HEADER_MIB))
@pytest.mark.parametrize("where", ["url", "folder"])
def test_a_header_of_tens_of_mib_is_refused_in_milliseconds(served, where, name):
    client, web, downloads = served
    reference = web.url(f"/{name}.safetensors") if where == "url" else name
    assert _post(client, None).status_code == 200  # warm: the figures below are the refusal's alone
    for attempt in (1, 2):  # named again: refused again, as cheaply (nothing of it was kept)
        with Cost() as cost:
            response = _post(client, reference)
        print(f"\n{name} by {where}, request {attempt}: {response.status_code} in {cost}")
        assert response.status_code == 400 and REFUSALS[name] in response.json()["error"], response.text
        assert cost.seconds < 1 and cost.peak_growth < 50 * MIB, str(cost)
    if where == "url":
        assert web.paths().count(f"/{name}.safetensors") >= 2, "fetched each time: a refused file is not kept"
        assert not [p for p in downloads.rglob("*") if p.is_file() and p.stat().st_size > MIB], "nothing kept"
    listed = {row["id"] for row in client.get("/adapters").json()["adapters"]}
    assert not [i for i in listed if i.startswith("url:")], "a refused download is never listed"
    assert _post(client, "style").status_code == 200, "the server keeps serving"
