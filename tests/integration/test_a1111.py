"""A1111's API and `<lora:NAME:WEIGHT>` prompts, driven by the real clients (`webuiapi`,
`openai`, `huggingface_hub`) against the demo model served on loopback: a tagged prompt makes,
through every API, bitwise the image the `lora` header makes with the prompt without the tag."""

import base64
import io
import json

import httpx
import numpy as np
import openai
import pytest
import torch
import webuiapi
from fastapi.testclient import TestClient
from PIL import Image
from PIL.PngImagePlugin import PngInfo
from support.fakes import fake_app, serve_on_loopback
from support.servers import wait_ready

from loraswap.adapters.files.formats import open_checked
from loraswap.adapters.reference import as_refs
from loraswap.engine.config.engine import EngineConfig
from loraswap.models.families import demo
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig

KEY = "a1111-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
SAMPLING = {"seed": 3, "steps": 6, "cfg_scale": 3.0, "width": 32, "height": 32}  # as A1111 names them
HF_SAMPLING = {"seed": 3, "num_inference_steps": 6, "guidance_scale": 3.0, "width": 32, "height": 32}


@pytest.fixture(scope="module")
def url():
    """The demo model and its adapters, behind an API key, on loopback (its adapters listed)."""
    config = ServerConfig(engines=[EngineConfig(model="demo", adapters=demo.ADAPTERS, compile=False, warmup=False)],
                          api_keys=[KEY], list_adapters_as_models=True)
    with serve_on_loopback(create_app(config)) as url:
        with httpx.Client(base_url=url, timeout=30) as client:
            wait_ready(client)
        yield url


@pytest.fixture(scope="module")
def a1111(url) -> webuiapi.WebUIApi:
    host, port = url.removeprefix("http://").split(":")
    api = webuiapi.WebUIApi(host=host, port=int(port))
    api.session.headers.update(AUTH)  # the API key, as any A1111 client sends a header
    return api


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


def decoded(data: bytes) -> np.ndarray:
    return pixels(Image.open(io.BytesIO(data)))


