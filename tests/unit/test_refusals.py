"""Refused adapters: a clear error naming adapter, problem and fix; the model bitwise unchanged."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.numerics import assert_bitwise_equal, weights_snapshot

from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.errors import AdapterIncompatible, AdapterInvalid, AdapterNotFound, BadRequest


@pytest.fixture
def served(adapter_factory, tmp_path):
    """An engine with a good adapter applied, and its folder to drop bad files into."""
    good = adapter_factory("good", "tiny-sd", rank=8, targets="all", text_encoder=True, folder=tmp_path)
    engine = Engine(EngineConfig(model="tiny-sd", adapters=tmp_path, compile=False, warmup=False, max_rank=256))
    engine.set_adapters([("good", 1.0)])
    return engine, tmp_path, load_file(str(good))


def _mutated(state_dict, key_part, fn):
    out = dict(state_dict)
    key = next(k for k in out if key_part in k)
    out[key] = fn(out[key])
    return out


def _cases(good):
    first_a = next(k for k in good if "lora_A" in k)
    return {
        "wrong-shape": (_mutated(good, "lora_A", lambda t: torch.zeros(t.shape[0], t.shape[1] + 3)),
                        AdapterIncompatible, "do not fit"),
        "unknown-layer": ({**good, "unet.down_blocks.9.attentions.0.proj_in.lora_A.weight": torch.zeros(8, 16),
                           "unet.down_blocks.9.attentions.0.proj_in.lora_B.weight": torch.zeros(16, 8)},
                          AdapterIncompatible, "does not exist"),
        "nan": (_mutated(good, "lora_B", lambda t: torch.full_like(t, float("nan"))), AdapterInvalid, "NaN"),
        "inf": (_mutated(good, "text_encoder", lambda t: torch.full_like(t, float("inf"))), AdapterInvalid, "NaN"),
        "rank-over-limit": ({k: (torch.zeros(300, *v.shape[1:]) if "lora_A" in k
                                 else torch.zeros(v.shape[0], 300, *v.shape[2:])) for k, v in good.items()},
                            AdapterInvalid, "over the limit"),
        "not-lora-key": ({**good, "unet.conv_in.weight": torch.zeros(4)}, AdapterInvalid,
                         "not a weight of any adapter kind"),
        "half-pair": ({k: v for k, v in good.items() if k != first_a}, AdapterInvalid, "has no lora_A"),
        "int-weights": (_mutated(good, "lora_A", lambda t: t.to(torch.int32)), AdapterInvalid, "dtype I32"),
        "dora": ({**good, first_a.replace("lora_A.weight", "lora_magnitude_vector"): torch.ones(4)},
                 AdapterInvalid, "DoRA"),
        "sdxl-layout": ({"unet.down_blocks.1.attentions.0.transformer_blocks.1.attn1.to_q.lora_A.weight":
                         torch.zeros(4, 32), "unet.down_blocks.1.attentions.0.transformer_blocks.1.attn1.to_q."
                         "lora_B.weight": torch.zeros(32, 4)}, AdapterIncompatible, "does not exist"),
    }


@pytest.mark.parametrize("case", ["wrong-shape", "unknown-layer", "nan", "inf", "rank-over-limit", "not-lora-key",
                                  "half-pair", "int-weights", "dora", "sdxl-layout"])
def test_refused_state_dicts_change_nothing(served, case):
    engine, root, good = served
    state_dict, error, phrase = _cases(good)[case]
    save_file(state_dict, str(root / f"{case}.safetensors"))
    before = weights_snapshot(engine.components)
    with pytest.raises(error) as info:
        engine.set_adapters([(case, 1.0)])
    message = str(info.value)
    assert f"adapter '{case}'" in message and phrase in message, message
    assert info.value.fix and message.endswith(info.value.fix)  # the message ends with how to fix it
    assert_bitwise_equal(before, engine.components)
    assert engine.applied_ids == (("good", 1.0),)


def test_refused_inside_a_blend_changes_nothing(served):
    engine, root, good = served
    save_file(_cases(good)["nan"][0], str(root / "nan.safetensors"))
    before = weights_snapshot(engine.components)
    with pytest.raises(AdapterInvalid):
        engine.set_adapters([("good", 0.5), ("nan", 0.5)])
    assert_bitwise_equal(before, engine.components)


def test_other_base_model_is_refused(served, adapter_factory):
    engine, root, _ = served
    adapter_factory("for-sdxl", "tiny-sd", rank=4, base_model="stabilityai/stable-diffusion-xl-base-1.0", folder=root)
    before = weights_snapshot(engine.components)
    with pytest.raises(AdapterIncompatible, match="made for stabilityai/stable-diffusion-xl-base-1.0.*hosts tiny-sd"):
        engine.set_adapters([("for-sdxl", 1.0)])
    assert_bitwise_equal(before, engine.components)
    # the same adapter declaring the hosted model is served
    adapter_factory("for-sd", "tiny-sd", rank=4, base_model="tiny-sd", folder=root)
    engine.set_adapters([("for-sd", 1.0)])


def test_pickle_renamed_and_truncated_files_are_refused(served):
    engine, root, good = served
    torch.save(good, root / "pickled.safetensors")
    whole = (root / "good.safetensors").read_bytes()
    (root / "truncated.safetensors").write_bytes(whole[: len(whole) // 2])
    (root / "tiny.safetensors").write_bytes(b"\x01\x02")
    (root / "badjson.safetensors").write_bytes((8).to_bytes(8, "little") + b"{notjson")
    torch.save(good, root / "real-pickle.bin")
    before = weights_snapshot(engine.components)
    for name, phrase in (("pickled", "not safetensors"), ("truncated", "truncated"), ("tiny", "too short"),
                         ("badjson", "not valid JSON"), ("real-pickle", "only safetensors")):
        with pytest.raises(AdapterInvalid, match=phrase):
            engine.set_adapters([(name, 1.0)])
    assert_bitwise_equal(before, engine.components)


def test_size_cap(adapter_factory, tmp_path):
    adapter_factory("big", "tiny-sd", rank=64, targets="all", folder=tmp_path)
    engine = Engine(EngineConfig(model="tiny-sd", adapters=tmp_path, compile=False, warmup=False,
                                 max_adapter_mb=0.05))
    with pytest.raises(AdapterInvalid, match="over the 0 MiB limit|over the"):
        engine.set_adapters([("big", 1.0)])


@pytest.mark.parametrize("bad_id", ["../x", "/etc/passwd", "a/../../b", "http://evil/x", "a b", ".hidden", "x/", ""])
def test_ids_that_are_paths_are_refused(served, bad_id):
    engine, _, _ = served
    with pytest.raises(BadRequest, match="invalid adapter id"):
        engine.set_adapters([(bad_id, 1.0)])


def test_symlink_leaving_the_folder_is_refused(served, tmp_path_factory):
    engine, root, good = served
    outside = tmp_path_factory.mktemp("outside") / "evil.safetensors"
    save_file(good, str(outside))
    (root / "linked.safetensors").symlink_to(outside)
    with pytest.raises(AdapterInvalid, match="leaves the adapter folder"):
        engine.set_adapters([("linked", 1.0)])


def test_unknown_adapter_is_not_found(served):
    engine, _, _ = served
    with pytest.raises(AdapterNotFound, match="no such adapter"):
        engine.set_adapters([("nope", 1.0)])


def test_failure_halfway_through_a_swap_restores_the_base(served, monkeypatch):
    engine, root, _ = served
    engine.set_adapters([])
    base = weights_snapshot(engine.components)
    engine.set_adapters([("good", 1.0)])
    calls = {"n": 0}

    def failing(original):
        def wrapper(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 20:
                raise RuntimeError("injected failure")
            return original(*args, **kwargs)
        return wrapper

    # the 20th weight update of the swap fails, whichever op performs it
    monkeypatch.setattr(torch, "addmm", failing(torch.addmm))
    monkeypatch.setattr(torch.Tensor, "addmm_", failing(torch.Tensor.addmm_))
    with pytest.raises(RuntimeError, match="injected"):
        engine.set_adapters([("good", 0.5)])
    monkeypatch.undo()
    assert calls["n"] == 20
    assert_bitwise_equal(base, engine.components)
    assert engine.applied_ids == ()
    engine.set_adapters([("good", 0.5)])  # and the next swap works
