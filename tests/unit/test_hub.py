"""Hub adapters through huggingface_hub's cache, offline (HF_HUB_OFFLINE=1, a pre-filled cache)."""

import shutil

import huggingface_hub.constants
import pytest

from loraswap.adapters.reference import AdapterRef
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.errors import AdapterForbidden, AdapterInvalid, AdapterNotFound

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def cache_repo(cache, repo, files, commit=COMMIT, ref="main"):
    """Lay out a repo the way huggingface_hub's cache does: refs/<ref> -> snapshots/<commit>/."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, source in files.items():
        if isinstance(source, str):
            (snapshot / name).write_text(source)
        else:
            shutil.copy(source, snapshot / name)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)


@pytest.fixture
def hub_engine(tmp_path, adapter_factory, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cache = tmp_path / "hub"
    a = adapter_factory("hub-a", "tiny-sd", rank=4, seed=300, folder=tmp_path / "src")
    b = adapter_factory("hub-b", "tiny-sd", rank=8, targets="all", seed=301, folder=tmp_path / "src")
    cache_repo(cache, "alice/watercolor", {"pytorch_lora_weights.safetensors": a, "other.safetensors": b,
                                           "README.md": "---\nbase_model: tiny-sd\n---\n"})
    cache_repo(cache, "alice/watercolor", {"pytorch_lora_weights.safetensors": b}, commit=OTHER, ref="v2")
    cache_repo(cache, "bob/single", {"bob_style.safetensors": a})
    cache_repo(cache, "bob/two", {"x.safetensors": a, "y.safetensors": b})
    cache_repo(cache, "carol/sdxl", {"pytorch_lora_weights.safetensors": a,
                                     "README.md": "---\nbase_model: stabilityai/stable-diffusion-xl-base-1.0\n---\n"})
    cache_repo(cache, "mallory/evil", {"pytorch_lora_weights.safetensors": a})
    local = tmp_path / "local"
    adapter_factory("styles/local", "tiny-sd", rank=4, seed=302, folder=local)
    engine = Engine(EngineConfig(model="tiny-sd", adapters=local, hub=True, hub_cache_dir=cache,
                                 hub_deny=["mallory/*"], warmup=False))
    return engine, a, b


def test_hub_ids_revisions_and_weight_choice(hub_engine):
    engine, a, b = hub_engine
    location = engine.adapters.locate(AdapterRef("alice/watercolor"))
    assert location.weights.name == "pytorch_lora_weights.safetensors"
    assert location.weights.read_bytes() == a.read_bytes()
    assert engine.adapters.locate(AdapterRef("alice/watercolor@v2")).weights.read_bytes() == b.read_bytes()
    assert engine.adapters.locate(AdapterRef(f"alice/watercolor@{OTHER}")).weights.read_bytes() == b.read_bytes()
    assert engine.adapters.locate(AdapterRef("bob/single")).weights.name == "bob_style.safetensors"
    # served, with the model card's base model honoured
    engine.set_adapters([("alice/watercolor", 1.0)])
    assert engine.adapters.read(AdapterRef("alice/watercolor")).base_models == ("tiny-sd",)
    # local ids still win; local ids cannot take a revision
    assert engine.adapters.locate(AdapterRef("styles/local")).weights.name == "local.safetensors"


def test_hub_refusals(hub_engine):
    engine, _, _ = hub_engine
    with pytest.raises(AdapterInvalid, match=r"2 safetensors files \(x.safetensors, y.safetensors\)"):
        engine.adapters.locate(AdapterRef("bob/two"))
    with pytest.raises(AdapterNotFound, match="not found on the hub or in its cache"):
        engine.adapters.locate(AdapterRef("nobody/nothing"))
    with pytest.raises(AdapterNotFound):
        engine.adapters.locate(AdapterRef("alice/watercolor@nope"))
    with pytest.raises(AdapterForbidden, match="allow/deny"):
        engine.adapters.locate(AdapterRef("mallory/evil"))
    with pytest.raises(Exception, match="hosts tiny-sd"):
        engine.set_adapters([("carol/sdxl", 1.0)])


def test_hub_size_cap_applies_to_cached_files(hub_engine, tmp_path):
    engine, _, _ = hub_engine
    small = Engine(EngineConfig(model="tiny-sd", hub=True, hub_cache_dir=tmp_path / "hub", max_adapter_mb=0.001,
                                warmup=False))
    with pytest.raises(AdapterInvalid, match="over the"):
        small.set_adapters([("alice/watercolor", 1.0)])


def test_a_used_and_kept_hub_adapter_is_listed_with_its_tier(hub_engine):
    """GET /adapters lists what is in the folder and what any cache tier holds: a hub adapter
    is in no folder, and was missing from the list even when kept."""
    engine, _, _ = hub_engine
    engine.set_adapters([("bob/single", 1.0)])
    engine.adapters.keep(AdapterRef("alice/watercolor"))
    rows = {row["id"]: row for row in engine.adapters.rows(engine.applied_ids)}
    assert set(rows) == {"styles/local", "bob/single", "alice/watercolor"}
    assert rows["alice/watercolor"]["kept"] and rows["alice/watercolor"]["cached"] == "host"
    assert rows["bob/single"]["applied"] and not rows["bob/single"]["kept"]
    assert rows["styles/local"]["cached"] == "disk" and "rank" not in rows["styles/local"]
    engine.adapters.evict(AdapterRef("alice/watercolor"))
    assert "alice/watercolor" not in {row["id"] for row in engine.adapters.rows()}
