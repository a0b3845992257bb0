"""What each adapter kind does to one parameter of the model, one kind per file.

Every kind people share is a change of a weight (DoRA: a new weight), so every kind is
fused: the swap writes `change(pristine)` into the parameter and the model runs at the
base model's speed. Each kind (`base.AdapterKind`) answers for its own factors: rank, the
dense change, its rows on a module the model splits, its scale, its one-pass write; the
parser, the binder and the swap ask it and never branch on its name. The formulas, scales
and axes are the trainers' own (LyCORIS `lycoris/functional/`, PEFT `tuners/lora/dora.py`);
the unit tests check them against those libraries.

Adding a kind: a file here with its `AdapterKind` subclass and instance, the instance in
`KINDS` below, its file suffixes in `parse.SUFFIXES`, and its tests.
"""

from types import MappingProxyType

from loraswap.adapters.kinds.base import AdapterKind, FastWrite, Layer, delta, delta_shape, write_change
from loraswap.adapters.kinds.dora import dora_change_weight, dora_factors, dora_magnitude_shape, rescale_dora, write
from loraswap.adapters.kinds.full import FULL
from loraswap.adapters.kinds.loha import LOHA
from loraswap.adapters.kinds.lokr import LOKR
from loraswap.adapters.kinds.lokr_rows import LOKR_ROWS
from loraswap.adapters.kinds.lora import LORA

# name -> kind; the parser tries the kinds read from files in this order
KINDS: MappingProxyType[str, AdapterKind] = MappingProxyType(
    {kind.name: kind for kind in (LORA, LOHA, LOKR, FULL, LOKR_ROWS)})
FILE_KINDS = tuple(name for name, kind in KINDS.items() if kind.read_from_files)

__all__ = [
    "FILE_KINDS", "FULL", "KINDS", "LOHA", "LOKR", "LOKR_ROWS", "LORA", "AdapterKind", "FastWrite", "Layer", "delta",
    "delta_shape", "dora_change_weight", "dora_factors", "dora_magnitude_shape", "rescale_dora", "write",
    "write_change",
]
