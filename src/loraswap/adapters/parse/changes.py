"""An adapter file's tensors -> one change (`kinds.Layer`) per model parameter.

Every key of the file is claimed or the adapter is refused, naming the key and why:
1. each key is split into its module prefix and a suffix that says its kind and factor
   (`SUFFIXES`); kinds that cannot be fused honestly are refused by name (`UNFUSABLE`);
2. `layout` says which model modules (and which of their rows) each prefix lands on;
3. each prefix's factors become a `Layer` per module, scaled as its trainer scales it.
"""

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from diffusers import DiffusionPipeline

from loraswap.adapters.files.data import FileData, open_in_place
from loraswap.adapters.files.formats import read_safetensors
from loraswap.adapters.files.metadata import declared_base_models
from loraswap.adapters.kinds import KINDS, Layer, delta_shape
from loraswap.adapters.parse.layout import KOHYA_PROBE, PEFT_PROBE, DiffusersProbe, ModuleNames, Place, ProbeKeys
from loraswap.adapters.parse.module_layers import WEIGHT_KINDS, complete, module_layers
from loraswap.errors import AdapterIncompatible, AdapterInvalid

LORA_ADAPTER_METADATA_KEY = "lora_adapter_metadata"  # what diffusers' save_lora_weights writes
_FIX_FILE = "Re-export it as a LoRA in safetensors format (diffusers save_lora_weights or kohya sd-scripts)"

# (file suffix, kind, factor), a suffix before any suffix of it
SUFFIXES = (
    (".lora_linear_layer.down.weight", "lora", "down"), (".lora_linear_layer.up.weight", "lora", "up"),
    ("_lora.down.weight", "lora", "down"), ("_lora.up.weight", "lora", "up"),
    (".lora.down.weight", "lora", "down"), (".lora.up.weight", "lora", "up"),
    (".lora_down.weight", "lora", "down"), (".lora_up.weight", "lora", "up"), (".lora_mid.weight", "lora", "mid"),
    (".lora_A.weight", "lora", "down"), (".lora_B.weight", "lora", "up"), (".lora_B.bias", "bias", "lora_bias"),
    (".lora_A.default.weight", "lora", "down"), (".lora_B.default.weight", "lora", "up"),  # DiffSynth's PEFT
    (".down.weight", "lora", "down"), (".up.weight", "lora", "up"),
    (".hada_w1_a", "loha", "w1a"), (".hada_w1_b", "loha", "w1b"), (".hada_w2_a", "loha", "w2a"),
    (".hada_w2_b", "loha", "w2b"), (".hada_t1", "loha", "t1"), (".hada_t2", "loha", "t2"),
    (".lokr_w1", "lokr", "w1"), (".lokr_w1_a", "lokr", "w1a"), (".lokr_w1_b", "lokr", "w1b"),
    (".lokr_w2", "lokr", "w2"), (".lokr_w2_a", "lokr", "w2a"), (".lokr_w2_b", "lokr", "w2b"),
    (".lokr_t2", "lokr", "t2"), (".diff_b", "bias", "diff"), (".diff", "full", "diff"),
    (".diff_m", "modulation", "diff"),  # a Wan block's scale_shift_table (lightx2v)
    (".w_norm", "full", "diff"), (".b_norm", "bias", "diff"),  # LyCORIS norm layers
    (".dora_scale", "dora", "lycoris"), (".lora_magnitude_vector.weight", "dora", "peft"),
    (".lora_magnitude_vector", "dora", "peft"), (".alpha", "alpha", "alpha"),
)
UNFUSABLE = (
    (".oft_blocks", "OFT"), (".oft_diag", "OFT"), (".oft_R", "OFT"), (".boft_", "BOFT"), (".ia3_l", "IA3"),
    (".on_input", "IA3"), (".a1.weight", "GLoRA"), (".b1.weight", "GLoRA"), (".lokr_t1", "LoKr with a Tucker w1"),
    ("_norm.scale", "FLUX control LoRA (it sets norms and widens x_embedder for a control image)"),
)


