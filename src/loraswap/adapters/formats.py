"""Reading adapter files: safe safetensors parsing and format conversion.

A file is read only after its header has been checked (length, JSON, dtypes, data
offsets inside the file), so a pickle renamed `.safetensors`, a truncated download or
a header claiming gigabytes is refused before anything is allocated.

Key layouts are converted with diffusers' own converters, in the same two stages as
`load_lora_weights`: `<Pipeline>.lora_state_dict` (kohya/A1111, XLabs, ... ->
diffusers naming, plus `network_alphas`), then `convert_unet_state_dict_to_peft`
for the denoiser and `convert_state_dict_to_diffusers` + `convert_state_dict_to_peft`
for text encoders. The result is one `LoraLayer` (down, up, scale) per target module.
"""

import inspect
import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from stat import S_ISREG

import torch
from diffusers import DiffusionPipeline
from diffusers.utils.state_dict_utils import (
    convert_state_dict_to_diffusers,
    convert_state_dict_to_peft,
    convert_unet_state_dict_to_peft,
)
from peft.utils.other import get_pattern_key
from safetensors.torch import load_file

from ..errors import AdapterInvalid
from .metadata import declared_base_models

LORA_ADAPTER_METADATA_KEY = "lora_adapter_metadata"  # what diffusers' save_lora_weights writes
ALLOWED_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
MAX_HEADER_BYTES = 100 * 2**20
_DTYPE_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_FIX_FILE = "Re-export it as a LoRA in safetensors format (diffusers save_lora_weights or kohya sd-scripts)"


@dataclass(frozen=True)
class LoraLayer:
    """One target module's factors: delta W = scale * up @ down (conv: reshaped)."""

    down: torch.Tensor  # A: [rank, in_features] or [rank, in_channels, kh, kw]
    up: torch.Tensor  # B: [out_features, rank] or [out_channels, rank, 1, 1]
    scale: float  # alpha / rank (alpha / sqrt(rank) for rsLoRA)

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def nbytes(self) -> int:
        return self.down.nbytes + self.up.nbytes


@dataclass
class ParsedAdapter:
    """An adapter file converted to per-module factors, not yet bound to a model."""

    adapter_id: str
    format: str  # "diffusers", "kohya" or "other" (what the file was before conversion)
    layers: dict[str, dict[str, LoraLayer]]  # component ("unet", "text_encoder", ...) -> module -> layer
    metadata: dict[str, str] = field(default_factory=dict)
    base_models: list[str] = field(default_factory=list)  # declared by the file, card or config

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for modules in self.layers.values() for layer in modules.values())

    @property
    def ranks(self) -> list[int]:
        return sorted({layer.rank for modules in self.layers.values() for layer in modules.values()})

    @property
    def num_layers(self) -> int:
        return sum(len(modules) for modules in self.layers.values())


