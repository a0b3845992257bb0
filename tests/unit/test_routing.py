"""Routing an adapter that names no base model: by the family its metadata or source names,
else by the hosted model its layers fit, else refused naming the hosted models."""

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from loraswap.adapters.files.location import AdapterLocation
from loraswap.adapters.reference import AdapterRef
from loraswap.errors import AdapterIncompatible, AdapterInvalid
from loraswap.server.routing import HostedModel, route_by_base_model


@pytest.fixture
def bare_file(tmp_path):
    path = tmp_path / "bare.safetensors"
    save_file({"x.lora_down.weight": torch.zeros(1, 1)}, str(path))
    return path


def _route(hosted, path, source_says=None):
    return route_by_base_model(hosted, lambda ref: AdapterLocation(ref.adapter_id, path, None, source_says=source_says),
                               [AdapterRef("civitai:1@2")], max_adapter_bytes=2**30)


def test_the_family_the_source_names_wins(bare_file):
    hosted = [HostedModel("my-sd", "sd15", lambda loc: True), HostedModel("my-sdxl", "sdxl", lambda loc: True)]
    assert _route(hosted, bare_file, source_says="SDXL 1.0") == "my-sdxl", "Civitai's baseModel"
    assert _route(hosted, bare_file, source_says="Pony") == "my-sdxl"
    assert _route(hosted, bare_file) == "my-sd", "several fit: the default"


def test_the_family_the_files_metadata_names_wins(tmp_path):
    path = tmp_path / "kohya.safetensors"
    save_file({"x.lora_down.weight": torch.zeros(1, 1)}, str(path),
              metadata={"ss_base_model_version": "sdxl_base_v1-0"})
    hosted = [HostedModel("my-sd", "sd15", lambda loc: True), HostedModel("my-sdxl", "sdxl", lambda loc: True)]
    assert _route(hosted, path) == "my-sdxl", "kohya's ss_base_model_version, though both models would take it"


def test_else_the_model_it_fits_else_refused(bare_file):
    fits_sdxl = [HostedModel("my-sd", "sd15", lambda loc: False), HostedModel("my-sdxl", "sdxl", lambda loc: True)]
    assert _route(fits_sdxl, bare_file, source_says="a family nobody hosts") == "my-sdxl"
    fits_none = [HostedModel("my-sd", "sd15", lambda loc: False), HostedModel("my-sdxl", "sdxl", lambda loc: False)]
    with pytest.raises(AdapterIncompatible, match=r"fit none of the hosted models \(my-sd, my-sdxl\)"):
        _route(fits_none, bare_file)


def _broken_files(bare_file, folder) -> list:
    """A truncated file, and one whose header claims a 2^60-element tensor."""
    truncated, huge = folder / "truncated.safetensors", folder / "huge.safetensors"
    truncated.write_bytes(bare_file.read_bytes()[:-2])
    header = json.dumps({"a": {"dtype": "F16", "shape": [2**30, 2**30], "data_offsets": [0, 2**61]}}).encode()
    huge.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    return [truncated, huge]


def test_a_files_own_defect_is_named_not_taken_for_a_file_that_fits_nothing(bare_file, tmp_path):
    checked = []
    fits_none = [HostedModel("my-sd", "sd15", lambda loc: checked.append(loc) or False),
                 HostedModel("my-sdxl", "sdxl", lambda loc: checked.append(loc) or False)]
    for path in _broken_files(bare_file, tmp_path):
        with pytest.raises(AdapterInvalid, match="lies outside the file") as caught:
            _route(fits_none, path)
        assert caught.value.status == 400
    assert not checked, "refused before any model is asked whether it fits"


def test_where_fitting_cannot_be_told_the_default_serves(bare_file):
    ray_ingress = [HostedModel("my-sd", "sd15"), HostedModel("my-sdxl", "sdxl")]
    assert _route(ray_ingress, bare_file) == "my-sd"
    assert _route(ray_ingress, bare_file, source_says="SDXL 1.0") == "my-sdxl"


def test_a_store_reads_a_file_once_to_say_whether_it_fits(adapter_factory, tmp_path, monkeypatch):
    from loraswap.adapters import store
    from loraswap.engine.config import EngineConfig
    from loraswap.engine.engine import Engine

    adapter_factory("fit-once", "tiny-sdxl", rank=4, seed=81, folder=tmp_path)
    engine = Engine(EngineConfig(model="tiny-sd", adapters=tmp_path, compile=False, warmup=False))
    reads = []
    check_fit = store.check_fit
    monkeypatch.setattr(store, "check_fit", lambda *a, **k: reads.append(a[0]) or check_fit(*a, **k))
    location = engine.adapters.locate(AdapterRef("fit-once"))
    assert [engine.adapters.fits(location) for _ in range(3)] == [False] * 3 and len(reads) == 1
    adapter_factory("fit-once", "tiny-sd", rank=4, seed=82, folder=tmp_path)  # a new file under the same id
    assert engine.adapters.fits(engine.adapters.locate(AdapterRef("fit-once"))) and len(reads) == 2


def test_a_store_raises_a_files_defect_rather_than_saying_it_does_not_fit(adapter_factory, tmp_path):
    from loraswap.engine.config import EngineConfig
    from loraswap.engine.engine import Engine

    good = adapter_factory("good", "tiny-sd", rank=4, seed=83, folder=tmp_path)
    engine = Engine(EngineConfig(model="tiny-sd", adapters=tmp_path, compile=False, warmup=False))
    for path in _broken_files(good, tmp_path):
        with pytest.raises(AdapterInvalid, match="lies outside the file"):
            engine.adapters.fits(engine.adapters.locate(AdapterRef(path.stem)))
    assert engine.adapters.fits(engine.adapters.locate(AdapterRef("good")))
