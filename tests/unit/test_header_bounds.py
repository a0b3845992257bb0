"""A safetensors header is bounded before it is parsed (formats.HeaderBounds, for the largest
file served): a header of 95 or 20 MiB of empty tensor entries is refused from its 8-byte
length, one crowded with entries inside the byte bound before its JSON is parsed, a download's
while it streams; every real key layout, and every linear layer of FLUX.1 with both text
encoders as LoHa with DoRA, pass with room to spare. Run with -s for the figures."""

import io
import json
import math
from pathlib import Path

import pytest
from support.headers import Cost, crowded_safetensors

from loraswap.adapters.files.formats import (
    HeaderBounds,
    check_header_length,
    open_checked,
    parse_header,
    streamed_header,
)
from loraswap.adapters.reference import as_refs
from loraswap.errors import AdapterInvalid

MIB = 2**20
DEFAULT_MAX = 2048 * MIB  # --max-adapter-mb's default
LAYOUTS = sorted((Path(__file__).parents[1] / "fixtures" / "key_layouts").glob("*.json"))
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4}


@pytest.mark.parametrize("max_mib,header_mib,entries", [
    (1, 4, 16_384), (64, 4, 32_768), (1024, 8, 32_768), (2048, 16, 32_768), (8192, 32, 32_768), (2**20, 32, 32_768)])
def test_the_bounds_grow_with_the_largest_file_and_stay_far_below_it(max_mib, header_mib, entries):
    bounds = HeaderBounds.for_files_up_to(max_mib * MIB)
    assert (bounds.bytes, bounds.entries) == (header_mib * MIB, entries)


def _file(tensors: dict[str, tuple[list[int], str]], metadata: dict[str, str]) -> tuple[bytes, int]:
    """The JSON header a trainer writes for these tensors (name -> (shape, dtype)), and the size
    of the data it describes."""
    header, offset = {"__metadata__": metadata}, 0
    for name, (shape, dtype) in tensors.items():
        size = math.prod(shape) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    return json.dumps(header, separators=(",", ":")).encode(), offset


def _kohya_metadata(tags: int) -> dict[str, str]:
    """What kohya's sd-scripts writes beside the weights, with the tag counts of a large dataset."""
    frequency = {"10_subject": {f"tag number {i}, with words": i % 97 + 1 for i in range(tags)}}
    dirs = {"10_subject": {"n_repeats": 10, "img_count": 900}}
    return {"ss_network_module": "networks.lora_flux", "ss_network_dim": "16", "ss_network_alpha": "16",
            "ss_tag_frequency": json.dumps(frequency), "ss_dataset_dirs": json.dumps(dirs)}


@pytest.mark.parametrize("layout", LAYOUTS, ids=[p.stem for p in LAYOUTS])
def test_every_real_key_layout_passes_on_a_server_whose_limit_is_its_own_size(layout):
    """The tightest limit a server could have for the file: its own size at rank 16, with the
    tag counts of a 5,000-tag dataset in its metadata."""
    tensors = {name: ([16 if dim is None else dim for dim in shape], dtype)
               for name, (shape, dtype) in json.loads(layout.read_text())["tensors"].items()}
    header, data = _file(tensors, _kohya_metadata(5000))
    size = 8 + len(header) + data
    check_header_length(len(header), layout.stem, size)
    assert len(parse_header(header, layout.stem, size)) == len(tensors) + 1