@dataclass
class ParsedAdapter:
    """An adapter file converted to per-parameter changes, not yet bound to a model."""

    adapter_id: str
    format: str  # the trainer's layout the file was written in (`detect_layout`)
    layers: dict[str, dict[str, Layer]]  # component ("unet", "text_encoder", ...) -> parameter -> change
    metadata: dict[str, str] = field(default_factory=dict)
    base_models: list[str] = field(default_factory=list)  # declared by the file, card or config
    num_tensors: int = 0  # in the file: every one of them is in `layers`
    # read in place (`files/data.py`): the open files whose bytes the large factors stand for
    files: list[FileData] = field(default_factory=list)

    def all_layers(self) -> Iterable[tuple[str, str, Layer]]:
        return ((c, p, layer) for c, params in self.layers.items() for p, layer in params.items())

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for _, _, layer in self.all_layers())

    @property
    def ranks(self) -> list[int]:
        return sorted({layer.rank for _, _, layer in self.all_layers() if layer.rank})

    @property
    def num_layers(self) -> int:
        return sum(len(params) for params in self.layers.values())

    def kinds(self) -> dict[str, dict[str, int]]:
        """component -> kind (with `+dora`, `bias`) -> parameters changed."""
        out: dict[str, dict[str, int]] = {}
        for component, param, layer in self.all_layers():
            kind = layer.label(param)
            counts = out.setdefault(component, {})
            counts[kind] = counts.get(kind, 0) + 1
        return out


def detect_layout(keys: list[str]) -> str:
    """The trainer's layout a file's keys are in, for `inspect` and logs."""
    checks = (
        ("lycoris", lambda k: k.startswith("lycoris_") or ".hada_" in k or ".lokr_" in k),
        ("kohya", lambda k: k.startswith(("lora_unet_", "lora_te"))),
        ("onetrainer", lambda k: k.startswith("lora_transformer_")),
        ("comfyui", lambda k: k.startswith(("diffusion_model.", "text_encoders."))),
        ("xlabs", lambda k: ".processor.proj_lora" in k or ".processor.qkv_lora" in k),
        ("peft", lambda k: k.startswith("base_model.model.")),
        ("diffusers", lambda k: k.startswith(("unet.", "transformer.", "text_encoder"))),
    )
    for name, test in checks:
        if any(test(k) for k in keys):
            return name
    return "other"


def split_key(key: str) -> tuple[str, str, str] | None:
    """(module prefix, kind, factor) of a file key, or None for a key of no known kind."""
    for suffix, kind, factor in SUFFIXES:
        if key.endswith(suffix) and len(key) > len(suffix):
            return key[: -len(suffix)], kind, factor
    return None


def parse_adapter(adapter_id: str, state_dict: dict[str, torch.Tensor], metadata: dict[str, str],
                  pipeline_cls: type[DiffusionPipeline], component_modules: dict[str, set[str]],
                  unet_config=None) -> ParsedAdapter:
    """Convert an adapter's tensors to per-parameter changes for the pipeline class.

    `component_modules` maps each component adapters may change to its module names;
    `unet_config` lets diffusers renumber SDXL kohya keys in SGM block numbering. Shapes
    are checked later, when the adapter is bound to a model."""
    modules = _group(adapter_id, state_dict)
    if not modules:
        raise AdapterInvalid(adapter_id, "it contains no LoRA layer, nor a layer of any other adapter kind",
                             f"Use an adapter made for {pipeline_cls.__name__} models")
    names = ModuleNames(component_modules)
    places = _place(adapter_id, pipeline_cls, modules, names, DiffusersProbe(pipeline_cls, names, unet_config))
    _refuse_collisions(adapter_id, places)
    config = json.loads(metadata[LORA_ADAPTER_METADATA_KEY]) if LORA_ADAPTER_METADATA_KEY in metadata else {}
    layers: dict[str, dict[str, Layer]] = {}
    for prefix, module in modules.items():
        for place in places[prefix]:
            component_config = {k.removeprefix(place.component + "."): v for k, v in config.items()
                                if k.startswith(place.component + ".")}
            for param, layer in module_layers(adapter_id, prefix, module, place, component_config).items():
                layers.setdefault(place.component, {})[param] = layer
    return ParsedAdapter(adapter_id, detect_layout(list(state_dict)), layers, metadata, num_tensors=len(state_dict))


@dataclass
class FileModule:
    """One module prefix of a file: its tensors by kind and factor, and the file's suffixes."""

    parts: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # kind -> factor -> tensor
    suffixes: dict[tuple[str, str], str] = field(default_factory=dict)  # (kind, factor) -> the file's suffix

    def first_key(self, prefix: str) -> str:
        return prefix + next(iter(self.suffixes.values()))


