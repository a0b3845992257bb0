"""The generation record an image carries (`media/metadata.py`, `server/images/output.py`):
A1111's infotext and a JSON record in PNG text chunks, EXIF UserComment and ImageDescription
in JPEG and WebP, read back with PIL and with an independent A1111 parser (sd-parsers), and
what they say is what ran: the model's defaults, the seed drawn, each adapter file's SHA-256."""

import hashlib
import io
import json
import re
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from support.fakes import fake_app
from support.file_hashes import hash_file
from support.servers import wait_ready

from loraswap.adapters.files.data import open_in_place
from loraswap.adapters.files.formats import read_safetensors
from loraswap.adapters.files.hashes import ReadDigest
from loraswap.adapters.files.location import AdapterLocation
from loraswap.adapters.naming.prompt_tags import take_adapter_tags
from loraswap.adapters.reference import as_refs
from loraswap.engine.config.engine import EngineConfig
from loraswap.media.images import encode_image
from loraswap.media.metadata import AdapterUse, ImageRecord
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig

RECORD = ImageRecord(
    prompt="a red circle, on white", negative_prompt="blurry: soft", steps=20, guidance=3.0, seed=1234,
    width=64, height=48, model="tiny-sd", sampler="EulerDiscreteScheduler", strength=None,
    adapters=(AdapterUse("outline", 0.8, "a" * 64, "0123456789abcdef" * 4),
              AdapterUse("styles/striped", 1.0, "b" * 64, "fedcba9876543210" * 4)),
    software="loraswap 1.0")

# A1111's parser of its own infotext (`infotext_utils.parse_generation_parameters`): the last
# line holds `Key: value` pairs (a quoted value is JSON text); the lines before it, the prompt
# and, from a line starting `Negative prompt:`, the negative prompt
PARAM = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')


def parse_infotext(text: str) -> dict:
    *lines, last = text.strip().split("\n")
    if len(PARAM.findall(last)) < 3:
        lines, last = [*lines, last], ""
    prompt, negative, in_negative = [], [], False
    for line in lines:
        if line.startswith("Negative prompt:"):
            in_negative, line = True, line[len("Negative prompt:"):].strip()
        (negative if in_negative else prompt).append(line)
    fields = {key: json.loads(value) if value.startswith('"') else value for key, value in PARAM.findall(last)}
    return {"Prompt": "\n".join(prompt), "Negative prompt": "\n".join(negative), **fields}


def test_the_infotext_is_a1111s_layout_field_for_field():
    assert RECORD.infotext() == (
        "a red circle, on white <lora:outline:0.8> <lora:styles/striped:1>\n"
        "Negative prompt: blurry: soft\n"
        'Steps: 20, Sampler: Euler, CFG scale: 3.0, Seed: 1234, Size: 64x48, Model: tiny-sd, '
        'Lora hashes: "outline: 0123456789ab, styles/striped: fedcba987654", Version: loraswap 1.0')
    parsed = parse_infotext(RECORD.infotext())
    assert parsed["Prompt"] == "a red circle, on white <lora:outline:0.8> <lora:styles/striped:1>"
    assert parsed["Negative prompt"] == "blurry: soft"
    assert (parsed["Steps"], parsed["CFG scale"], parsed["Seed"], parsed["Size"]) == ("20", "3.0", "1234", "64x48")
    assert parsed["Lora hashes"] == "outline: 0123456789ab, styles/striped: fedcba987654"


@pytest.mark.parametrize("adapter_id", ["civitai:123@456", "url:" + "0123456789abcdef" * 2,
                                        "s3:bucket/loras/a.safetensors"])
def test_a_remote_ids_tag_and_hash_name_agree_and_its_tag_reads_back_as_it(adapter_id):
    record = ImageRecord("a fox", None, 4, None, 7, 32, 32, "tiny-sd",
                         adapters=(AdapterUse(adapter_id, 0.75, "a" * 64, "0123456789abcdef" * 4),
                                   AdapterUse("outline", 1.0, "b" * 64, "fedcba9876543210" * 4)))
    parsed = parse_infotext(record.infotext())
    prompt, loras = take_adapter_tags(parsed["Prompt"], None)
    assert prompt.strip() == "a fox" and loras == as_refs([(adapter_id, 0.75), ("outline", 1.0)]), \
        "the server's own parser"
    named = [entry.rsplit(": ", 1)[0] for entry in parsed["Lora hashes"].split(", ")]
    assert named == [adapter_id, "outline"], "each hash named as its tag names the adapter"


