"""Reading a safetensors file into one buffer (formats.read_safetensors): the same tensors as
the safetensors library reads, the format's layout rules enforced as it enforces them, and
host buffers that go back to the system when dropped."""

import functools
import json
import resource
import struct

import pytest
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save_file

from loraswap.adapters.files.formats import read_safetensors
from loraswap.adapters.files.host_memory import host_bytes
from loraswap.errors import AdapterIncompatible, AdapterInvalid


def _raw_file(path, entries: list[tuple[str, str, list[int], bytes]], offsets=None) -> bytes:
    """A safetensors file written by hand (name, dtype, shape, bytes), laid end to end unless
    `offsets` says otherwise: what no library writer would make."""
    header, start = {}, 0
    for i, (name, dtype, shape, data) in enumerate(entries):
        span = offsets[i] if offsets else (start, start + len(data))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": list(span)}
        start = span[1]
    text = json.dumps(header).encode()
    body = struct.pack("<Q", len(text)) + text + b"".join(e[3] for e in entries)
    path.write_bytes(body)
    return body


def test_tensors_equal_what_safetensors_reads(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {"a.lora_down.weight": torch.randn(8, 320, generator=generator).to(torch.bfloat16),
               "a.lora_up.weight": torch.randn(640, 8, generator=generator).half(),
               "a.alpha": torch.tensor(4.0), "b.diff": torch.randn(3, 5, generator=generator)}
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path), metadata={"ss_network_dim": "8"})
    read, metadata = read_safetensors(path, "x", 2**30)
    reference = safetensors_load(path.read_bytes())
    assert metadata == {"ss_network_dim": "8"}
    assert read.keys() == reference.keys()
    for name, tensor in reference.items():
        assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape, name
        assert torch.equal(read[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def test_an_integer_alpha_is_read_and_an_integer_weight_refused(tmp_path):
    """diffusers' `convert_state_dict_to_kohya` writes each alpha as one int64 (the rank): read
    as that number; integer factors stay refused."""
    down, up = torch.ones(4, 8), torch.ones(8, 4)
    save_file({"a.lora_down.weight": down, "a.lora_up.weight": up, "a.alpha": torch.tensor(4)},
              str(tmp_path / "kohya.safetensors"))
    tensors, _ = read_safetensors(tmp_path / "kohya.safetensors", "kohya", 2**20)
    assert tensors["a.alpha"].dtype == torch.int64 and tensors["a.alpha"].item() == 4
    save_file({"a.lora_down.weight": down.to(torch.int64), "a.lora_up.weight": up, "a.alpha": torch.tensor(4)},
              str(tmp_path / "int-weights.safetensors"))
    with pytest.raises(AdapterInvalid, match="'a.lora_down.weight' has dtype I64"):
        read_safetensors(tmp_path / "int-weights.safetensors", "int-weights", 2**20)
    save_file({"a.lora_down.weight": down, "a.lora_up.weight": up, "a.alpha": torch.tensor([4, 4])},
              str(tmp_path / "two-alphas.safetensors"))
    with pytest.raises(AdapterInvalid, match="'a.alpha' has dtype I64"):  # an alpha is one number
        read_safetensors(tmp_path / "two-alphas.safetensors", "two-alphas", 2**20)


def test_an_entry_at_an_odd_offset_reads_the_same(tmp_path):
    """A float32 after one float16 starts at byte 2: no float32 view can, so it is copied."""
    half, single = torch.tensor([1.5], dtype=torch.float16), torch.tensor([[2.25, -7.0]])
    path = tmp_path / "odd.safetensors"
    body = _raw_file(path, [("h", "F16", [1], half.numpy().tobytes()), ("f", "F32", [1, 2], single.numpy().tobytes())])
    read, _ = read_safetensors(path, "odd", 2**30)
    reference = safetensors_load(body)
    assert torch.equal(read["h"], reference["h"]) and torch.equal(read["f"], reference["f"])
    assert torch.equal(read["f"], single)


@pytest.mark.parametrize("offsets, message", [
    ([(0, 8), (4, 12)], "overlaps another"),
    ([(0, 8), (10, 18)], "leaves a gap"),
])
def test_overlaps_and_gaps_are_refused_as_safetensors_refuses_them(tmp_path, offsets, message):
    data = torch.arange(2, dtype=torch.float32).numpy().tobytes()
    path = tmp_path / "bad.safetensors"
    body = _raw_file(path, [("a", "F32", [2], data), ("b", "F32", [2], data)], offsets)
    body += b"\0" * (max(end for _, end in offsets) - 16)  # the file long enough for the offsets
    path.write_bytes(body)
    with pytest.raises(AdapterInvalid, match=message):
        read_safetensors(path, "bad", 2**30)
    with pytest.raises(Exception):  # the format's own reader refuses the same file
        safetensors_load(body)


def test_bytes_after_the_last_tensor_are_refused(tmp_path):
    path = tmp_path / "tail.safetensors"
    body = _raw_file(path, [("a", "F32", [1], b"\0\0\0\0")]) + b"junk"
    path.write_bytes(body)
    with pytest.raises(AdapterInvalid, match="4 bytes after its last tensor"):
        read_safetensors(path, "tail", 2**30)
    with pytest.raises(Exception):
        safetensors_load(body)


def test_host_buffers_go_back_to_the_system_when_dropped():
    """Big buffers are private mappings of their own: each is unmapped with its last tensor,
    so reading adapter after adapter does not grow the process."""
    def rss_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20

    before = rss_mib()
    for _ in range(24):
        buffer = host_bytes(64 * 2**20)
        buffer.fill_(1)  # every page written, as a read writes it
        view = buffer[2**20:].view(torch.float32)  # a view keeps the mapping; dropping both frees it
        assert view.sum().item() > 0
        del buffer, view
    assert rss_mib() - before < 160, "24 x 64 MiB buffers were not freed"


def test_a_large_file_read_and_packed_in_pieces_is_the_same(tmp_path, monkeypatch):
    """Large adapters are read and packed on several threads: the same bytes as one thread,
    alignment padding zeroed alike."""
    from loraswap.adapters.bound import BoundAdapter
    from loraswap.adapters.files import host_memory
    from loraswap.adapters.kinds import LORA, Layer

    generator = torch.Generator().manual_seed(1)
    tensors = {f"m{i}.lora_{part}.weight": torch.randn(*shape, generator=generator).to(torch.bfloat16)
               for i in range(7) for part, shape in (("down", (5, 3001)), ("up", (3001, 5)))}
    path = tmp_path / "big.safetensors"
    save_file(tensors, str(path))

    def read_and_pack():
        read, _ = read_safetensors(path, "big", 2**30)
        layers = {("transformer", f"m{i}.weight"): Layer(LORA, {"down": read[f"m{i}.lora_down.weight"],
                                                                "up": read[f"m{i}.lora_up.weight"]}, 1.0)
                  for i in range(7)}
        return read, BoundAdapter("big", layers).to("cpu", torch.float16).packed

    one_read, one_packed = read_and_pack()
    monkeypatch.setattr(host_memory, "PARALLEL_FROM", 0)
    monkeypatch.setattr(host_memory, "COPY_THREADS", 3)
    monkeypatch.setattr(host_memory, "HUGE_PAGE", 4096)  # pieces of the small file's size
    pieces_read, pieces_packed = read_and_pack()
    for name, tensor in safetensors_load(path.read_bytes()).items():
        assert torch.equal(pieces_read[name], tensor) and torch.equal(one_read[name], tensor), name
    assert torch.equal(pieces_packed.view(torch.int16), one_packed.view(torch.int16))


READ_IN_PLACE_CASES = [  # preset, layout, kind, file dtype, model dtype
    ("tiny-sd", "kohya", "lora", torch.float16, torch.float16),  # text encoder and convolutions too
    ("tiny-flux", "kohya", "lora", torch.bfloat16, torch.bfloat16),  # fused qkv cut into rows
    ("tiny-flux", "diffusers", "lora", torch.float16, torch.float32),  # converted as it is read
    ("tiny-sd", "kohya", "loha", torch.float16, torch.float16),
    ("tiny-flux", "kohya", "lokr", torch.float16, torch.float16),  # rows of a Kronecker product: read whole
    ("tiny-sd", "kohya", "dora", torch.float32, torch.float16),
]


@pytest.mark.parametrize("preset, layout, kind, file_dtype, model_dtype", READ_IN_PLACE_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in READ_IN_PLACE_CASES])
def test_read_in_place_binds_what_reading_whole_binds(tmp_path, monkeypatch, caplog, preset, layout, kind, file_dtype,
                                                      model_dtype):
    """An adapter read in place (each factor from the file straight into the packed buffer)
    is bitwise the adapter read whole and then packed; where the parse computes a factor
    (LoKr rows) it falls back to reading whole, with the same result."""
    from loraswap.adapters.bound import ModelLayers, bind_adapter
    from loraswap.adapters.files import data as file_data
    from loraswap.adapters.files.location import AdapterLocation
    from loraswap.adapters.parse.changes import parse_adapter_file
    from loraswap.adapters.random import make_random_adapter
    from loraswap.adapters.store import TargetModel, read_adapter
    from loraswap.models import lora_components

    cls, components = lora_components(preset)
    state_dict, metadata = make_random_adapter(components, 4, "all", layout, text_encoder=preset == "tiny-sd",
                                               dtype=file_dtype, kind=kind)
    path = tmp_path / "a.safetensors"
    save_file(state_dict, str(path), metadata=metadata)
    location, layers = AdapterLocation("a", path, None), ModelLayers(components)
    whole = bind_adapter(parse_adapter_file(location, cls, layers.component_modules, 2**30), layers, dtype=model_dtype)

    monkeypatch.setattr(file_data, "LARGE", 64)  # the tiny model's factors stand in, as a real model's do
    caplog.set_level("DEBUG", logger="loraswap.adapters.store")
    in_place = read_adapter(location, TargetModel(preset, cls, layers, model_dtype, None))
    read_whole = any("read whole" in record.message for record in caplog.records)
    assert read_whole == (kind == "lokr"), "read in place, but for a factor the parse computes"
    assert in_place.layers.keys() == whole.layers.keys()
    assert in_place.packed.dtype == whole.packed.dtype == model_dtype
    assert torch.equal(in_place.packed.view(torch.uint8), whole.packed.view(torch.uint8))
    for key, layer in whole.layers.items():
        assert in_place.layers[key].scale == layer.scale and in_place.layers[key].kind is layer.kind, key


@pytest.mark.parametrize("preset, layout, kind, file_dtype, model_dtype", READ_IN_PLACE_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in READ_IN_PLACE_CASES])
@pytest.mark.parametrize("large", [64, 600], ids=["all-from-file", "some-read-at-parse"])
def test_factors_cut_out_of_the_file_on_the_device_pack_as_on_the_host(tmp_path, monkeypatch, preset, layout, kind,
                                                                       file_dtype, model_dtype, large):
    """The GPU's cold read (the file's bytes to the device, each factor cut out of them there,
    converted, the small ones the parse read copied up at once) packs the very bytes the
    host's packing does, padding included; a factor the parse computed from stand-ins raises
    `NotInFile` (the store then reads the file whole). Run here with the CPU as the device."""
    from loraswap.adapters.bound import BoundAdapter, ModelLayers, fitted_layers, pack_on_device, packed_spans
    from loraswap.adapters.files import data as file_data
    from loraswap.adapters.files.data import NotInFile
    from loraswap.adapters.files.location import AdapterLocation
    from loraswap.adapters.parse.changes import parse_adapter_file
    from loraswap.adapters.random import make_random_adapter
    from loraswap.models import lora_components

    cls, components = lora_components(preset)
    state_dict, metadata = make_random_adapter(components, 4, "all", layout, text_encoder=preset == "tiny-sd",
                                               dtype=file_dtype, kind=kind)
    path = tmp_path / "a.safetensors"
    save_file(state_dict, str(path), metadata=metadata)
    monkeypatch.setattr(file_data, "LARGE", large)
    layers = ModelLayers(components)
    parsed = parse_adapter_file(AdapterLocation("a", path, None), cls, layers.component_modules, 2**30, in_place=True)
    try:
        bound = BoundAdapter("a", fitted_layers(parsed, layers))
        factors = [t for layer in bound.layers.values() for t in layer.factors.values()]
        on_the_device = functools.partial(pack_on_device, list(bound.layers.values()),
                                          packed_spans(bound.layers.values()), model_dtype, torch.device("cpu"),
                                          parsed.files)
        if kind == "lokr" and large == 64:  # rows of a product of two stand-ins
            with pytest.raises(NotInFile):
                on_the_device()
            return
        read_at_parse = sum(not t.is_meta for t in factors)
        assert read_at_parse > 0 if large == 600 else read_at_parse == 0
        assert read_at_parse < len(factors) or kind == "lokr"  # (a LoKr's small factors are all computed)
        on_device = on_the_device()
        on_host = bound.to("cpu", model_dtype, files=parsed.files).packed
    finally:
        for file in parsed.files:
            file.close()
    assert on_device.dtype == on_host.dtype == model_dtype
    assert torch.equal(on_device.view(torch.uint8), on_host.view(torch.uint8))