def _all_linear_flux_loha_dora() -> dict[str, tuple[list[int], str]]:
    """Every linear layer of FLUX.1 (diffusers names), CLIP-L and T5-XXL as kohya names them, each
    as LoHa with DoRA (6 tensors a module): the most tensors a FLUX.1 adapter is known to carry."""
    double = [("attn_to_q", 3072, 3072), ("attn_to_k", 3072, 3072), ("attn_to_v", 3072, 3072),
              ("attn_to_out_0", 3072, 3072), ("attn_add_q_proj", 3072, 3072), ("attn_add_k_proj", 3072, 3072),
              ("attn_add_v_proj", 3072, 3072), ("attn_to_add_out", 3072, 3072), ("ff_net_0_proj", 3072, 12288),
              ("ff_net_2", 12288, 3072), ("ff_context_net_0_proj", 3072, 12288), ("ff_context_net_2", 12288, 3072),
              ("norm1_linear", 3072, 18432), ("norm1_context_linear", 3072, 18432)]
    single = [("attn_to_q", 3072, 3072), ("attn_to_k", 3072, 3072), ("attn_to_v", 3072, 3072),
              ("proj_mlp", 3072, 12288), ("proj_out", 15360, 3072), ("norm_linear", 3072, 9216)]
    clip = [(f"self_attn_{p}_proj", 768, 768) for p in "qkv"] + [("self_attn_out_proj", 768, 768),
                                                                  ("mlp_fc1", 768, 3072), ("mlp_fc2", 3072, 768)]
    t5 = [(f"layer_0_SelfAttention_{p}", 4096, 4096) for p in "qkvo"] + [
        ("layer_1_DenseReluDense_wi_0", 4096, 10240), ("layer_1_DenseReluDense_wi_1", 4096, 10240),
        ("layer_1_DenseReluDense_wo", 10240, 4096)]
    modules = [(f"lora_unet_transformer_blocks_{b}_{n}", i, o) for b in range(19) for n, i, o in double]
    modules += [(f"lora_unet_single_transformer_blocks_{b}_{n}", i, o) for b in range(38) for n, i, o in single]
    modules += [(f"lora_te1_text_model_encoder_layers_{b}_{n}", i, o) for b in range(12) for n, i, o in clip]
    modules += [(f"lora_te2_encoder_block_{b}_{n}", i, o) for b in range(24) for n, i, o in t5]
    rank = 16
    tensors = {}
    for name, fan_in, fan_out in modules:
        tensors.update({f"{name}.hada_w1_a": ([fan_out, rank], "BF16"), f"{name}.hada_w1_b": ([rank, fan_in], "BF16"),
                        f"{name}.hada_w2_a": ([fan_out, rank], "BF16"), f"{name}.hada_w2_b": ([rank, fan_in], "BF16"),
                        f"{name}.alpha": ([], "BF16"), f"{name}.dora_scale": ([1, fan_in], "BF16")})
    return tensors


def test_every_linear_layer_of_flux_with_both_text_encoders_passes_with_room():
    tensors = _all_linear_flux_loha_dora()
    header, data = _file(tensors, _kohya_metadata(5000))
    bounds = HeaderBounds.for_files_up_to(8 + len(header) + data)
    with Cost() as cost:
        parsed = parse_header(header, "flux-all", 8 + len(header) + data)
    print(f"\nall-linear FLUX.1 + CLIP-L + T5, LoHa + DoRA: {len(tensors):,} tensors, header "
          f"{len(header) / MIB:.2f} MiB, {(8 + len(header) + data) / MIB:.0f} MiB file; parsed in {cost}; bounds "
          f"{bounds.bytes / MIB:.0f} MiB, {bounds.entries:,} entries")
    assert len(parsed) == len(tensors) + 1 and len(tensors) > 4000
    assert bounds.entries >= 5 * len(tensors) and bounds.bytes >= 4 * len(header)


@pytest.mark.parametrize("entries,refused", [(22_000, False), (32_768, False), (32_769, True)])
def test_the_entry_cap_counts_tensors_exactly(tmp_path, entries, refused):
    """Real-looking entries (under the pre-count's allowance): read up to the cap, refused past it."""
    header = json.dumps({f"lora_unet_blocks_{i}.lora_down.weight": {"dtype": "F16", "shape": [0],
                                                                      "data_offsets": [0, 0]}
                         for i in range(entries)}).encode()
    path = tmp_path / "many.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with Cost() as cost:
        try:
            open_checked(path, "many", DEFAULT_MAX).close()
            error = None
        except AdapterInvalid as e:
            error = e
    print(f"\n{entries:,} entries ({len(header) / MIB:.1f} MiB): {'refused' if error else 'read'} in {cost}")
    if refused:
        assert error is not None and "its safetensors header lists 32,769 tensors, over the 32,768" in error.message
    else:
        assert error is None
    assert cost.seconds < 10 and cost.peak_growth < 80 * MIB, "the most a header may cost (about 0.5 s idle)"