def hf(url: str, body: dict, lora: str | None = None) -> np.ndarray:
    """The image of a Hugging Face request (`POST /`), with the adapter in the `lora` header."""
    headers = {**AUTH, "accept": "image/png", **({"lora": lora} if lora else {})}
    answer = httpx.post(url, json=body, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    return decoded(answer.content)


def test_a_tagged_prompt_makes_the_header_s_image_through_every_api(url, a1111, monkeypatch):
    import huggingface_hub.constants
    from huggingface_hub import InferenceClient

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the suite is offline; this is loopback
    reference = hf(url, {"inputs": "a red circle", "parameters": HF_SAMPLING}, lora="outline")
    assert not np.array_equal(reference, hf(url, {"inputs": "a red circle", "parameters": HF_SAMPLING})), \
        "the adapter changes the image"
    prompt = "<lora:outline:1> a red circle"
    through_hf = InferenceClient(model=url, api_key=KEY).text_to_image(prompt, **HF_SAMPLING)
    assert np.array_equal(pixels(through_hf), reference)
    through_openai = openai.OpenAI(base_url=url + "/v1", api_key=KEY).images.generate(
        prompt=prompt, model="demo", size="32x32", extra_body={k: v for k, v in HF_SAMPLING.items() if k not in (
            "width", "height")})
    assert np.array_equal(decoded(base64.b64decode(through_openai.data[0].b64_json)), reference)
    through_a1111 = a1111.txt2img(prompt=prompt, **SAMPLING)
    assert np.array_equal(pixels(through_a1111.image), reference)
    info = through_a1111.info  # what ran, as A1111 tells it
    assert (info["all_seeds"], info["steps"], info["cfg_scale"], info["width"], info["height"]) == ([3], 6, 3.0, 32, 32)
    assert (info["sampler_name"], info["sd_model_name"], info["prompt"]) == ("Euler", "demo", prompt)
    assert info["infotexts"][0].startswith("a red circle <lora:outline:1>\nSteps: 6, Sampler: Euler, CFG scale: 3.0, "
                                           "Seed: 3, Size: 32x32, Model: demo, Lora hashes: \"outline: ")
    assert through_a1111.parameters["prompt"] == prompt and through_a1111.parameters["sampler_name"] == "Euler a"


def test_img2img_with_a_mask_is_the_hf_image_to_image_with_the_header(url, a1111):
    picture = Image.fromarray(hf(url, {"inputs": "a blue square", "parameters": HF_SAMPLING}))
    mask = Image.new("L", (32, 32), 0)
    mask.paste(255, (16, 0, 32, 32))  # white: repainted
    b64 = {name: base64.b64encode(_png(image)).decode() for name, image in (("image", picture), ("mask", mask))}
    made = {}
    for with_mask in (False, True):
        reference = hf(url, {"inputs": b64["image"], "parameters": {
            "prompt": "a red circle", "strength": 0.6, **HF_SAMPLING, **({"mask": b64["mask"]} if with_mask else {})}},
            lora="striped:0.8")
        ours = a1111.img2img(images=[picture], mask_image=mask if with_mask else None,
                             prompt="a red circle <lora:striped:0.8>", denoising_strength=0.6, **SAMPLING)
        assert np.array_equal(pixels(ours.image), reference), f"with_mask={with_mask}"
        assert ours.info["denoising_strength"] == 0.6 and ours.parameters["init_images"] is None
        made[with_mask] = reference
    assert not np.array_equal(made[False], made[True]), "the mask is applied"


def _png(image: Image.Image, info: PngInfo | None = None) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG", pnginfo=info)
    return buffer.getvalue()


def test_loras_and_models_are_listed_as_a1111_lists_them_and_their_names_work_in_tags(url, a1111):
    loras = a1111.get_loras()
    assert [row["name"] for row in loras] == sorted(demo.DEMO_ADAPTERS)
    for row in loras:
        assert set(row) == {"name", "alias", "path", "metadata"}
        assert row["path"] == f"{row['name']}.safetensors" and isinstance(row["metadata"], dict)
        assert row["alias"] == row["metadata"].get("ss_output_name", row["name"])
    assert a1111.util_get_model_names() == ["demo"]
    chosen = a1111.txt2img(prompt=f"<lora:{loras[-1]['name']}:0.5> a red circle",
                           override_settings={"sd_model_checkpoint": "demo"}, **SAMPLING)
    assert np.array_equal(pixels(chosen.image), hf(url, {"inputs": "a red circle", "parameters": HF_SAMPLING},
                                                   lora=f"{loras[-1]['name']}:0.5"))


def test_a_drawn_seed_is_told_and_makes_the_image_again(a1111):
    batch = a1111.txt2img(prompt="a green triangle", seed=-1, batch_size=2, steps=4, width=32, height=32)
    seeds = batch.info["all_seeds"]
    assert len(batch.images) == 2 and len(seeds) == 2 and batch.info["seed"] == seeds[0]
    again = a1111.txt2img(prompt="a green triangle", seed=seeds[1], steps=4, width=32, height=32)
    assert np.array_equal(pixels(again.image), pixels(batch.images[1]))


@pytest.mark.parametrize("asked,status,words", [
    ({"prompt": "<lora:nowhere:1> a fox"}, 404, "'nowhere'"),
    ({"prompt": "<hypernet:agm:1> a fox"}, 400, "<hypernet:agm:1>"),
    ({"prompt": "a fox", "restore_faces": True}, 400, "restore_faces true"),
    ({"prompt": "a fox", "enable_hr": True}, 400, "enable_hr true"),
    ({"prompt": "a fox", "sampler_name": "DPM++ 2M Karras"}, 400, "sampler_name 'DPM++ 2M Karras'"),
    ({"prompt": "a fox", "scheduler": "Karras"}, 400, "scheduler 'Karras'"),
    ({"prompt": "a fox", "override_settings": {"sd_model_checkpoint": "v1-5-pruned.safetensors [6ce0161689]"}}, 400,
     "is not a model this server hosts (demo)"),
    ({"prompt": "a fox", "override_settings": {"CLIP_stop_at_last_layers": 2}}, 400,
     "override_settings.CLIP_stop_at_last_layers 2"),
])
def test_what_the_server_cannot_do_is_refused_naming_it_and_it_keeps_serving(a1111, asked, status, words):
    with pytest.raises(RuntimeError) as refused:
        a1111.txt2img(**{**SAMPLING, **asked})
    code, text = refused.value.args
    assert code == status and words in json.loads(text)["error"], text
    assert a1111.txt2img(prompt="a fox", **SAMPLING).image.size == (32, 32)


def test_the_a1111_routes_take_the_api_key(url):
    host, port = url.removeprefix("http://").split(":")
    keyless = webuiapi.WebUIApi(host=host, port=int(port))
    with pytest.raises(RuntimeError) as refused:
        keyless.txt2img(prompt="a fox", **SAMPLING)
    assert refused.value.args[0] == 401
    for path in ("/sdapi/v1/loras", "/sdapi/v1/sd-models"):
        assert httpx.get(url + path).status_code == 401


@pytest.fixture
def fake():
    """The A1111 routes over a FakeBackend that records what the engine gets."""
    app, backend = fake_app(max_images=4)
    with TestClient(app) as client:
        yield client, backend


def test_a1111_fields_map_to_the_engine_request(fake):
    client, backend = fake
    answer = client.post("/sdapi/v1/txt2img", json={
        "prompt": "a fox <lora:a:0.5>", "negative_prompt": "blur", "steps": 7, "cfg_scale": 2.5, "width": 48,
        "height": 16, "seed": 11, "batch_size": 2, "n_iter": 2, "send_images": False, "sampler_name": "Euler a",
        "scheduler": "Automatic", "enable_hr": False, "hr_scale": 4, "denoising_strength": 0.1, "styles": []})
    assert answer.status_code == 200, answer.text
    assert answer.json()["images"] == [], "send_images false"
    made = [request for request, _ in backend.generated]
    assert [r.seed for r in made] == [11, 12, 13, 14], "batch_size x n_iter images, seed + i"
    assert {(r.prompt, r.negative_prompt, r.steps, r.guidance, r.width, r.height, r.strength, tuple(r.loras))
            for r in made} == {("a fox ", "blur", 7, 2.5, 48, 16, None, tuple(as_refs([("a", 0.5)])))}
    assert json.loads(answer.json()["info"])["all_seeds"] == [11, 12, 13, 14]


@pytest.mark.parametrize("body,words", [
    ({"batch_size": 3, "n_iter": 2}, "n must be between 1 and 4"),
    ({"restore_face": True}, '"restore_face" is not an A1111 field'),
    ({"styles": ["cinematic"]}, 'styles ["cinematic"] asks for what this server does not do'),
    ({"alwayson_scripts": {"ControlNet": {"args": [{}]}}}, "alwayson_scripts"),
    ({"override_settings": {"sd_model_checkpoint": "other"}}, "'other' is not a model this server hosts (fake)"),
    ({"seed": 1.5}, "seed"),
])
def test_txt2img_refusals_name_the_field(fake, body, words):
    client, backend = fake
    answer = client.post("/sdapi/v1/txt2img", json={"prompt": "a fox", **body})
    assert answer.status_code == 400 and words in answer.json()["error"], answer.text
    assert backend.generated == []


def test_img2img_takes_one_image_and_reads_its_mask_as_a1111_does(fake):
    """A1111's `create_binary_mask`: an RGBA mask whose alpha is not all opaque repaints where it
    is opaque (cut at 128), whatever its colours and however far into the file its pixels
    start; any other mask, a fully opaque RGBA one too, where it is white."""
    client, backend = fake
    image = base64.b64encode(_png(Image.new("RGB", (16, 16), (0, 0, 255)))).decode()
    answer = client.post("/sdapi/v1/img2img", json={"prompt": "a fox", "init_images": [image, image]})
    assert answer.status_code == 400 and "init_images holds 2 images" in answer.json()["error"]
    assert backend.generated == []
    alpha = Image.new("L", (16, 16), 0)
    alpha.paste(200, (8, 0, 16, 16))  # opaque enough: repainted
    alpha.paste(100, (0, 0, 4, 16))  # under 128: kept, as transparent
    transparent = Image.new("RGBA", (16, 16), (255, 255, 255, 0))  # white throughout: only its alpha counts
    transparent.putalpha(alpha)
    chunks = PngInfo()
    chunks.add_text("comment", "x" * 60_000)  # its pixels start past the first 48 KiB
    opaque = Image.new("RGBA", (16, 16), (0, 0, 0, 255))
    opaque.paste((255, 255, 255, 255), (8, 0, 16, 16))
    grey = Image.new("L", (16, 16), 0)
    grey.paste(255, (8, 0, 16, 16))
    right_half = np.zeros((16, 16), np.uint8)
    right_half[:, 8:] = 255
    for mask, info in ((transparent, chunks), (opaque, None), (grey, None)):
        answer = client.post("/sdapi/v1/img2img", json={
            "prompt": "a fox", "init_images": ["data:image/png;base64," + image], "denoising_strength": 0.4,
            "mask": base64.b64encode(_png(mask, info)).decode(), "mask_blur": 4, "inpainting_fill": 1,
            "resize_mode": 0, "image_cfg_scale": 1.5})
        assert answer.status_code == 200, answer.text
        request, _ = backend.generated[-1]
        assert request.strength == 0.4 and request.image.size == (16, 16)
        assert np.array_equal(np.asarray(request.mask), right_half), mask.mode


def test_the_model_and_its_sampler_are_checked_before_the_image_is_decoded(fake):
    client, backend = fake
    undecodable = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(64)).decode()
    for asked, words in (({"sampler_name": "DPM++ 2M"}, "sampler_name 'DPM++ 2M': this server samples with each "
                                                        "model's own sampler (Euler)"),
                         ({"override_settings": {"sd_model_checkpoint": "other"}},
                          "'other' is not a model this server hosts (fake)")):
        answer = client.post("/sdapi/v1/img2img", json={"prompt": "a fox", "init_images": [undecodable], **asked})
        assert answer.status_code == 400 and words in answer.json()["error"], answer.text
    answer = client.post("/sdapi/v1/img2img", json={"prompt": "a fox", "init_images": [undecodable]})
    assert answer.status_code == 400 and "the image has a corrupt header" in answer.json()["error"], answer.text
    assert backend.generated == []


