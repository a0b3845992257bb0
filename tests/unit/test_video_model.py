"""Which hosted model a video request goes to: none named, the hosted video model (on a
server hosting an image model first); none hosted, or an image model named, a 422 at once
with nothing queued. In-process over a fake backend hosting tiny-sd then tiny-wan."""

import time

import pytest
from fastapi.testclient import TestClient
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file
from support.fakes import FakeBackend
from support.servers import form, wait_ready

from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import GenerateResult
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig

IMAGE = {"image_input": "variants", "masks": True, "output": "image", "defaults": {}, "size_multiple": 8}
VIDEO = {"image_input": None, "masks": False, "output": "video", "defaults": {}, "size_multiple": 16}


class Hosting(FakeBackend):
    """These models, the first the default; an image model asked for frames gives an image, as
    tiny-sd does."""

    def __init__(self, models: dict[str, dict]):
        super().__init__()
        self.models = models

    def ready_info(self) -> dict:
        return {"model": next(iter(self.models)), "models": list(self.models), "compiled": False,
                "capabilities": self.models}

    def is_model(self, name: str) -> bool:
        return name in self.models

    async def generate(self, request, model, is_disconnected, on_step=None) -> GenerateResult:
        if self.models[model or next(iter(self.models))]["output"] == "image":
            self.generated.append((request, model))
            return GenerateResult(Image.new("RGB", (8, 8)), 0, 0.0, 0.01)
        return await super().generate(request, model, is_disconnected, on_step)


def app_hosting(*models: str, **config):
    backend = Hosting({name: IMAGE if name == "tiny-sd" else VIDEO for name in models})
    return create_app(ServerConfig(**config), backend=backend), backend


def _finished(client, video_id: str) -> dict:
    deadline = time.monotonic() + 10
    while (view := client.get(f"/v1/videos/{video_id}").json())["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, view
        time.sleep(0.01)
    return view


def test_a_video_with_no_model_goes_to_the_hosted_video_model(tmp_path):
    app, backend = app_hosting("tiny-sd", "tiny-wan", state_dir=tmp_path)
    with TestClient(app) as client:
        created = client.post("/v1/videos", files=form(prompt="a fox running", frames=5, size="64x48"))
        done = _finished(client, created.json()["id"])
        image = client.post("/", json={"inputs": "a fox"})
    assert created.status_code == 200 and created.json()["model"] == "tiny-wan"
    assert (done["status"], done["error"], done["size"]) == ("completed", None, "64x48")
    assert [model for _, model in backend.generated] == ["tiny-wan", None], "then an image on the default model"
    assert image.status_code == 200


@pytest.mark.parametrize(("models", "fields", "message"), [
    (("tiny-sd",), {}, "this server hosts no video model (hosted: tiny-sd); a video needs a video model (a Wan "
                       "model)"),
    (("tiny-sd",), {"model": "some/adapter"}, "this server hosts no video model (hosted: tiny-sd); a video needs "
                                               "a video model (a Wan model)"),
    (("tiny-sd", "tiny-wan"), {"model": "tiny-sd"}, "model 'tiny-sd' makes images, not videos: name a video model "
                                                    "(tiny-wan) or an adapter of one"),
])
def test_a_video_no_hosted_model_can_make_is_a_422_at_once(tmp_path, models, fields, message):
    app, backend = app_hosting(*models, state_dir=tmp_path)
    with TestClient(app) as client:
        refused = client.post("/v1/videos", files=form(prompt="a fox", frames=5, **fields))
        image = client.post("/", json={"inputs": "a fox"})
    assert refused.status_code == 422 and refused.json()["error"]["message"] == message
    assert [model for _, model in backend.generated] == [None], "no job queued; the server still serves"
    assert image.status_code == 200 and list((tmp_path / "videos").iterdir()) == []


@pytest.fixture(scope="module")
def sd_and_wan(adapter_factory, tmp_path_factory):
    """The real engines of tiny-sd (the default) and tiny-wan, with adapters of both."""
    root = tmp_path_factory.mktemp("video-adapters")
    adapter_factory("sd/declared", "tiny-sd", rank=4, base_model="tiny-sd", seed=71, folder=root)
    adapter_factory("sd/plain", "tiny-sd", rank=4, seed=72, folder=root)  # says nothing: its layers tell
    kohya = adapter_factory("sd/kohya", "tiny-sd", rank=4, fmt="kohya", seed=73, folder=root)
    with safe_open(str(kohya), "pt") as f:  # its family in kohya's words, as sd-scripts writes it
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    save_file(tensors, str(kohya), metadata={**metadata, "ss_base_model_version": "sd_v1"})
    adapter_factory("wan/motion", "tiny-wan", rank=4, seed=74, folder=root)
    state = tmp_path_factory.mktemp("video-state")
    engines = [EngineConfig(model=model, adapters=root, download_dir=state / "downloads", compile=False, warmup=False)
               for model in ("tiny-sd", "tiny-wan")]
    with TestClient(create_app(ServerConfig(engines=engines, state_dir=state))) as client:
        wait_ready(client, 120)
        yield client, state


@pytest.mark.parametrize("adapter", ["sd/declared", "sd/plain", "sd/kohya"],
                         ids=["declared-base", "its-layers", "family-hint"])
def test_a_video_naming_an_image_models_adapter_is_a_422_at_once(sd_and_wan, adapter):
    """tiny-wan hosted beside tiny-sd, `model` an SD adapter: refused now, nothing queued; an
    adapter of tiny-wan still makes a video, and the image model still serves."""
    client, state = sd_and_wan
    refused = client.post("/v1/videos", files=form(prompt="a fox", model=adapter, frames=5, size="32x32"))
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["message"] == (
        f"adapter '{adapter}': it is an adapter of tiny-sd, which makes images, not videos. Name a video model "
        "(tiny-wan) or an adapter of one")
    assert list((state / "videos").iterdir()) == [], "no job queued"
    wan = client.post("/v1/videos", files=form(prompt="a fox", model="wan/motion", frames=5, size="32x32",
                                                num_inference_steps=1))
    assert wan.status_code == 200, wan.text
    assert _finished(client, wan.json()["id"])["status"] == "completed"
    assert client.delete(f"/v1/videos/{wan.json()['id']}").status_code == 200
    image = client.post("/", json={"inputs": "a fox", "parameters": {"num_inference_steps": 1}},
                        headers={"lora": adapter})
    assert image.status_code == 200, "the adapter is the image model's, which still serves"