def read_safetensors(path: Path, adapter_id: str, max_bytes: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a safetensors file, after checking its header is sane."""
    stat = path.stat()
    if not S_ISREG(stat.st_mode):  # a FIFO or device would block or never end
        raise AdapterInvalid(adapter_id, "it is not a regular file", _FIX_FILE)
    size = stat.st_size
    if size > max_bytes:
        raise AdapterInvalid(adapter_id, f"the file is {size / 2**20:.1f} MiB, over the {max_bytes / 2**20:.0f} MiB "
                             "limit", "Use a smaller adapter or raise --max-adapter-mb")
    header, header_len = _read_header(path, adapter_id, size)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise AdapterInvalid(adapter_id, "the safetensors metadata is not a map of strings to strings", _FIX_FILE)
    _check_entries(adapter_id, header, size - 8 - header_len)
    try:  # pread, not the default mmap: safetensors 0.8.0's mmap path leaks a little per load (RELIABILITY.md)
        tensors = load_file(str(path), backend="pread")
    except Exception as e:  # safetensors' own checks (overlaps, ...)
        raise AdapterInvalid(adapter_id, f"safetensors refused the file ({e})", _FIX_FILE) from None
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def _read_header(path: Path, adapter_id: str, size: int) -> tuple[dict, int]:
    """The JSON header (a dict) and its length, refusing anything that is not safetensors."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise AdapterInvalid(adapter_id, "the file is too short to be safetensors", _FIX_FILE)
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise AdapterInvalid(adapter_id, f"the header claims {header_len} bytes in a {size}-byte file: not "
                                 "safetensors (a pickle file renamed?) or truncated", _FIX_FILE)
        try:
            header = _HEADER_JSON.decode(f.read(header_len).decode("utf-8"))
        except _DuplicateKey as e:
            raise AdapterInvalid(adapter_id, f"the safetensors header names '{e.key}' twice", _FIX_FILE) from None
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise AdapterInvalid(adapter_id, "the safetensors header is not valid JSON", _FIX_FILE) from None
    if not isinstance(header, dict):
        raise AdapterInvalid(adapter_id, "the safetensors header is not a JSON object", _FIX_FILE)
    return header, header_len


def _check_entries(adapter_id: str, header: dict, data_len: int) -> None:
    """Every tensor entry well formed, of a float dtype, and inside the file's data."""
    for name, info in header.items():
        if not _well_formed(info):
            raise AdapterInvalid(adapter_id, f"tensor '{name}' has a malformed header entry (dtype, shape and "
                                 "data_offsets must be a string, a list of sizes and two offsets)", _FIX_FILE)
        if info["dtype"] not in ALLOWED_DTYPES:
            raise AdapterInvalid(adapter_id, f"tensor '{name}' has dtype {info['dtype']}; LoRA weights must be "
                                 "F16, BF16 or F32", "Convert the adapter to a floating-point dtype")
        start, end = info["data_offsets"]
        expected = math.prod(info["shape"]) * _DTYPE_BYTES.get(info["dtype"], 0)
        if not 0 <= start <= end <= data_len or end - start != expected:
            raise AdapterInvalid(adapter_id, f"tensor '{name}' lies outside the file (truncated download?)",
                                 "Download the adapter again")


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _refuse_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """json object hook: a key given twice is refused (parsers disagree on which one wins)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


# one decoder for all reads: json.loads(..., object_pairs_hook=) builds a scanner per call that outlives it
_HEADER_JSON = json.JSONDecoder(object_pairs_hook=_refuse_duplicates)


def _well_formed(info) -> bool:
    def sizes(value, n=None):
        return isinstance(value, list) and (n is None or len(value) == n) and all(
            type(v) is int and v >= 0 for v in value)

    return isinstance(info, dict) and {"dtype", "shape", "data_offsets"} <= info.keys() and \
        isinstance(info["dtype"], str) and sizes(info["shape"]) and sizes(info["data_offsets"], 2)


def detect_format(state_dict: dict[str, torch.Tensor]) -> str:
    keys = list(state_dict)
    if keys and all(k.startswith(("lora_unet_", "lora_te_", "lora_te1_", "lora_te2_", "lora_transformer_"))
                    for k in keys):
        return "kohya"
    if keys and all(".lora_A." in k or ".lora_B." in k for k in keys):
        return "diffusers"
    return "other"


def parse_adapter(
    adapter_id: str,
    state_dict: dict[str, torch.Tensor],
    metadata: dict[str, str],
    pipeline_cls: type[DiffusionPipeline],
    component_modules: dict[str, set[str]],
    unet_config=None,
) -> ParsedAdapter:
    """Convert a LoRA state dict to per-module factors for the pipeline class.

    `component_modules` maps each LoRA-loadable component to its module names; it is
    used to strip a `text_model.` prefix the way diffusers does and to resolve alpha
    keys. `unet_config` lets diffusers renumber SDXL kohya keys written in SGM block
    numbering (`input_blocks_4_1_...`). Shapes are checked later, when the adapter is
    bound to a model.
    """
    fmt = detect_format(state_dict)
    _refuse_unsupported_kinds(adapter_id, state_dict)
    converted, network_alphas = _lora_state_dict(adapter_id, pipeline_cls, state_dict, unet_config)
    lora_metadata = json.loads(metadata[LORA_ADAPTER_METADATA_KEY]) if LORA_ADAPTER_METADATA_KEY in metadata else {}

    layers: dict[str, dict[str, LoraLayer]] = {}
    claimed: set[str] = set()
    for component, module_names in component_modules.items():
        prefix = component + "."
        keys = [k for k in converted if k.startswith(prefix)]
        if not keys:
            continue
        claimed.update(keys)
        sub = {k.removeprefix(prefix): converted[k] for k in keys}
        convert = _converter(component, module_names)
        try:
            renamed = _rename_map(convert, sub)
        except Exception as e:
            raise AdapterInvalid(adapter_id, f"its {component} keys could not be converted ({e})", _FIX_FILE) from None
        _refuse_collisions(adapter_id, component, convert, sub, renamed)
        alphas = _module_alphas(network_alphas, prefix, renamed)
        sub = {renamed[k]: v for k, v in sub.items()}
        config = {k.removeprefix(prefix): v for k, v in lora_metadata.items() if k.startswith(prefix)}
        layers[component] = _pair_factors(adapter_id, component, sub, alphas, config)
    leftovers = sorted(set(converted) - claimed)
    if leftovers:
        raise AdapterInvalid(adapter_id, f"{len(leftovers)} keys belong to no component of "
                             f"{pipeline_cls.__name__} (first: {leftovers[0]})",
                             f"Use an adapter made for {pipeline_cls.__name__} models")
    if not any(layers.values()):
        raise AdapterInvalid(adapter_id, "it contains no LoRA layer for this pipeline",
                             f"Use an adapter made for {pipeline_cls.__name__} models")
    return ParsedAdapter(adapter_id, fmt, layers, metadata)


def _refuse_unsupported_kinds(adapter_id: str, state_dict: dict[str, torch.Tensor]) -> None:
    for marker, kind in (("dora_scale", "DoRA"), ("lora_magnitude_vector", "DoRA"), (".lokr_", "LoKr"),
                         (".hada_", "LoHa"), ("lora_B.bias", "LoRA with bias")):
        if any(marker in k for k in state_dict):
            raise AdapterInvalid(adapter_id, f"it is a {kind} adapter, which loraswap does not fuse",
                                 "Use a plain LoRA (A/B or down/up weights only)")


def _lora_state_dict(adapter_id, pipeline_cls, state_dict, unet_config):
    """Stage one: diffusers' `lora_state_dict` to diffusers naming and network alphas."""
    kwargs = {"return_alphas": True} if "return_alphas" in inspect.signature(pipeline_cls.lora_state_dict).parameters \
        else {}
    if unet_config is not None:
        kwargs["unet_config"] = unet_config
    try:
        out = pipeline_cls.lora_state_dict(dict(state_dict), **kwargs)
    except Exception as e:
        raise AdapterInvalid(adapter_id, f"diffusers could not read its keys as a {pipeline_cls.__name__} LoRA ({e})",
                             f"Use a diffusers, PEFT or kohya LoRA made for {pipeline_cls.__name__} models") from None
    converted, alphas = (out, None) if isinstance(out, dict) else (out[0], out[1])
    return converted, alphas or {}


def _converter(component: str, module_names: set[str]):
    """Stage two: component-relative keys -> PEFT keys (`<module>.lora_A.weight`)."""
    if not component.startswith("text_encoder"):
        return lambda sd: sd if any("lora_A" in k for k in sd) else convert_unet_state_dict_to_peft(sd)
    flattened = not any(name.startswith("text_model.") for name in module_names)

    def convert_text_encoder(sd):
        sd = convert_state_dict_to_peft(convert_state_dict_to_diffusers(sd))
        # transformers 5 flattens CLIPTextModel; files still say `text_model.`
        return {k.removeprefix("text_model."): v for k, v in sd.items()} if flattened else sd

    return convert_text_encoder


def _rename_map(convert, sub: dict[str, torch.Tensor]) -> dict[str, str]:
    """old key -> new key under `convert`, which renames keys but infers the layout from
    all of them: convert index tags instead of tensors and read back where each went."""
    keys = list(sub)
    converted = convert({k: torch.tensor(i) for i, k in enumerate(keys)})
    return {keys[int(tag)]: new for new, tag in converted.items()}


def _refuse_collisions(adapter_id, component, convert, sub, renamed) -> None:
    """Two keys naming the same weight (`text_model.` and flattened names, say): refused,
    rather than one silently winning. Converted in reverse order, the other key wins: that
    names the pair."""
    lost = [key for key in sub if key not in renamed]
    if not lost:
        return
    try:
        reverse = _rename_map(convert, dict(reversed(list(sub.items()))))
    except Exception:
        reverse = {}
    key = lost[0]
    other = next((old for old, new in renamed.items() if new == reverse.get(key)), None)
    if other is None:
        raise AdapterInvalid(adapter_id, f"key '{component}.{key}' has no place in the converted adapter",
                             "Remove keys that are not LoRA weights from the file")
    raise AdapterInvalid(adapter_id, f"keys '{component}.{key}' and '{component}.{other}' name the same weight",
                         "Keep one copy of each LoRA weight in the file")


_ALPHA_SUFFIXES = ("", ".lora.down.weight", ".lora_linear_layer.down.weight", ".lora_down.weight")


def _module_alphas(network_alphas, prefix: str, renamed: dict[str, str]) -> dict[str, float]:
    """module -> alpha: each alpha key names a down weight, which the converter renamed."""
    alphas = {}
    for key, value in network_alphas.items():
        if not key.startswith(prefix):
            continue
        base = key.removeprefix(prefix).removesuffix(".alpha")
        for suffix in _ALPHA_SUFFIXES:
            new = renamed.get(base + suffix)
            if new is not None and ".lora_A." in new:
                alphas[new.rsplit(".lora_A.", 1)[0]] = float(value)
                break
    return alphas


def _pair_factors(adapter_id, component, sub, alphas, config) -> dict[str, LoraLayer]:
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in sub.items():
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if key.endswith(suffix):
                modules.setdefault(key.removesuffix(suffix), {})[part] = tensor
                break
        else:
            raise AdapterInvalid(adapter_id, f"unknown key '{component}.{key}' (not a LoRA A/B weight)",
                                 "Remove keys that are not LoRA weights from the file")
    layers = {}
    for module, parts in modules.items():
        if set(parts) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(parts)).pop()
            raise AdapterInvalid(adapter_id, f"layer '{component}.{module}' has no {missing} weight",
                                 "The file is incomplete: export the adapter again")
        down, up = parts["lora_A"], parts["lora_B"]
        rank = down.shape[0] if down.ndim else 0
        if rank == 0 or down.numel() == 0 or up.numel() == 0:
            raise AdapterInvalid(adapter_id, f"layer '{component}.{module}' is empty (rank 0: A {tuple(down.shape)}, "
                                 f"B {tuple(up.shape)})", "Remove empty layers, or export the adapter again")
        layers[module] = LoraLayer(down=down, up=up, scale=_scale(module, rank, alphas, config))
    return layers


def _scale(module: str, rank: int, alphas: dict[str, float], config: dict) -> float:
    """alpha / rank, with alpha from diffusers' adapter metadata, network alphas, or = rank."""
    if config:
        alpha = float(config.get("lora_alpha", config.get("r", rank)))
        pattern = get_pattern_key(list(config.get("alpha_pattern") or {}), module)
        if pattern in (config.get("alpha_pattern") or {}):
            alpha = float(config["alpha_pattern"][pattern])
        if rank and config.get("use_rslora"):
            return alpha / math.sqrt(rank)
    else:
        alpha = alphas.get(module, float(rank))
    return alpha / rank if rank else 0.0


def load_adapter(location, pipeline_cls: type[DiffusionPipeline], component_modules: dict[str, set[str]],
                 max_bytes: int, unet_config=None) -> ParsedAdapter:
    """Read, check and convert the adapter at `location` (an `AdapterLocation`)."""
    tensors, metadata = read_safetensors(location.weights, location.adapter_id, max_bytes)
    parsed = parse_adapter(location.adapter_id, tensors, metadata, pipeline_cls, component_modules, unet_config)
    parsed.base_models = declared_base_models(metadata, location.folder)
    return parsed
