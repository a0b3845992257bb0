"""Faults at the engine: files replaced under the cache, side files that leave the folder."""

import os
import shutil

import pytest
import torch
from support.numerics import assert_bitwise_equal, weights_snapshot

from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.errors import AdapterInvalid


def test_replaced_file_with_the_same_size_and_mtime_is_read_again(adapter_factory, tmp_path):
    """`cp -p`, `rsync -t` and tar keep the mtime: the cache must still see a new file."""
    path = adapter_factory("kept-mtime", "tiny-sd", rank=8, targets="all", seed=90, folder=tmp_path)
    engine = Engine(EngineConfig(model="tiny-sd", adapters=tmp_path, compile=False, warmup=False))
    engine.set_adapters([("kept-mtime", 1.0)])
    old_weights = weights_snapshot(engine.components)
    stat = path.stat()
    # new content of exactly the same size, copied over the file with its mtime restored
    staged = adapter_factory("staged", "tiny-sd", rank=8, targets="all", seed=92, folder=tmp_path / "staging")
    assert staged.stat().st_size == stat.st_size
    shutil.copyfile(staged, path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)

    engine.set_adapters([("kept-mtime", 1.0)])
    assert engine.adapters.cache.misses == 2, "the replaced file was read again"
    fresh = Engine(EngineConfig(model="tiny-sd", adapters=tmp_path, compile=False, warmup=False))
    fresh.set_adapters([("kept-mtime", 1.0)])
    assert_bitwise_equal(weights_snapshot(fresh.components), engine.components)
    now = weights_snapshot(engine.components)
    assert any(not torch.equal(old_weights[k], now[k]) for k in now), "the new content is what is fused"


@pytest.mark.parametrize("side", ["README.md", "adapter_config.json"])
def test_side_file_linking_out_of_the_folder_is_refused(adapter_factory, tmp_path, tmp_path_factory, side):
    """A model card or adapter_config.json that links out would be read (and its base model
    echoed in a 422): refused like a weight file that links out."""
    root = tmp_path / "adapters"
    adapter_factory("linked-card/pytorch_lora_weights", "tiny-sd", rank=4, seed=91, folder=root)
    outside = tmp_path_factory.mktemp("outside") / side
    outside.write_text("---\nbase_model: secret-model\n---\n" if side == "README.md"
                       else '{"base_model_name_or_path": "secret-model"}')
    (root / "linked-card" / side).symlink_to(outside)
    engine = Engine(EngineConfig(model="tiny-sd", adapters=root, compile=False, warmup=False))
    before = weights_snapshot(engine.components)
    with pytest.raises(AdapterInvalid, match=f"its {side} is a link that leaves the adapter folder") as info:
        engine.set_adapters([("linked-card", 1.0)])
    assert "secret-model" not in str(info.value)
    assert_bitwise_equal(before, engine.components)