def test_a_read_that_fails_on_the_device_says_so_and_refusals_stay_refusals(tmp_path, monkeypatch):
    """Out of GPU memory (say) while packing on the device is `DeviceReadFailed`, which the
    store reads again on the host; the parse's `NotInFile` and an adapter's own refusal
    (a file cut short) pass through unchanged, each handled where it was before."""
    from loraswap.adapters import bound as bound_module
    from loraswap.adapters.files.data import NotInFile
    from loraswap.adapters.files.device_read import DeviceReadFailed

    layers, spans = [], [([0], 4)]
    cut_short = AdapterInvalid("a", "the file ended while it was read", "Download it again")
    for error, expected in [(torch.OutOfMemoryError("CUDA out of memory"), DeviceReadFailed),
                            (NotInFile("computed"), NotInFile), (cut_short, AdapterInvalid)]:
        def fail(*args, error=error):
            raise error

        monkeypatch.setattr(bound_module, "pack_from_files", fail)
        with pytest.raises(expected) as raised:
            bound_module.pack_on_device(layers, spans, torch.float32, torch.device("cpu"), ())
        assert expected is not DeviceReadFailed or "OutOfMemoryError: CUDA out of memory" in str(raised.value)


def test_reads_in_place_leave_no_file_open(tmp_path, monkeypatch):
    """Served or refused (after the file was opened and parsed), every read closes its file."""
    import os

    from loraswap.adapters.bound import ModelLayers
    from loraswap.adapters.files import data as file_data
    from loraswap.adapters.files.location import AdapterLocation
    from loraswap.adapters.random import make_random_adapter
    from loraswap.adapters.store import StoreLimits, TargetModel, read_adapter
    from loraswap.models import lora_components

    monkeypatch.setattr(file_data, "LARGE", 64)
    cls, components = lora_components("tiny-sd")
    state_dict, metadata = make_random_adapter(components, 4, "all", "kohya", base_model="tiny-sd")
    path = tmp_path / "a.safetensors"
    save_file(state_dict, str(path), metadata=metadata)
    target = TargetModel("tiny-sd", cls, ModelLayers(components), torch.float16, None)
    other = TargetModel("tiny-sdxl", cls, ModelLayers(components), torch.float16, None)
    card_folder = tmp_path / "carded"
    card_folder.mkdir()
    save_file(state_dict, str(card_folder / "pytorch_lora_weights.safetensors"), metadata=metadata)
    (card_folder / "README.md").write_text("---\nbase_model: [unclosed\n---\n")  # a model card YAML cannot read
    carded = AdapterLocation("carded", card_folder / "pytorch_lora_weights.safetensors", card_folder)
    open_before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        read_adapter(AdapterLocation("a", path, None), target)
        with pytest.raises(Exception):  # noqa: B017  (whatever the card's error, the file is closed)
            read_adapter(carded, target)
        with pytest.raises(AdapterIncompatible):  # made for tiny-sd: refused on another model
            read_adapter(AdapterLocation("a", path, None), other)
        with pytest.raises(AdapterInvalid, match="rank 4, over the limit"):
            read_adapter(AdapterLocation("a", path, None), target, StoreLimits(max_rank=2))
    # no more than before (a leak adds one per read, 40 here); files others opened may have closed meanwhile
    assert len(os.listdir("/proc/self/fd")) <= open_before


