"""Routing an adapter that names no base model: by the family its metadata or source names,
else by the hosted model its layers fit, else refused naming the hosted models. The files routing
found go on to the lease only of the model whose store found them."""

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from loraswap.adapters.files.location import AdapterLocation, file_stamp
from loraswap.adapters.reference import AdapterRef
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.errors import AdapterIncompatible, AdapterInvalid, AdapterNotFound
from loraswap.server.routing import Deployment, Hosted, HostedModel, route_by_base_model


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
    good = adapter_factory("good", "tiny-sd", rank=4, seed=83, folder=tmp_path)
    engine = Engine(EngineConfig(model="tiny-sd", adapters=tmp_path, compile=False, warmup=False))
    for path in _broken_files(good, tmp_path):
        with pytest.raises(AdapterInvalid, match="lies outside the file"):
            engine.adapters.fits(engine.adapters.locate(AdapterRef(path.stem)))
    assert engine.adapters.fits(engine.adapters.locate(AdapterRef("good")))


@pytest.fixture
def two_folders(adapter_factory, tmp_path):
    """tiny-sd (the default) and tiny-sdxl, each with an adapter folder of its own: both hold
    `shared` (two files), only the default's holds `not-in-sdxl` and `for-sd`."""
    folders = {model: tmp_path / model for model in ("tiny-sd", "tiny-sdxl")}
    for model, folder in folders.items():
        adapter_factory("shared", "tiny-sdxl", rank=4, base_model="tiny-sdxl", seed=len(model), folder=folder)
    adapter_factory("not-in-sdxl", "tiny-sdxl", rank=4, base_model="tiny-sdxl", seed=91, folder=folders["tiny-sd"])
    adapter_factory("for-sd", "tiny-sd", rank=4, base_model="tiny-sd", seed=92, folder=folders["tiny-sd"])
    engines = [Engine(EngineConfig(model=model, adapters=folder, compile=False, warmup=False))
               for model, folder in folders.items()]
    return Deployment([Hosted(engine, None) for engine in engines]), folders


def test_a_model_routed_to_reads_the_file_its_own_sources_find(two_folders):
    """Routing finds files through the default model's store; another model chosen finds them
    again through its own sources: its folder's file, and its refusals."""
    deployment, folders = two_folders
    sd, sdxl = (hosted.engine for hosted in deployment.hosted)
    route = deployment.route([AdapterRef("shared")])
    assert route.hosted.engine is sdxl and route.located == {}, "found by tiny-sd's store: not tiny-sdxl's"
    with sdxl.lender.lease_now([AdapterRef("shared")], route.located) as lease:
        [(entry, _)] = lease.held
        assert entry.stamp == file_stamp(AdapterLocation("shared", folders["tiny-sdxl"] / "shared.safetensors", None))
    route = deployment.route([AdapterRef("not-in-sdxl")])
    assert route.hosted.engine is sdxl
    with pytest.raises(AdapterNotFound, match="no such adapter in the adapter folder"):
        sdxl.lender.lease_now([AdapterRef("not-in-sdxl")], route.located)
    route = deployment.route([AdapterRef("for-sd")])
    assert route.hosted.engine is sd and list(route.located) == ["for-sd"], "its own store's file goes on"
    assert route.located["for-sd"].weights == folders["tiny-sd"] / "for-sd.safetensors"


def test_a_file_removed_after_routing_is_not_found_as_if_never_there(two_folders):
    """A folder file deleted between routing and its read (the request queued meanwhile) is a 404,
    as when the lease located it itself, not a 503 "removed while it was being read"."""
    deployment, folders = two_folders
    sd = deployment.hosted[0].engine
    route = deployment.route([AdapterRef("for-sd")])
    assert route.hosted.engine is sd and "for-sd" in route.located
    (folders["tiny-sd"] / "for-sd.safetensors").unlink()
    with pytest.raises(AdapterNotFound, match="no such adapter in the adapter folder"):
        sd.lender.lease_now([AdapterRef("for-sd")], route.located)
