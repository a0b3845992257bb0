"""Adapter folders: ids, folder adapters, declared base models."""

import json

import pytest

from loraswap.adapters.files.metadata import declared_base_models
from loraswap.adapters.reference import AdapterRef
from loraswap.adapters.sources.folder import FolderSource
from loraswap.errors import AdapterInvalid


def test_ids_files_and_folders(adapter_factory, tmp_path):
    adapter_factory("plain", folder=tmp_path)
    adapter_factory("styles/anime", folder=tmp_path)
    adapter_factory("pytorch_lora_weights", folder=tmp_path / "folder-adapter")
    (tmp_path / "folder-adapter" / "README.md").write_text("---\nbase_model:\n- tiny-sd\n- other/model\n---\n# hi\n")
    (tmp_path / "folder-adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "x/y"}))
    source = FolderSource(tmp_path)
    assert source.list_ids() == ["folder-adapter", "plain", "styles/anime"]
    location = source.locate(AdapterRef("folder-adapter"))
    assert location.weights.name == "pytorch_lora_weights.safetensors"
    assert declared_base_models({}, location.folder) == ["tiny-sd", "other/model", "x/y"]
    assert declared_base_models({"base_model": "a/b"}, None) == ["a/b"]
    assert source.locate(AdapterRef("styles/anime")).weights == (tmp_path / "styles" / "anime.safetensors").resolve()


def test_folder_with_several_weight_files_lists_them(adapter_factory, tmp_path):
    adapter_factory("one", folder=tmp_path / "multi")
    adapter_factory("two", folder=tmp_path / "multi")
    with pytest.raises(AdapterInvalid, match=r"2 safetensors files \(one.safetensors, two.safetensors\)"):
        FolderSource(tmp_path).locate(AdapterRef("multi"))
