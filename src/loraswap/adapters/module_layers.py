"""One module of an adapter file -> the changes it makes to one model module: its weight
(any kind, with a DoRA magnitude or not) and its bias, scaled as the trainer scales them."""

import math

import torch
from peft.utils.other import get_pattern_key

from ..errors import AdapterInvalid
from .kinds import Layer, delta, delta_shape
from .layout import Place

WEIGHT_KINDS = ("lora", "loha", "lokr", "full")
# the factors each kind needs: one of each set
REQUIRED = {"lora": ({"down"}, {"up"}), "loha": ({"w1a"}, {"w1b"}, {"w2a"}, {"w2b"}),
            "lokr": ({"w1", "w1a"}, {"w2", "w2a"}), "full": ({"diff"},)}
_PAIRS = {"loha": (("t1", "t2"),), "lokr": (("w1a", "w1b"), ("w2a", "w2b"))}  # present together or not at all


def complete(kind: str, factors: dict) -> bool:
    return all(any(name in factors for name in alternatives) for alternatives in REQUIRED[kind])


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
        layer = _weight_layer(aid, prefix, module, kinds[0], alpha, place.module, config)
        if "dora" in parts:
            layer = _with_dora(aid, prefix, layer, parts["dora"])
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
        out[place.module + ".bias"] = _rows(aid, prefix, Layer("full", {"diff": tensor}, scale), place.rows)
    if "modulation" in parts:  # the block's modulation table, changed as a whole
        out[place.module + ".scale_shift_table"] = Layer("full", {"diff": parts["modulation"]["diff"]})
    return out


_CANONICAL = {"loha": "hada_{}", "lokr": "lokr_{}", "full": "diff"}


def _missing_suffix(module, kind: str, factor: str) -> str:
    """A missing factor named as the file would name it (`lora_A.weight`, `hada_w2_b`, ...)."""
    if kind == "lora":
        present = next(iter(s for (k, f), s in module.suffixes.items() if k == "lora" and f in ("down", "up")))
        swapped = {"down": "up", "up": "down", "lora_A": "lora_B", "lora_B": "lora_A"}
        for word, other in swapped.items():
            if word in present:
                return present.replace(word, other).lstrip("._")
        return factor
    return _CANONICAL[kind].format(factor[:2] + ("_" + factor[2:] if factor[2:] else ""))


def _alpha(aid: str, prefix: str, parts: dict) -> float | None:
    tensor = parts.get("alpha", {}).get("alpha")
    if tensor is None:
        return None
    if tensor.numel() != 1:
        raise AdapterInvalid(aid, f"'{prefix}.alpha' has {tensor.numel()} values, not one",
                             "The file is corrupt: export the adapter again")
    return float(tensor.float().item())


def _weight_layer(aid, prefix, module, kind, alpha, target: str, config: dict) -> Layer:
    factors = dict(module.parts[kind])
    missing = [alts for alts in REQUIRED[kind] if not alts & factors.keys()]
    unpaired = [pair for pair in _PAIRS.get(kind, ()) if (pair[0] in factors) != (pair[1] in factors)]
    if missing or unpaired:
        name = sorted(missing[0])[0] if missing else next(n for n in unpaired[0] if n not in factors)
        missing_name = _missing_suffix(module, kind, name).removesuffix(".weight")
        raise AdapterInvalid(aid, f"layer '{prefix}' has no {missing_name} weight ({kind} factors come in sets)",
                             "The file is incomplete: export the adapter again")
    if any(t.ndim == 0 or t.numel() == 0 for t in factors.values()):
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in factors.items())
        raise AdapterInvalid(aid, f"layer '{prefix}' is empty (rank 0: {shapes})",
                             "Remove empty layers, or export the adapter again")
    if "w1" in factors and "w1a" in factors or "w2" in factors and "w2a" in factors:
        raise AdapterInvalid(aid, f"'{prefix}' has a LoKr factor both full and factored", "Export the adapter again")
    return Layer(kind, factors, _scale(kind, factors, alpha, target, config))


def _scale(kind: str, factors: dict, alpha: float | None, target: str, config: dict) -> float:
    """alpha / rank as each trainer defines it (1 for full differences and all-full LoKr)."""
    if kind == "full" or (kind == "lokr" and "w1" in factors and "w2" in factors):
        return 1.0  # LyCORIS ignores a stored alpha when both Kronecker factors are full
    rank = Layer(kind, factors).rank
    if kind == "lora" and alpha is None and config:
        return _peft_scale(target, rank, config)
    if alpha is None or alpha == 0:  # LyCORIS and kohya: no alpha means alpha = rank
        alpha = float(rank)
    return alpha / rank