def test_whether_an_adapter_fits_is_told_from_its_header(tmp_path, monkeypatch):
    """Routing asks whether a file fits a model: keys, base model, shapes and ranks refuse as
    a read refuses them, and not a factor's bytes is read (a NaN is found when it is read)."""
    from loraswap.adapters.bound import ModelLayers
    from loraswap.adapters.files import data as file_data
    from loraswap.adapters.files.location import AdapterLocation
    from loraswap.adapters.random import make_random_adapter
    from loraswap.adapters.store import StoreLimits, TargetModel, check_fit, read_adapter
    from loraswap.models import lora_components

    monkeypatch.setattr(file_data, "LARGE", 64)
    reads = []
    read_into = file_data.FileData.read_into
    monkeypatch.setattr(file_data.FileData, "read_into", lambda self, *a: reads.append(1) or read_into(self, *a))
    cls, components = lora_components("tiny-sd")
    state_dict, metadata = make_random_adapter(components, 4, "all", "kohya")
    state_dict[next(k for k in state_dict if k.endswith("lora_up.weight"))][0, 0] = float("nan")
    path = tmp_path / "nan.safetensors"
    save_file(state_dict, str(path), metadata=metadata)
    location = AdapterLocation("nan", path, None)
    target = TargetModel("tiny-sd", cls, ModelLayers(components), torch.float16, None)
    check_fit(location, target)
    with pytest.raises(AdapterInvalid, match="over the limit of 2"):
        check_fit(location, target, StoreLimits(max_rank=2))
    sdxl_cls, sdxl = lora_components("tiny-sdxl")
    with pytest.raises(AdapterIncompatible):
        check_fit(location, TargetModel("tiny-sdxl", sdxl_cls, ModelLayers(sdxl), torch.float16, None))
    assert reads == [], "no factor was read"
    with pytest.raises(AdapterInvalid, match="NaN or infinite"):
        read_adapter(location, target)

