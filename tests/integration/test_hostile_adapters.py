"""Hostile adapters over HTTP: each refused with a clear 4xx, and the served model bitwise unchanged.

One real app (in-process, so the weights can be compared bit for bit) serves tiny-sd with
an adapter applied; every case asks for a hostile file or id through the `lora` header,
the URL path, the OpenAI `model` field or `POST /adapters/{id}/load`. The answer must be
the documented status with the message "adapter '<id>': <problem>. <fix>" (or the
invalid-id message; OpenAI's error body on `/v1/*`), no traceback, nothing cached, and the weights and the applied
adapter exactly as before. At the end the good adapter still gives the same image.
"""

import json
import struct
from urllib.parse import quote

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file
from support.errors import error_message
from support.numerics import assert_bitwise_equal, weights_snapshot
from support.servers import wait_ready

from loraswap.engine.config.engine import EngineConfig
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig

MAX_RANK = 64
MAX_ADAPTER_MB = 1.0
GOOD_REQUEST = {"inputs": "a red fox", "parameters": {"seed": 7, "num_inference_steps": 2, "width": 32,
                                                      "height": 32}}


def _raw(path, header, data: bytes = b"", header_len: int | None = None):
    """A file in safetensors framing with any header (bytes or JSON) and data."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if header_len is None else header_len) + text + data)


def _replace(state_dict, key_part, fn):
    out = dict(state_dict)
    key = next(k for k in out if key_part in k)
    out[key] = fn(out[key])
    return out


def _write_hostile_files(root, outside, good_path):
    good = load_file(str(good_path))
    a_key = next(k for k in good if k.startswith("unet.") and ".to_q.lora_A" in k)  # a linear layer
    module = a_key.removesuffix(".lora_A.weight")
    te_key = next(k for k in good if k.startswith("text_encoder.text_model.") and "lora_A" in k)
    # executable formats: pickles, whatever their suffix
    for suffix in (".bin", ".pt", ".ckpt"):
        torch.save(good, root / f"pickled{suffix.replace('.', '-')}{suffix}")
    torch.save(good, root / "pickle-renamed.safetensors")
    # files and links that leave the adapter folder
    save_file(good, str(outside / "evil.safetensors"))
    (root / "linked.safetensors").symlink_to(outside / "evil.safetensors")
    (root / "linkdir").symlink_to(outside, target_is_directory=True)
    (root / "card-out").mkdir()
    save_file(good, str(root / "card-out" / "pytorch_lora_weights.safetensors"))
    (outside / "README.md").write_text("---\nbase_model: secret-model\n---\n")
    (root / "card-out" / "README.md").symlink_to(outside / "README.md")
    # headers that lie
    _raw(root / "huge-header.safetensors", {"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}},
         b"\0" * 4, header_len=2**62)
    _raw(root / "header-past-end.safetensors", b"{}", header_len=50 * 2**20)
    _raw(root / "tensor-past-end.safetensors", {"a": {"dtype": "F16", "shape": [2**40, 2**20],
                                                      "data_offsets": [0, 2**61]}}, b"\0" * 16)
    _raw(root / "malformed-entry.safetensors", {"a": {"dtype": "F16", "shape": 5, "data_offsets": [0, 10]}},
         b"\0" * 10)
    _raw(root / "duplicate-key.safetensors", b'{"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},'
                                             b'"a":{"dtype":"F16","shape":[2],"data_offsets":[4,8]}}', b"\0" * 8)
    whole = good_path.read_bytes()
    (root / "truncated.safetensors").write_bytes(whole[: len(whole) // 2])
    # over the size cap (a valid file)
    save_file({**good, "pad": torch.zeros(int(MAX_ADAPTER_MB * 2**20) // 2 + 1024, dtype=torch.float16)},
              str(root / "oversized.safetensors"))
    # contents that are not a LoRA for this model
    cases = {
        "int-weights": _replace(good, "lora_A", lambda t: t.to(torch.int32)),
        "f64-weights": _replace(good, "lora_B", lambda t: t.to(torch.float64)),
        "nan": _replace(good, "lora_B", lambda t: torch.full_like(t, float("nan"))),
        "inf": _replace(good, "text_encoder", lambda t: torch.full_like(t, float("inf"))),
        "wrong-shape": _replace(good, "lora_A", lambda t: torch.zeros(t.shape[0], t.shape[1] + 3,
                                                                         dtype=t.dtype)),
        "rank-over-limit": {f"{module}.lora_A.weight": torch.zeros(MAX_RANK + 1, good[a_key].shape[1]),
                            f"{module}.lora_B.weight": torch.zeros(good[a_key.replace("lora_A", "lora_B")]
                                                                   .shape[0], MAX_RANK + 1)},
        "same-weight-twice": {**good, te_key.replace("text_encoder.text_model.", "text_encoder."):
                              good[te_key].clone()},
        "not-a-lora-key": {**good, "unet.conv_in.weight": torch.zeros(4)},
        "other-component": {"text_encoder_2.x.lora_A.weight": torch.zeros(2, 2),
                            "text_encoder_2.x.lora_B.weight": torch.zeros(2, 2)},
        "unknown-layer": {"unet.down_blocks.9.attentions.0.proj_in.lora_A.weight": torch.zeros(4, 32),
                          "unet.down_blocks.9.attentions.0.proj_in.lora_B.weight": torch.zeros(32, 4)},
        "half-pair": {k: v for k, v in good.items() if k != a_key},
        "empty": {},
        "rank-zero": {k: (v[:0] if "lora_A" in k else v[:, :0]).contiguous() for k, v in good.items()},
    }
    for name, state_dict in cases.items():
        save_file(state_dict, str(root / f"{name}.safetensors"))
    save_file(good, str(root / "other-base.safetensors"),
              metadata={"base_model": "stabilityai/stable-diffusion-xl-base-1.0"})


# id -> (status, phrase in the error); the id is sent in the `lora` header
CASES = {
    "pickled-bin": (400, "it is a .bin file; only safetensors files are loaded"),
    "pickled-pt": (400, "it is a .pt file; only safetensors files are loaded"),
    "pickled-ckpt": (400, "it is a .ckpt file; only safetensors files are loaded"),
    "pickle-renamed": (400, "not safetensors (a pickle file renamed?)"),
    "linked": (400, "its linked.safetensors is a link that leaves the adapter folder"),
    "linkdir/evil": (400, "is a link that leaves the adapter folder"),
    "card-out": (400, "its README.md is a link that leaves the adapter folder"),
    "huge-header": (400, f"the header claims {2**62} bytes"),
    "header-past-end": (400, f"the header claims {50 * 2**20} bytes"),
    "tensor-past-end": (400, "lies outside the file"),
    "malformed-entry": (400, "tensor 'a' has a malformed header entry"),
    "duplicate-key": (400, "the safetensors header names 'a' twice"),
    "truncated": (400, "lies outside the file"),
    "oversized": (400, f"over the {MAX_ADAPTER_MB:.0f} MiB limit"),
    "int-weights": (400, "has dtype I32; LoRA weights must be F16, BF16 or F32"),
    "f64-weights": (400, "has dtype F64"),
    "nan": (400, "has NaN or infinite values"),
    "inf": (400, "has NaN or infinite values"),
    "wrong-shape": (422, "which do not fit its weight"),
    "rank-over-limit": (400, f"has rank {MAX_RANK + 1}, over the limit of {MAX_RANK}"),
    "same-weight-twice": (400, "name the same weight"),
    "not-a-lora-key": (400, "key 'unet.conv_in.weight' is not a weight of any adapter kind"),
    "other-component": (400, "belong to no component of StableDiffusionPipeline"),
    "unknown-layer": (422, "does not exist in this model"),
    "half-pair": (400, "has no lora_A weight"),
    "empty": (400, "it contains no LoRA layer"),
    "rank-zero": (400, "is empty (rank 0"),
    "other-base": (422, "made for stabilityai/stable-diffusion-xl-base-1.0, and this server hosts tiny-sd"),
}
BAD_IDS = ["../outside/evil", "a/../../etc/passwd", "/etc/passwd", "file:///etc/passwd", "hf://owner/name",
           "C:\\adapters\\x", "~/x", "x\x00y", ".hidden"]
# references to files elsewhere, which this server (no --url-allow, --civitai, --s3) does not fetch
REMOTE_NAMES = [("http://evil.example/x.safetensors", "--url-allow"), ("civitai:1@2", "--civitai"),
                ("s3://some-bucket/x.safetensors", "--s3")]


@pytest.fixture(scope="module")
def served(adapter_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    outside = tmp_path_factory.mktemp("outside")
    good_path = adapter_factory("good", "tiny-sd", rank=8, targets="all", text_encoder=True, alpha=16.0, seed=31,
                                folder=root)
    _write_hostile_files(root, outside, good_path)
    config = EngineConfig(model="tiny-sd", adapters=root, max_rank=MAX_RANK, max_adapter_mb=MAX_ADAPTER_MB)
    app = create_app(ServerConfig(engines=[config]))
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_ready(client, 120)
        first = client.post("/", json=GOOD_REQUEST, headers={"lora": "good", "accept": "image/png"})
        assert first.status_code == 200, first.text
        engine = app.state.deployment.hosted[0].engine
        yield client, engine, weights_snapshot(engine.components), first.content


def _assert_refused(response, status: int, phrase: str, adapter_id: str | None):
    assert response.status_code == status, response.text
    assert "Traceback" not in response.text
    error = error_message(response)
    assert phrase in error, error
    if adapter_id is not None:  # adapter errors: "adapter '<id>': <problem>. <fix>"
        assert error.startswith(f"adapter '{adapter_id}': "), error
        problem, _, fix = error.partition(". ")
        assert fix and fix[0].isupper(), f"no fix in {error!r}"


def _assert_unchanged(engine, base):
    assert_bitwise_equal(base, engine.components)
    assert engine.applied_ids == (("good", 1.0),)
    assert all(row["in_use"] == 0 for row in engine.adapters.cache.table())


@pytest.mark.parametrize("adapter_id", list(CASES))
def test_hostile_adapter_is_refused_and_changes_nothing(served, adapter_id):
    client, engine, base, _ = served
    status, phrase = CASES[adapter_id]
    response = client.post("/", json=GOOD_REQUEST, headers={"lora": adapter_id})
    _assert_refused(response, status, phrase, adapter_id)
    _assert_unchanged(engine, base)
    assert engine.adapters.cache.get(adapter_id) is None, "a refused adapter was cached"


@pytest.mark.parametrize("adapter_id", ["pickled-bin", "linked", "nan", "other-base", "same-weight-twice"])
def test_hostile_adapter_is_refused_on_every_route(served, adapter_id):
    client, engine, base, _ = served
    status, phrase = CASES[adapter_id]
    by_path = client.post(f"/models/{adapter_id}", json=GOOD_REQUEST)
    by_openai = client.post("/v1/images/generations", json={"model": adapter_id, "prompt": "x", "size": "32x32"})
    by_load = client.post(f"/adapters/{adapter_id}/load")
    for response in (by_path, by_openai, by_load):
        _assert_refused(response, status, phrase, adapter_id)
    _assert_unchanged(engine, base)
    assert engine.adapters.cache.get(adapter_id) is None, "a refused adapter was cached or kept"


@pytest.mark.parametrize("bad_id", BAD_IDS)
def test_ids_that_are_paths_are_refused(served, bad_id):
    client, engine, base, _ = served
    header = client.post("/", json=GOOD_REQUEST, headers={"lora": bad_id}) if "\x00" not in bad_id else None
    path = client.post("/models/" + quote(bad_id, safe=""), json=GOOD_REQUEST)
    openai = client.post("/v1/images/generations", json={"model": bad_id, "prompt": "x", "size": "32x32"})
    load = client.post("/adapters/" + quote(bad_id, safe="") + "/load")
    for response in (header, path, openai, load):
        if response is not None:
            _assert_refused(response, 400, "invalid adapter id", None)
            assert "never paths" in error_message(response)
    _assert_unchanged(engine, base)


@pytest.mark.parametrize("name,flag", REMOTE_NAMES)
def test_files_elsewhere_are_refused_naming_the_flag_that_allows_them(served, name, flag):
    client, engine, base, _ = served
    header = client.post("/", json=GOOD_REQUEST, headers={"lora": name})
    path = client.post("/models/" + quote(name, safe=""), json=GOOD_REQUEST)
    openai = client.post("/v1/images/generations", json={"model": name, "prompt": "x", "size": "32x32"})
    body = client.post("/v1/images/generations", json={"loras": [{"path": name}], "prompt": "x", "size": "32x32"})
    load = client.post("/adapters/" + quote(name, safe="") + "/load")
    for response in (header, path, openai, body, load):
        assert response.status_code == 403, response.text
        assert flag in error_message(response), response.text
    _assert_unchanged(engine, base)


def test_a_hostile_adapter_in_a_blend_changes_nothing(served):
    client, engine, base, _ = served
    response = client.post("/", json=GOOD_REQUEST, headers={"lora": "good:0.5, nan:0.5"})
    _assert_refused(response, 400, "has NaN or infinite values", "nan")
    _assert_unchanged(engine, base)


def test_after_all_refusals_the_good_adapter_gives_the_same_image(served):
    client, engine, base, first_image = served
    again = client.post("/", json=GOOD_REQUEST, headers={"lora": "good", "accept": "image/png"})
    assert again.status_code == 200 and again.content == first_image
    _assert_unchanged(engine, base)
