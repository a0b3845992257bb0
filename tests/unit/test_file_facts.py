"""What the store and the baselines remember of adapter files is bounded, however many ids a
client makes up (every distinct URL is a `url:` id): the least recently used goes first,
and a forgotten download's entry goes with it."""

import torch
from safetensors.torch import save_file

from loraswap.adapters.bound import ModelLayers
from loraswap.adapters.cache import CacheConfig
from loraswap.adapters.files.facts import MAX_ENTRIES, FileFacts
from loraswap.adapters.files.location import AdapterLocation
from loraswap.adapters.random import make_random_adapter
from loraswap.adapters.reference import as_refs
from loraswap.adapters.sources.choose import AdapterSources
from loraswap.adapters.sources.folder import FolderSource
from loraswap.adapters.store import AdapterStore, TargetModel
from loraswap.engine.swap.baselines import LocatedFiles
from loraswap.models import lora_components


def url_id(number: int) -> str:
    return f"url:{number:032x}"


def test_ten_thousand_ids_keep_at_most_the_bound_the_most_recently_used_kept():
    facts: FileFacts[bool] = FileFacts()
    for number in range(10_000):
        facts.put(url_id(number), (number,), True)
        facts.get(url_id(0), (0,))  # the first is used all along
    assert len(facts) == MAX_ENTRIES == 4096
    assert facts.get(url_id(0), (0,)) is True, "used all along: kept"
    assert facts.get(url_id(1), (1,)) is None, "least recently used: dropped"
    assert facts.get(url_id(9_999), (9_999,)) is True
    assert facts.get(url_id(9_999), (1,)) is None, "a changed file is not the one remembered"


def _store(tmp_path):
    cls, components = lora_components("tiny-sd")
    state_dict, metadata = make_random_adapter(components, 4, "attn")
    save_file(state_dict, str(tmp_path / "a.safetensors"), metadata=metadata)
    target = TargetModel("tiny-sd", cls, ModelLayers(components), torch.float32)
    store = AdapterStore(AdapterSources(FolderSource(tmp_path), None, None), target,
                         CacheConfig(gpu_bytes=0), torch.device("cpu"))
    return store, tmp_path / "a.safetensors"


def test_the_stores_fits_answers_are_bounded_and_a_forgotten_download_drops_its_own(tmp_path, monkeypatch):
    store, path = _store(tmp_path)
    store.fit_answers.max_entries = 16  # the default's 4,096 would take seconds of parsing to fill
    checked = []
    monkeypatch.setattr("loraswap.adapters.store.check_fit", lambda location, *a: checked.append(location))
    for number in range(40):
        assert store.fits(AdapterLocation(url_id(number), path, None)) is True
    assert len(store.fit_answers) == 16 and len(checked) == 40
    assert store.fits(AdapterLocation(url_id(39), path, None)) is True and len(checked) == 40, "remembered"
    store.evict_download(url_id(39))
    assert len(store.fit_answers) == 15
    assert store.fits(AdapterLocation(url_id(39), path, None)) is True and len(checked) == 41, "looked at again"
    store.close()


def test_the_baselines_located_files_are_bounded(tmp_path, monkeypatch):
    store, path = _store(tmp_path)
    monkeypatch.setattr(store, "locate", lambda ref: AdapterLocation(ref.adapter_id, path, None))
    located = LocatedFiles(store)
    located.files.max_entries = 16
    for number in range(40):
        assert located.lease_now(as_refs([(url_id(number), 1.0)])).held[0][0].adapter_id == url_id(number)
    assert len(located.files) == 16
    store.close()
