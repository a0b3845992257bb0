"""DoRA: a `magnitude` any kind may carry, which makes the new weight
magnitude * (W + dW) / norm(W + dW). Not a kind of its own: the layer's kind writes W + dW,
then `rescale_dora` rescales it.

Conventions (`Layer.dora`): "peft" normalises each output row; LyCORIS (and the kohya-style
files other trainers write, `dora_scale`) each output row ("lycoris-out"), or each input
column before 3.2.0 ("lycoris-in"). The axes and the request weight's meaning are the
trainers' own (PEFT `tuners/lora/dora.py`, LyCORIS `lycoris/functional/`).
"""

import math

import torch

from loraswap.adapters.kinds.base import Layer, Rows, delta_shape, write_change
from loraswap.errors import AdapterInvalid


def write(target: torch.Tensor, source: torch.Tensor, layer: Layer, blend: float) -> None:
    """target = source changed by `layer` at `blend` (the request's weight for the adapter).

    `target` may be `source` (a further adapter of a blend, applied to what the earlier
    ones wrote). DoRA is the change, then the rescaling of `target` in place."""
    if layer.dora is None:
        write_change(target, source, layer, blend)
        return
    write_change(target, source, layer.without_dora(), dora_change_weight(layer, blend))
    rescale_dora(target, layer, blend)


def with_dora(aid: str, prefix: str, layer: Layer, dora: dict) -> Layer:
    """The layer with its DoRA magnitude and the convention its shape says it follows
    (`dora`: the file's magnitude by where it came from, "peft" or "lycoris")."""
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


def magnitude_rows(layer: Layer, rows: Rows) -> torch.Tensor:
    """The magnitude of some output rows (a module the model splits): one per output row,
    [1, out, 1, 1] for a PEFT conv."""
    magnitude = layer.factors["magnitude"]
    return magnitude.reshape(-1)[rows] if layer.dora == "peft" else magnitude[rows]


def dora_change_weight(layer: Layer, blend: float) -> float:
    """What the request's weight multiplies the change by before DoRA's rescaling: PEFT
    scales the LoRA inside the norm; LyCORIS applies the whole change and interpolates the
    rescaling instead (`rescale_dora`)."""
    return blend if layer.dora == "peft" else 1.0


def rescale_dora(weight: torch.Tensor, layer: Layer, blend: float) -> None:
    """DoRA on a weight that already holds W + dW: W' = magnitude * (W + dW) / ||W + dW||,
    in place (norms in fp32), as each trainer's loader does it.

    PEFT: the norm of each output row; the request's weight w scaled dW (`set_adapters`).
    LyCORIS: the norm of each output row (`dora_scale` [out, 1]) or input column ([1, in],
    before LyCORIS 3.2.0); w interpolates the rescaling, W' = V * (w (m / ||V|| - 1) + 1),
    as its network's forward does with its multiplier.
    """
    rest = [1] * (weight.ndim - 1)
    if layer.dora == "lycoris-in":
        columns = weight.transpose(0, 1).reshape(weight.shape[1], -1)
        norm = torch.linalg.vector_norm(columns, dim=1, dtype=torch.float32)
        shape = (1, -1, *rest[1:])
    else:
        norm = torch.linalg.vector_norm(weight.reshape(weight.shape[0], -1), dim=1, dtype=torch.float32)
        shape = (-1, *rest)
    weight.mul_(dora_factors(layer, blend, norm).view(shape))


def dora_factors(layer: Layer, blend: float, norm: torch.Tensor) -> torch.Tensor:
    """The fp32 factor each row (or column) of W + dW is multiplied by, from its norms."""
    magnitude = layer.factors["magnitude"].float().reshape(-1)
    if layer.dora == "peft":
        return magnitude / norm
    return blend * (magnitude / (norm + torch.finfo(torch.float32).eps) - 1) + 1


def dora_magnitude_shape(convention: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The magnitude shape each DoRA convention stores for a parameter of `shape`."""
    if convention == "peft":
        return (shape[0],)
    ones = (1,) * (len(shape) - 1)
    return (shape[0], *ones) if convention == "lycoris-out" else (1, shape[1], *ones[1:])