def _group(adapter_id: str, state_dict: dict[str, torch.Tensor]) -> dict[str, FileModule]:
    """prefix -> its tensors; every key claimed or the adapter refused."""
    modules: dict[str, FileModule] = {}
    for key, tensor in state_dict.items():
        for marker, kind in UNFUSABLE:
            if marker in key:
                raise AdapterInvalid(adapter_id, f"key '{key}' is from a {kind} adapter, which cannot be fused into "
                                     "the model's weights", "Use a LoRA, LoCon, LoHa, LoKr, DoRA or full-diff adapter")
        parts = split_key(key)
        if parts is None:
            raise AdapterInvalid(adapter_id, f"key '{key}' is not a weight of any adapter kind loraswap knows "
                                 "(LoRA, LoCon, LoHa, LoKr, DoRA, diff, diff_b)",
                                 "Remove keys that are not adapter weights from the file")
        prefix, kind, factor = parts
        module = modules.setdefault(prefix, FileModule())
        module.parts.setdefault(kind, {})[factor] = tensor
        module.suffixes[(kind, factor)] = key[len(prefix):]
    return modules


def check_key_kinds(adapter_id: str, keys: Iterable[str]) -> None:
    """Refuse a file by its key names alone, as `parse_adapter` would whatever the model: no
    key, or a key of no adapter kind loraswap knows (the file's own defect)."""
    if not _group(adapter_id, dict.fromkeys(keys)):
        raise AdapterInvalid(adapter_id, "it contains no LoRA layer, nor a layer of any other adapter kind",
                             "Use a LoRA, LoCon, LoHa, LoKr, DoRA or full-diff adapter")


def _refuse_collisions(adapter_id: str, places: dict[str, list[Place]]) -> None:
    """Two file modules on one model module (`text_model.` and flattened names, say): refused,
    rather than one silently winning."""
    owner: dict[tuple[str, str], str] = {}
    for prefix, targets in places.items():
        for place in targets:
            key = (place.component, place.module)
            if key in owner:
                raise AdapterInvalid(adapter_id, f"keys '{owner[key]}' and '{prefix}' name the same weight "
                                     f"({place.component}.{place.module})", "Keep one copy of each layer in the file")
            owner[key] = prefix


def _probe_keys(module: FileModule) -> tuple[int, ProbeKeys]:
    """How many output rows a file module has, and the key names its probe takes: the
    file's own where it has a LoRA pair, else kohya's (the layout non-LoRA kinds use)."""
    parts = module.parts
    weight_kinds = [k for k in WEIGHT_KINDS if k in parts and complete(k, parts[k])]
    if weight_kinds:
        rows = delta_shape(Layer(KINDS[weight_kinds[0]], parts[weight_kinds[0]]))[0]
    else:
        tensor = next(t for kind in parts.values() for t in kind.values())
        rows = tensor.shape[0] if tensor.ndim else 1
    if "down" in parts.get("lora", {}) and "up" in parts["lora"]:
        alpha = ".alpha" if "alpha" in parts else None
        return rows, ProbeKeys(module.suffixes[("lora", "down")], module.suffixes[("lora", "up")], alpha)
    return rows, KOHYA_PROBE


def _place(adapter_id: str, pipeline_cls, modules: dict[str, FileModule], names: ModuleNames,
           probe: DiffusersProbe) -> dict[str, list[Place]]:
    """prefix -> the model modules it lands on; a prefix placed nowhere is refused."""
    places: dict[str, list[Place]] = {}
    for prefix in modules:
        place = names.direct(prefix) or names.flux_norm(prefix)
        if place is not None:
            places[prefix] = [place]
    rest = {p: _probe_keys(m) for p, m in modules.items() if p not in places}
    if rest:
        places.update(_probe(probe, rest))
    # names diffusers reads only with the other suffixes: BFL names with PEFT's (ai-toolkit's
    # LoRAs: read with kohya's), FLUX.2 names of non-LoRA kinds (ai-toolkit's LoKr: PEFT's)
    for fallback in (KOHYA_PROBE, PEFT_PROBE):
        retry = {p: (rows, fallback) for p, (rows, keys) in rest.items() if p not in places and keys != fallback}
        if retry:
            places.update(_probe(probe, retry))
    for prefix, module in modules.items():
        if not places.get(prefix):
            _refuse_unplaced(adapter_id, pipeline_cls, names, module.first_key(prefix), prefix)
    return places


def _probe(probe: DiffusersProbe, modules: dict[str, tuple[int, ProbeKeys]]) -> dict[str, list[Place]]:
    """The probe on all modules at once; where diffusers refuses them together, one by one."""
    try:
        return probe.places(modules)
    except Exception:  # diffusers cannot read these names together (a converter raises on one of them)
        found = {}
        for prefix, keys in modules.items():
            try:
                found.update(probe.places({prefix: keys}))
            except Exception:  # not a name diffusers reads: placed another way, or refused
                pass
        return found