def test_a_value_with_a_comma_or_colon_is_quoted_and_none_is_left_out():
    record = ImageRecord("x", None, 4, None, 7, 32, 32, "org/model:v1, final", sampler="MyScheduler", strength=0.5)
    text = record.infotext()
    assert "Negative prompt" not in text and "CFG scale" not in text and "Lora hashes" not in text
    assert "Model: org/modelv1 final" in text, "A1111 strips commas and colons from names"
    assert "Sampler: MyScheduler" in text and "Denoising strength: 0.5" in text


def _reopen(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_each_format_carries_the_record_and_the_same_pixels(fmt):
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8))
    plain, carried = _reopen(encode_image(picture, fmt)), _reopen(encode_image(picture, fmt, record=RECORD))
    assert np.array_equal(np.asarray(plain), np.asarray(carried)), "the record changes no pixel"
    if fmt == "PNG":
        infotext, record = carried.text["parameters"], json.loads(carried.text["loraswap"])
        assert not plain.text
    else:
        exif = carried.getexif()
        comment = exif.get_ifd(0x8769)[0x9286]
        assert comment[:8] == b"UNICODE\0"  # as A1111 (piexif) writes it
        infotext, record = comment[8:].decode("utf-16-be"), json.loads(exif[0x010E])
        assert not plain.getexif()
    assert infotext == RECORD.infotext()
    assert record["adapters"] == [{"id": "outline", "weight": 0.8, "sha256": "a" * 64,
                                   "tensors_sha256": "0123456789abcdef" * 4},
                                  {"id": "styles/striped", "weight": 1.0, "sha256": "b" * 64,
                                   "tensors_sha256": "fedcba9876543210" * 4}]
    assert {k: record[k] for k in ("prompt", "negative_prompt", "steps", "guidance", "seed", "width", "height",
                                   "model")} == {"prompt": "a red circle, on white", "negative_prompt": "blurry: soft",
                                                 "steps": 20, "guidance": 3.0, "seed": 1234, "width": 64,
                                                 "height": 48, "model": "tiny-sd"}


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_an_independent_a1111_parser_reads_it(fmt):
    sd_parsers = pytest.importorskip("sd_parsers")
    picture = Image.new("RGB", (64, 48), (200, 30, 30))
    info = sd_parsers.ParserManager().parse(_reopen(encode_image(picture, fmt, record=RECORD)))
    assert info is not None and info.generator == sd_parsers.data.Generators.AUTOMATIC1111
    assert [p.value for p in info.prompts] == ["a red circle, on white <lora:outline:0.8> <lora:styles/striped:1>"]
    assert [p.value for p in info.negative_prompts] == ["blurry: soft"]
    sampler = info.samplers[0]
    assert sampler.name == "Euler" and sampler.model.name == "tiny-sd"
    assert {k: sampler.parameters[k] for k in ("steps", "cfg_scale", "seed")} == {
        "steps": "20", "cfg_scale": "3.0", "seed": "1234"}


def test_a_jpeg_too_small_for_the_json_keeps_the_infotext():
    long = ImageRecord("p" * 20_000, "n" * 9_000, 4, 1.0, 1, 16, 16, "m")
    exif = _reopen(encode_image(Image.new("RGB", (16, 16)), "JPEG", record=long)).getexif()
    assert 0x010E not in exif, "the JSON (40 kB more) would pass JPEG's 64 KiB EXIF segment"
    assert exif.get_ifd(0x8769)[0x9286][8:].decode("utf-16-be") == long.infotext()
    huge = ImageRecord("p" * 40_000, None, 4, 1.0, 1, 16, 16, "m")
    assert not _reopen(encode_image(Image.new("RGB", (16, 16)), "JPEG", record=huge)).getexif(), "no EXIF, no error"