def test_the_sampler_is_checked_against_the_model_the_request_goes_to(fake):
    client, backend = fake
    samplers = {"fake": "EulerDiscreteScheduler", "dpm": "DPMSolverMultistepScheduler"}
    backend.ready_info = lambda: {"model": "fake", "models": list(samplers), "compiled": False, "capabilities": {
        model: {"output": "image", "sampler": sampler} for model, sampler in samplers.items()}}
    backend.is_model = lambda name: name in samplers

    def txt2img(prompt="a fox", **asked):
        return client.post("/sdapi/v1/txt2img", json={"prompt": prompt, "sampler_name": "DPM++ 2M", **asked})

    assert txt2img(override_settings={"sd_model_checkpoint": "dpm"}).status_code == 200
    assert backend.generated[-1][1] == "dpm", "the checkpoint named is the model used"
    refused = txt2img()  # no model named, no adapter: the default model, whose sampler is Euler
    assert refused.status_code == 400 and "own sampler (Euler)" in refused.json()["error"], refused.text
    assert txt2img(prompt="<lora:a:1> a fox").status_code == 200, "an adapter's base model may be either"
    backend.ready_info = lambda: None  # the models loading: no sampler known, the model's own is not refused
    assert txt2img(sampler_name="Euler").status_code == 200


