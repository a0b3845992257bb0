"""One module of an adapter file -> the changes it makes to one model module: its weight
(any kind, with a DoRA magnitude or not) and its bias, scaled as the trainer scales them."""


from loraswap.adapters.kinds import FILE_KINDS, FULL, KINDS, AdapterKind, Layer
from loraswap.adapters.kinds.base import Rows
from loraswap.adapters.kinds.dora import magnitude_rows, with_dora
from loraswap.adapters.parse.layout import Place
from loraswap.errors import AdapterInvalid

WEIGHT_KINDS = FILE_KINDS  # the kinds a file's module may hold, by name


def complete(kind: str, factors: dict) -> bool:
    """Whether `factors` hold every factor the kind named `kind` needs."""
    return KINDS[kind].complete(factors)


def module_layers(aid: str, prefix: str, module, place: Place, config: dict) -> dict[str, Layer]:
    """parameter name -> change, for `module` (a `parse.FileModule`) landing on `place`."""
    parts = module.parts
    kinds = [k for k in WEIGHT_KINDS if k in parts]
    if len(kinds) > 1:
        raise AdapterInvalid(aid, f"'{prefix}' has both {kinds[0]} and {kinds[1]} factors",
                             "Export each layer as one adapter kind")
    alpha = _alpha(aid, prefix, parts)
    out: dict[str, Layer] = {}
    if kinds:
        layer = _weight_layer(aid, prefix, module, KINDS[kinds[0]], alpha, place.module, config)
        if "dora" in parts:
            layer = with_dora(aid, prefix, layer, parts["dora"])
        out[place.module + ".weight"] = _rows(aid, prefix, layer, place.rows)
    elif "dora" in parts or alpha is not None:
        raise AdapterInvalid(aid, f"'{module.first_key(prefix)}' belongs to no weight change of its layer",
                             "The file is incomplete: export the adapter again")
    bias = parts.get("bias", {})
    if len(bias) > 1:
        raise AdapterInvalid(aid, f"'{prefix}' has two bias changes (diff_b and lora_B.bias)",
                             "Keep one bias change per layer")
    for factor, tensor in bias.items():
        if factor == "lora_bias" and kinds != ["lora"]:
            raise AdapterInvalid(aid, f"'{prefix}.lora_B.bias' has no LoRA pair", "Export the adapter again")
        scale = out[place.module + ".weight"].scale if factor == "lora_bias" else 1.0
        out[place.module + ".bias"] = _rows(aid, prefix, Layer(FULL, {"diff": tensor}, scale), place.rows)
    if "modulation" in parts:  # the block's modulation table, changed as a whole
        out[place.module + ".scale_shift_table"] = Layer(FULL, {"diff": parts["modulation"]["diff"]})
    return out


def _alpha(aid: str, prefix: str, parts: dict) -> float | None:
    tensor = parts.get("alpha", {}).get("alpha")
    if tensor is None:
        return None
    if tensor.numel() != 1:
        raise AdapterInvalid(aid, f"'{prefix}.alpha' has {tensor.numel()} values, not one",
                             "The file is corrupt: export the adapter again")
    return float(tensor.float().item())


def _weight_layer(aid: str, prefix: str, module, kind: AdapterKind, alpha: float | None, target: str,
                  config: dict) -> Layer:
    factors = dict(module.parts[kind.name])
    missing = [alts for alts in kind.required if not alts & factors.keys()]
    unpaired = [pair for pair in kind.paired if (pair[0] in factors) != (pair[1] in factors)]
    if missing or unpaired:
        name = sorted(missing[0])[0] if missing else next(n for n in unpaired[0] if n not in factors)
        missing_name = kind.missing_factor_name(module, name).removesuffix(".weight")
        raise AdapterInvalid(aid, f"layer '{prefix}' has no {missing_name} weight ({kind.name} factors come in sets)",
                             "The file is incomplete: export the adapter again")
    if any(t.ndim == 0 or t.numel() == 0 for t in factors.values()):
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in factors.items())
        raise AdapterInvalid(aid, f"layer '{prefix}' is empty (rank 0: {shapes})",
                             "Remove empty layers, or export the adapter again")
    kind.check_factors(aid, prefix, factors)
    return Layer(kind, factors, kind.scale(factors, alpha, target, config))


def _rows(aid: str, prefix: str, layer: Layer, rows: Rows | None) -> Layer:
    """The layer restricted to some output rows (a file module split over model modules)."""
    if rows is None:
        return layer
    if layer.dora == "lycoris-in":
        raise AdapterInvalid(aid, f"'{prefix}' is DoRA normalised per input column on a layer this model splits",
                             "Use an adapter trained on the model's own layer layout")
    factors = layer.factors | ({"magnitude": magnitude_rows(layer, rows)} if "magnitude" in layer.factors else {})
    kind, factors = layer.kind.select_rows(factors, rows)
    return layer.replace(kind=kind, factors=factors)