def _refuse_unplaced(adapter_id: str, pipeline_cls, names: ModuleNames, key: str, prefix: str) -> None:
    if other := names.missing_component(prefix):
        raise AdapterInvalid(adapter_id, f"keys like '{key}' belong to no component of {pipeline_cls.__name__} "
                             f"(they name a {other})", f"Use an adapter made for {pipeline_cls.__name__} models")
    components = ", ".join(sorted(names.component_modules))
    raise AdapterIncompatible(adapter_id, f"the layer of key '{key}' does not exist in this model's {components}",
                              "Use an adapter made for this base model")


def parse_adapter_file(location, pipeline_cls: type[DiffusionPipeline], component_modules: dict[str, set[str]],
                       max_bytes: int, unet_config=None, in_place: bool = False, digest=None) -> ParsedAdapter:
    """Read, check and convert the adapter at `location` (an `AdapterLocation`). `in_place`:
    the large tensors stand in for the file's bytes, read when packed (`files/data.py`); the
    caller closes `files`. `digest` (a `hashes.ReadDigest`): handed what is read of the weights file."""
    if location.second_expert is not None and "transformer_2" not in component_modules:
        raise AdapterIncompatible(location.adapter_id, "it is a pair of expert files (high and low noise) for Wan "
                                  "2.2's two transformers, and this model has one", "Serve it on a Wan 2.2 model, "
                                  "or keep one file")
    files: list[FileData] = []
    try:
        tensors, metadata = _read(location, location.weights, component_modules, max_bytes, files if in_place else None,
                                  digest)
        parsed = parse_adapter(location.adapter_id, tensors, metadata, pipeline_cls, component_modules, unet_config)
        if location.second_expert is not None:
            _add_second_expert(parsed, location, pipeline_cls, component_modules,
                               max_bytes - location.weights.stat().st_size, files if in_place else None)
        parsed.base_models = declared_base_models(metadata, location.folder)  # a model card: may raise too
    except BaseException:
        for file in files:
            file.close()
        raise
    parsed.files = files
    return parsed


def _add_second_expert(parsed: ParsedAdapter, location, pipeline_cls, component_modules: dict[str, set[str]],
                       max_bytes: int, files: list[FileData] | None) -> None:
    """Wan 2.2's low-noise file of a pair, placed as its trainers mean it: the keys that name
    the denoiser (`diffusion_model.`, `transformer.`, `lora_unet_`) go into `transformer_2`,
    which has the same module names as `transformer`."""
    adapter_id = location.adapter_id
    as_first = dict(component_modules, transformer=component_modules["transformer_2"])
    tensors, metadata = _read(location, location.second_expert, as_first, max_bytes, files)
    second = parse_adapter(adapter_id, tensors, metadata, pipeline_cls, as_first)
    for component, params in second.layers.items():
        target = "transformer_2" if component == "transformer" else component
        if parsed.layers.get(target):
            raise AdapterInvalid(adapter_id, f"both expert files change {target}", "Keep each expert's keys in its "
                                 "own file")
        parsed.layers[target] = params
    parsed.num_tensors += second.num_tensors


def _read(location, path, component_modules: dict[str, set[str]], max_bytes: int, files: list[FileData] | None,
          digest=None):
    """One weight file's tensors and metadata; a PEFT folder's adapter_config.json gives the
    scales of a file that carries none (both files of a Wan 2.2 pair alike). With `files`,
    read in place, the file added to them; `digest` handed what is read of it."""
    if files is None:
        tensors, metadata = read_safetensors(path, location.adapter_id, max_bytes, digest)
    else:
        tensors, metadata, data = open_in_place(path, location.adapter_id, max_bytes, digest)
        files.append(data)
    if LORA_ADAPTER_METADATA_KEY not in metadata and location.folder is not None:
        metadata = metadata | _peft_config_metadata(location.adapter_id, location.folder, component_modules)
    return tensors, metadata


_PEFT_SCALE_KEYS = ("r", "lora_alpha", "alpha_pattern", "rank_pattern", "use_rslora")


def _peft_config_metadata(adapter_id: str, folder, component_modules) -> dict[str, str]:
    """A PEFT folder's adapter_config.json (lora_alpha, alpha_pattern, rsLoRA) as the
    metadata diffusers writes, for every component: its scales, not alpha = rank."""
    path = folder / "adapter_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        raise AdapterInvalid(adapter_id, "its adapter_config.json is not readable JSON (it holds the LoRA's scales)",
                             "Fix or remove adapter_config.json") from None
    peft = {k: config[k] for k in _PEFT_SCALE_KEYS if k in config} if isinstance(config, dict) else {}
    if not peft:
        return {}
    return {LORA_ADAPTER_METADATA_KEY: json.dumps({f"{c}.{k}": v for c in component_modules for k, v in peft.items()})}