@pytest.mark.parametrize("carried", [True, False])
def test_an_a1111_image_carries_its_record_unless_the_server_is_told_not_to(carried):
    app, backend = fake_app(image_metadata=carried)
    with TestClient(app) as client:
        answer = client.post("/sdapi/v1/txt2img", json={"prompt": "a fox <lora:a:0.5>", "seed": 5, "steps": 3})
    assert answer.status_code == 200, answer.text
    png = Image.open(io.BytesIO(base64.b64decode(answer.json()["images"][0])))
    infotext = json.loads(answer.json()["info"])["infotexts"][0]
    if carried:
        assert png.text["parameters"] == infotext and json.loads(png.text["loraswap"])["seed"] == 5
        assert infotext.startswith("a fox  <lora:a:0.5>\nSteps: 3, Sampler: Euler, ") and "Seed: 5," in infotext
    else:
        assert "parameters" not in png.text and "loraswap" not in png.text
        assert infotext.startswith("a fox  <lora:a:0.5>\nSteps: 3"), "the answer's info tells it all the same"


TENSORS = {"lora_unet_x.lora_down.weight": torch.zeros(2, 4), "lora_unet_x.lora_up.weight": torch.zeros(4, 2)}
DEEP = '{"a":' * 600 + "1" + "}" * 600  # JSON nested past any request body's bound