# ---------------------------------------------------------------- the files' hashes
def _safetensors(path, payload: bytes) -> None:
    """A safetensors file of one F16 tensor whose bytes are `payload` (of an even length)."""
    header = json.dumps({"__metadata__": {"a": "b"},
                         "w": {"dtype": "F16", "shape": [len(payload) // 2], "data_offsets": [0, len(payload)]}})
    path.write_bytes(len(header).to_bytes(8, "little") + header.encode() + payload)


def test_a_file_is_hashed_whole_and_after_its_header_as_a1111_does(tmp_path):
    path = tmp_path / "a.safetensors"
    _safetensors(path, b"\x01\x02" * 3_000_000)
    data = path.read_bytes()
    digest = ReadDigest()
    read_safetensors(path, "a", 2**30, digest)
    digest.finish()
    digest = digest.result
    assert digest.sha256 == hashlib.sha256(data).hexdigest()
    header_end = 8 + int.from_bytes(data[:8], "little")
    assert digest.tensors_sha256 == hashlib.sha256(data[header_end:]).hexdigest()  # A1111's addnet_hash_safetensors


@pytest.mark.parametrize("read", [read_safetensors, open_in_place])
def test_a_hostile_header_length_is_refused_before_anything_is_hashed(tmp_path, read):
    from loraswap.errors import AdapterInvalid

    path = tmp_path / "hostile.safetensors"
    path.write_bytes((2**63 - 1).to_bytes(8, "little") + b"{}" * 10)
    digest = ReadDigest()
    with pytest.raises(AdapterInvalid):  # no read of 2**63 bytes asked for: no MemoryError nor OverflowError
        read(path, "hostile", 2**30, digest)
    assert digest.finish() is None and digest.held == 0, "no digest of a file the read refused"


def test_a_digest_is_kept_only_while_the_file_is_the_version_read(tmp_path, monkeypatch):
    """The store keeps the digest of what it read with the cache entry only if the file is
    still the version it stamped before the read; rewritten or removed meanwhile, the record
    says the hashes are not known (and nothing raises)."""
    import torch
    from safetensors.torch import save_file

    from loraswap.adapters import store as store_module
    from loraswap.adapters.bound import ModelLayers
    from loraswap.adapters.cache import CacheConfig
    from loraswap.adapters.random import make_random_adapter
    from loraswap.adapters.reference import AdapterRef
    from loraswap.adapters.sources.choose import AdapterSources
    from loraswap.adapters.sources.folder import FolderSource
    from loraswap.models import lora_components

    cls, components = lora_components("tiny-sd")
    path = tmp_path / "a.safetensors"

    def write(rank: int) -> None:  # each rank another size: another version whatever the clock's grain
        time.sleep(0.01)
        state_dict, metadata = make_random_adapter(components, rank, "attn", seed=rank)
        save_file(state_dict, str(path), metadata=metadata)

    target = store_module.TargetModel("tiny-sd", cls, ModelLayers(components), torch.float32)
    store = store_module.AdapterStore(AdapterSources(FolderSource(tmp_path), None, None), target,
                                      CacheConfig(gpu_bytes=0), torch.device("cpu"))
    read, after_read = store_module.read_adapter, []

    def reading(*args, **kwargs):
        bound = read(*args, **kwargs)
        while after_read:
            after_read.pop()()
        return bound

    monkeypatch.setattr(store_module, "read_adapter", reading)

    def digest_of_a_read():
        lease = store.lease_now([AdapterRef("a")])
        lease.release()
        return lease.held[0][0].digest

    try:
        write(2)
        expected = hash_file(path)
        assert digest_of_a_read() == expected
        write(3)
        after_read.append(lambda: write(4))
        assert digest_of_a_read() is None, "another file by now: not known"
        after_read.append(path.unlink)
        assert digest_of_a_read() is None, "gone: not known, and nothing raised"
    finally:
        store.close()


@pytest.mark.parametrize("in_place", [True, False])
def test_a_read_file_is_hashed_from_the_bytes_the_read_brings_in(adapter_factory, monkeypatch, in_place):
    """One read of the file: the digest is taken of the bytes the store's read brings in (in
    place, or read whole), not of a second read of the file."""
    import os

    import torch

    from loraswap.adapters import store as store_module
    from loraswap.adapters.bound import ModelLayers
    from loraswap.adapters.files.formats import read_safetensors
    from loraswap.models import lora_components

    path = adapter_factory("hashed", "tiny-sd", rank=8, targets="all", seed=61)
    cls, components = lora_components("tiny-sd")
    target = store_module.TargetModel("tiny-sd", cls, ModelLayers(components), torch.float32)
    read_bytes = []
    for name in ("pread", "preadv"):
        real = getattr(os, name)

        def counting(fd, *args, real=real, name=name):
            got = real(fd, *args)
            if os.readlink(f"/proc/self/fd/{fd}") == str(path.resolve()):
                read_bytes.append(len(got) if name == "pread" else got)
            return got

        monkeypatch.setattr(os, name, counting)
    digest = ReadDigest()
    if in_place:  # as the store reads it
        store_module.read_adapter(AdapterLocation("hashed", path, None), target, digest=digest)
    else:  # as when a parse needs a factor's values: read whole
        read_safetensors(path, "hashed", 2**30, digest)
        digest.finish()
    assert digest.result == hash_file(path)
    assert sum(read_bytes) == path.stat().st_size, "each byte of the file read once"


# ---------------------------------------------------------------- through the server
REQUEST = {"inputs": "a red fox", "parameters": {"seed": 11, "width": 64, "height": 64}}


@pytest.fixture(scope="module")
def served(adapter_factory):
    folder = adapter_factory.root / "recorded"
    adapter_factory("style", "tiny-sd", rank=4, seed=31, folder=folder)
    adapter_factory("styles/second", "tiny-sd", rank=4, seed=32, folder=folder)
    app = create_app(ServerConfig(engines=[EngineConfig(model="tiny-sd", adapters=folder)]))
    with TestClient(app) as client:
        wait_ready(client, 120)
        yield client, folder


def test_the_record_says_what_ran_the_models_defaults_and_the_drawn_seed(served):
    client, folder = served
    response = client.post("/", json={"inputs": "a red fox", "parameters": {"negative_prompt": "dull"}},
                           headers={"lora": "style:0.7, styles/second", "accept": "image/png"})
    assert response.status_code == 200, response.text
    image = _reopen(response.content)
    record = json.loads(image.text["loraswap"])
    # tiny-sd's defaults (64x64, 4 steps) and the pipeline's own guidance (StableDiffusionPipeline: 7.5)
    assert (record["steps"], record["guidance"], record["width"], record["height"]) == (4, 7.5, 64, 64)
    assert record["seed"] == int(response.headers["x-seed"]) and record["model"] == "tiny-sd"
    assert record["prompt"] == "a red fox" and record["negative_prompt"] == "dull"
    files = {name: (folder / f"{name}.safetensors").read_bytes() for name in ("style", "styles/second")}
    assert [(a["id"], a["weight"], a["sha256"]) for a in record["adapters"]] == [
        ("style", 0.7, hashlib.sha256(files["style"]).hexdigest()),
        ("styles/second", 1.0, hashlib.sha256(files["styles/second"]).hexdigest())]
    parsed = parse_infotext(image.text["parameters"])
    assert parsed["Prompt"] == "a red fox <lora:style:0.7> <lora:styles/second:1>"
    assert (parsed["Steps"], parsed["CFG scale"], parsed["Seed"], parsed["Size"], parsed["Model"]) == (
        "4", "7.5", response.headers["x-seed"], "64x64", "tiny-sd")
    short = {name: hashlib.sha256(data[8 + int.from_bytes(data[:8], "little"):]).hexdigest()[:12]
             for name, data in files.items()}
    assert parsed["Lora hashes"] == f"style: {short['style']}, styles/second: {short['styles/second']}"


@pytest.mark.parametrize("accept", ["image/png", "image/jpeg", "image/webp"])
def test_metadata_false_leaves_the_record_out_and_the_pixels_alone(served, accept):
    client, _ = served
    with_record = client.post("/", json=REQUEST, headers={"lora": "style", "accept": accept})
    without = client.post("/", json={**REQUEST, "parameters": {**REQUEST["parameters"], "metadata": False}},
                          headers={"lora": "style", "accept": accept})
    assert with_record.status_code == without.status_code == 200
    carried, bare = _reopen(with_record.content), _reopen(without.content)
    assert np.array_equal(np.asarray(carried), np.asarray(bare)), "the same seed's pixels"
    assert not getattr(bare, "text", {}) and not bare.getexif()
    assert (carried.text if accept == "image/png" else carried.getexif())
    assert len(without.content) < len(with_record.content)


def test_the_server_flag_turns_it_off_and_a_request_may_turn_it_on():
    app, _ = fake_app(image_metadata=False)
    with TestClient(app) as client:
        off = client.post("/", json={"inputs": "x"}, headers={"accept": "image/png"})
        on = client.post("/", json={"inputs": "x", "parameters": {"metadata": True}}, headers={"accept": "image/png"})
    assert off.status_code == on.status_code == 200
    assert not _reopen(off.content).text
    assert json.loads(_reopen(on.content).text["loraswap"])["model"] == "fake"


@pytest.mark.parametrize("body,words", [
    ({"metadata": "no"}, "metadata"),
    ({"output_format": "gif"}, "output_format must be 'png', 'jpeg' or 'webp'"),
    ({"output_format": "jpeg", "output_compression": 101}, "output_compression 101 must be between 0 and 100"),
    ({"output_format": "webp", "output_compression": -1}, "output_compression -1 must be between 0 and 100"),
    ({"output_compression": 50}, "output_compression applies to output_format jpeg or webp"),
])
def test_a_bad_format_field_is_a_400_naming_it(body, words):
    app, backend = fake_app()
    with TestClient(app) as client:
        response = client.post("/v1/images/generations", json={"prompt": "x", **body})
        assert response.status_code == 400 and words in response.text, response.text
        assert backend.generated == [], "refused before anything was generated"
        assert client.post("/v1/images/generations", json={"prompt": "x"}).status_code == 200


def test_a_file_is_hashed_as_it_is_read_once_per_version(served, adapter_factory, monkeypatch):
    client, folder = served
    calls, real = [], ReadDigest.finish

    def counted(digest):
        calls.append(digest)
        return real(digest)

    monkeypatch.setattr(ReadDigest, "finish", counted)

    def recorded_sha256(seed: int) -> str:
        body = {**REQUEST, "parameters": {**REQUEST["parameters"], "seed": seed}}
        response = client.post("/", json=body, headers={"lora": "versioned", "accept": "image/png"})
        assert response.status_code == 200, response.text
        return json.loads(_reopen(response.content).text["loraswap"])["adapters"][0]["sha256"]

    path = adapter_factory("versioned", "tiny-sd", rank=4, seed=41, folder=folder)
    assert recorded_sha256(1) == hashlib.sha256(path.read_bytes()).hexdigest()
    assert recorded_sha256(2) == hashlib.sha256(path.read_bytes()).hexdigest()
    assert len(calls) == 1, "a cached file's digest is kept with it: not hashed again per request"
    time.sleep(0.01)
    adapter_factory("versioned", "tiny-sd", rank=4, seed=42, folder=folder)  # rewritten: read and hashed again
    assert recorded_sha256(3) == hashlib.sha256(path.read_bytes()).hexdigest() and len(calls) == 2


def test_the_record_is_built_without_finding_any_adapter_again(served, monkeypatch):
    client, _ = served
    assert client.post("/", json=REQUEST, headers={"lora": "style", "accept": "image/png"}).status_code == 200
    store = client.app.state.deployment.hosted[0].engine.adapters
    located = []
    real = store.locate
    monkeypatch.setattr(store, "locate", lambda adapter_id: located.append(adapter_id) or real(adapter_id))
    for carried in (False, True):
        response = client.post("/", json={**REQUEST, "parameters": {**REQUEST["parameters"], "metadata": carried}},
                               headers={"lora": "style", "accept": "image/png"})
        assert bool(getattr(_reopen(response.content), "text", None)) is carried
    assert len(located) % 2 == 0 and located[:len(located) // 2] == located[len(located) // 2:], \
        "a record costs no look-up of its adapters: each request found them as often"


def test_hashes_not_known_leave_the_image_with_a_record_that_says_so(monkeypatch):
    app, _ = fake_app()
    monkeypatch.setattr("support.fakes.made_up_digest", lambda adapter_id: None)
    with TestClient(app) as client:
        response = client.post("/", json={"inputs": "x"}, headers={"lora": "style:0.5", "accept": "image/png"})
    assert response.status_code == 200
    image = _reopen(response.content)
    assert json.loads(image.text["loraswap"])["adapters"] == [
        {"id": "style", "weight": 0.5, "sha256": None, "tensors_sha256": None}]
    assert "<lora:style:0.5>" in image.text["parameters"] and "Lora hashes" not in image.text["parameters"]


def test_a_record_that_cannot_be_built_leaves_the_image_without_one(monkeypatch, caplog):
    app, backend = fake_app()

    def broken(gen, result):
        raise ValueError("a bug in the record")

    monkeypatch.setattr("loraswap.server.images.output.build_record", broken)
    with TestClient(app) as client:
        response = client.post("/v1/images/generations", json={"prompt": "x", "response_format": "b64_json"})
    assert response.status_code == 200, "the image was made: no 5xx for a client to retry"
    assert len(backend.generated) == 1
    assert "building it failed" in caplog.text


def test_loraswap_generate_writes_the_record_of_what_ran(tmp_path):
    from loraswap.adapters.files.hashes import FileDigest
    from loraswap.cli.generate import write_output
    from loraswap.engine.calls import AdapterRan, Ran
    from loraswap.engine.engine import GenerateResult
    from loraswap.engine.request import GenerateRequest

    digest = FileDigest("c" * 64, "0123456789abcdef" * 4)
    ran = Ran("tiny-sd", "EulerDiscreteScheduler", 4, 7.5, None, (AdapterRan("style", 0.7, (1, 2, 3, 4), digest),))
    result = GenerateResult(Image.new("RGB", (64, 48), (9, 9, 9)), 77, 0.0, 0.1, ran=ran)
    out = tmp_path / "fox.png"
    write_output(result, out, GenerateRequest(prompt="a red fox", negative_prompt="dull"))
    image = Image.open(out)
    record = json.loads(image.text["loraswap"])
    assert (record["seed"], record["steps"], record["guidance"], record["model"]) == (77, 4, 7.5, "tiny-sd")
    assert record["adapters"] == [{"id": "style", "weight": 0.7, "sha256": "c" * 64,
                                   "tensors_sha256": "0123456789abcdef" * 4}]
    parsed = parse_infotext(image.text["parameters"])
    assert parsed["Prompt"] == "a red fox <lora:style:0.7>" and parsed["Lora hashes"] == "style: 0123456789ab"


def test_a_dpm_sde_karras_sampler_is_named_as_a1111_names_it(served):
    from diffusers import DPMSolverMultistepScheduler

    client, _ = served
    pipeline = client.app.state.deployment.hosted[0].engine.pipeline
    own = pipeline.scheduler
    pipeline.scheduler = DPMSolverMultistepScheduler.from_config(own.config, algorithm_type="sde-dpmsolver++",
                                                                 use_karras_sigmas=True)
    try:
        response = client.post("/", json=REQUEST, headers={"accept": "image/png"})
    finally:
        pipeline.scheduler = own
    assert response.status_code == 200, response.text
    parsed = parse_infotext(_reopen(response.content).text["parameters"])
    assert (parsed["Sampler"], parsed["Schedule type"]) == ("DPM++ 2M SDE", "Karras")
    record = json.loads(_reopen(response.content).text["loraswap"])
    assert (record["sampler"], record["sampler_algorithm"], record["sigmas"]) == (
        "DPMSolverMultistepScheduler", "sde-dpmsolver++", "karras")


def test_the_guidance_recorded_under_qwens_true_cfg_scale_is_the_one_that_ran():
    from loraswap.engine.calls import AdapterRan, PipelineCalls
    from loraswap.models.families import qwen_image

    class QwenLike:  # Qwen-Image's call: guidance is `true_cfg_scale`; `guidance_scale` is another thing
        scheduler = type("FlowMatchEulerDiscreteScheduler", (), {"config": {}})()

        def __call__(self, prompt=None, num_inference_steps=50, true_cfg_scale=4.0, guidance_scale=None):
            pass

    calls = PipelineCalls(QwenLike(), qwen_image.FAMILY, {})
    held = [(type("Entry", (), {"adapter_id": "style", "stamp": (1,), "digest": None})(), 0.5)]
    asked = calls.ran("text", {"num_inference_steps": 8, "true_cfg_scale": 2.5}, "qwen-image", held)
    assert (asked.steps, asked.guidance, asked.sampler) == (8, 2.5, "FlowMatchEulerDiscreteScheduler")
    assert asked.adapters == (AdapterRan("style", 0.5, (1,), None),)
    assert calls.ran("text", {}, "qwen-image", []).guidance == 4.0, "none asked: the pipeline's own default"


def test_a_record_that_cannot_be_written_leaves_the_image_without_one(monkeypatch, caplog):
    app, _ = fake_app()

    def broken(record):
        raise ValueError("a bug in the PNG chunks")

    monkeypatch.setattr("loraswap.media.images.png_info", broken)
    with TestClient(app) as client:
        response = client.post("/", json={"inputs": "x"}, headers={"accept": "image/png"})
    assert response.status_code == 200 and not _reopen(response.content).text
    assert "writing it into the PNG failed" in caplog.text