def _peft_scale(module: str, rank: int, config: dict) -> float:
    """PEFT's scale from diffusers' adapter metadata: lora_alpha, alpha_pattern, rsLoRA."""
    alpha = float(config.get("lora_alpha", config.get("r", rank)))
    patterns = config.get("alpha_pattern") or {}
    pattern = get_pattern_key(list(patterns), module)
    if pattern in patterns:
        alpha = float(patterns[pattern])
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _with_dora(aid: str, prefix: str, layer: Layer, dora: dict) -> Layer:
    """The layer with its DoRA magnitude and the convention its shape says it follows."""
    (source, magnitude), = dora.items()
    out = delta_shape(layer)[0]
    if source == "peft":
        convention = "peft"
        fits = magnitude.numel() == out  # [out] for Linear, [1, out, 1, 1] for Conv2d
    elif magnitude.shape[0] == out and math.prod(magnitude.shape[1:]) == 1:
        convention, fits = "lycoris-out", True
    else:  # LyCORIS before 3.2.0 (and OneTrainer): one magnitude per input column
        convention, fits = "lycoris-in", magnitude.ndim >= 2 and magnitude.shape[0] == 1
    if not fits:
        raise AdapterInvalid(aid, f"'{prefix}' has a DoRA magnitude of shape {tuple(magnitude.shape)}, which fits "
                             f"neither axis of its {out}-row weight", "Export the adapter again")
    return layer.replace(factors=layer.factors | {"magnitude": magnitude}, dora=convention)


def _rows(aid: str, prefix: str, layer: Layer, rows: torch.Tensor | None) -> Layer:
    """The layer restricted to some output rows (a file module split over model modules)."""
    if rows is None:
        return layer
    f = dict(layer.factors)
    if layer.dora == "lycoris-in":
        raise AdapterInvalid(aid, f"'{prefix}' is DoRA normalised per input column on a layer this model splits",
                             "Use an adapter trained on the model's own layer layout")
    if "magnitude" in f:  # one per output row ([1, out, 1, 1] for a PEFT conv)
        f["magnitude"] = f["magnitude"].reshape(-1)[rows] if layer.dora == "peft" else f["magnitude"][rows]
    if layer.kind == "full":
        f["diff"] = f["diff"][rows]
    elif layer.kind == "lora":
        f["up"] = f["up"][rows]
    elif layer.kind == "loha" and "t1" in f:  # Tucker: the output factor is [r, out]
        f["w1a"], f["w2a"] = f["w1a"][:, rows], f["w2a"][:, rows]
    elif layer.kind == "loha":
        f["w1a"], f["w2a"] = f["w1a"][rows], f["w2a"][rows]
    else:
        return layer.replace(kind="lokr-rows", factors=_kron_rows(f, rows))
    return layer.replace(factors={k: v.contiguous() for k, v in f.items()})


def _kron_rows(f: dict, rows: torch.Tensor) -> dict:
    """Rows of kron(w1, w2) as `lokr-rows` factors: row i*p + k is kron(w1[i], w2[k]) (p: the
    rows of w2), so each kept row takes its w1 row and its w2 row (w2 kept factored)."""
    w1 = f["w1"] if "w1" in f else f["w1a"] @ f["w1b"]
    if "t2" in f:  # a Tucker w2 is rebuilt whole: it is out/a x in/b x k, far smaller than W
        w2 = delta(Layer("lokr", {"w1": torch.ones(1, 1), **{k: f[k] for k in ("w2a", "w2b", "t2")}}), f["t2"].dtype)
        w2 = w2.reshape(w2.shape[0], -1)
    else:
        w2 = f.get("w2")
    p = (w2 if w2 is not None else f["w2a"]).shape[0]
    out = {"w1": w1[rows // p].contiguous()}
    if w2 is not None:
        out["w2"] = w2[rows % p].contiguous()
    else:
        out |= {"w2a": f["w2a"][rows % p].contiguous(), "w2b": f["w2b"].contiguous()}
    if "magnitude" in f:
        out["magnitude"] = f["magnitude"]
    return out