def test_the_lora_listing_reads_each_file_once_per_version_and_shows_no_server_path(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from loraswap.server.a1111 import loras as a1111_loras

    folder = tmp_path / "adapters"
    (folder / "styles").mkdir(parents=True)
    tags = {"anime": {"1girl": 3}}
    save_file(TENSORS, folder / "styles" / "anime.safetensors", metadata={
        "ss_output_name": "Anime v2", "ss_tag_frequency": json.dumps(tags), "note": "{not json", "deep": DEEP})
    save_file(TENSORS, folder / "plain.safetensors")
    (folder / "broken.safetensors").write_bytes(b"not a safetensors file")
    reads = []
    monkeypatch.setattr(a1111_loras, "open_checked", lambda *args: reads.append(args[1]) or open_checked(*args))
    listing = a1111_loras.LoraListing(ServerConfig(engines=[EngineConfig(model="tiny-sd", adapters=folder)],
                                                   list_adapters_as_models=True))
    assert listing.rows() == [
        {"name": "plain", "alias": "plain", "path": "plain.safetensors", "metadata": {}},
        {"name": "styles/anime", "alias": "Anime v2", "path": "styles/anime.safetensors",
         "metadata": {"ss_output_name": "Anime v2", "ss_tag_frequency": tags, "note": "{not json", "deep": DEEP}}]
    assert sorted(reads) == ["broken", "plain", "styles/anime"]  # the broken file is left out
    listing.rows()
    assert sorted(reads) == ["broken", "broken", "plain", "styles/anime"], "an unchanged file's metadata is kept"
    save_file(TENSORS, folder / "plain.safetensors", metadata={"ss_output_name": "Plain"})
    assert listing.rows()[0]["alias"] == "Plain" and reads.count("plain") == 2, "a changed file is read again"


def test_the_lora_route_lists_only_with_the_flag_and_a_deeply_nested_file_breaks_nothing(tmp_path):
    """The adapters' metadata may name the paths a trainer used: listed only as --list-adapters-as-models
    lists adapters; a file whose metadata nests 600 deep is listed (that value as its text)."""
    from safetensors.torch import save_file

    save_file(TENSORS, tmp_path / "deep.safetensors", metadata={"ss_dataset_dirs": DEEP, "ss_output_name": "Deep"})
    listed = {}
    for flag in (False, True):
        app, backend = fake_app(engines=[EngineConfig(model="tiny-sd", adapters=tmp_path)],
                                list_adapters_as_models=flag)
        with TestClient(app) as client:
            answer = client.get("/sdapi/v1/loras")
            assert answer.status_code == 200, answer.text
            listed[flag] = answer.json()
    assert listed[False] == [] and [row["name"] for row in listed[True]] == ["deep"]
    assert listed[True][0]["metadata"] == {"ss_dataset_dirs": DEEP, "ss_output_name": "Deep"}