@pytest.mark.parametrize("header_mib", [95, 20])
def test_a_header_of_tens_of_mib_is_refused_from_its_length_alone(tmp_path, header_mib):
    path = tmp_path / "crowded.safetensors"
    path.write_bytes(crowded_safetensors(header_mib * MIB))
    with Cost() as cost, pytest.raises(AdapterInvalid) as caught:
        open_checked(path, "crowded", DEFAULT_MAX)
    print(f"\n{header_mib} MiB header from the folder: refused in {cost}")
    assert caught.value.status == 400
    assert f"its safetensors header is {header_mib}.0 MiB, over the 16 MiB read for files of up to 2048 MiB" \
        in caught.value.message
    assert cost.seconds < 1 and cost.peak_growth < 50 * MIB


def test_the_load_and_fuse_baseline_checks_the_header_before_diffusers_reads_the_file(tmp_path):
    """The baselines hand the file to diffusers (safetensors' own reader: 95 MiB of entries cost it
    seconds and a GiB): the file is checked first, as the fused path reads it."""
    from loraswap.engine.config.engine import EngineConfig
    from loraswap.engine.engine import Engine

    (tmp_path / "crowded.safetensors").write_bytes(crowded_safetensors(95 * MIB))
    engine = Engine(EngineConfig(model="tiny-sd", adapters=tmp_path, swap_mode="load-and-fuse", compile=False,
                                 warmup=False))
    with Cost() as cost, pytest.raises(AdapterInvalid, match="header is 95.0 MiB, over the 16 MiB"):
        engine.lender.lease(as_refs([("crowded", 1.0)])).result(timeout=60)
    assert cost.seconds < 1 and cost.peak_growth < 50 * MIB, str(cost)


def test_a_header_crowded_within_its_byte_bound_is_refused_before_its_json_is_parsed(tmp_path, monkeypatch):
    path = tmp_path / "crowded.safetensors"
    path.write_bytes(crowded_safetensors(8 * MIB))  # about 136,000 empty entries
    def parsed(decoder, text, *args, **kwargs):
        pytest.fail("the header's JSON was parsed")
    monkeypatch.setattr(json.JSONDecoder, "decode", parsed)
    with Cost() as cost, pytest.raises(AdapterInvalid, match="holds more JSON than 32,768 tensor entries would"):
        open_checked(path, "crowded", DEFAULT_MAX)
    print(f"\n8 MiB header of empty entries: refused unparsed in {cost}")
    assert cost.seconds < 1 and cost.peak_growth < 50 * MIB


class _Stream:
    """A download's body: `read(n)` as the fetchers call it, counting what was read."""

    def __init__(self, data: bytes):
        self.body, self.taken = io.BytesIO(data), 0

    def read(self, n: int) -> bytes:
        out = self.body.read(n)
        self.taken += len(out)
        return out


def test_a_download_is_held_to_the_same_bounds_while_it_streams():
    huge = _Stream(crowded_safetensors(95 * MIB) + bytes(64))
    with pytest.raises(AdapterInvalid, match="header is 95.0 MiB, over the 16 MiB"):
        streamed_header(huge.read, DEFAULT_MAX, "https://h/x.safetensors", DEFAULT_MAX)
    assert huge.taken == 9, "the length and the header's first byte"
    crowded = _Stream(crowded_safetensors(8 * MIB))
    with pytest.raises(AdapterInvalid, match="holds more JSON than 32,768"):
        streamed_header(crowded.read, DEFAULT_MAX, "https://h/x.safetensors", DEFAULT_MAX)
    small_limit = 64 * MIB  # a server's --max-adapter-mb: a header past the file it could be is no header
    assert streamed_header(_Stream(crowded_safetensors(95 * MIB)).read, small_limit, "x", small_limit) is None
    not_json = (5).to_bytes(8, "little") + b"{oops"
    assert streamed_header(_Stream(not_json).read, DEFAULT_MAX, "x", DEFAULT_MAX) is None
    valid = (2).to_bytes(8, "little") + b"{}"
    assert streamed_header(_Stream(valid).read, DEFAULT_MAX, "x", DEFAULT_MAX) == valid
