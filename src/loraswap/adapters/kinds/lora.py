"""LoRA (and LoCon): `down` [r, in, (kh, kw)], `up` [out, r, (1, 1)], optional Tucker `mid`
[r, r, kh, kw]: dW = up @ down, or mid contracted with both. Scaled by alpha / rank, or by
PEFT's rule where the file carries diffusers' adapter config."""

import math

import torch
from peft.utils.other import get_pattern_key

from loraswap.adapters.kinds.base import AdapterKind, FastWrite, Rows, matrix, tucker

_SWAPPED = {"down": "up", "up": "down", "lora_A": "lora_B", "lora_B": "lora_A"}


class LoRA(AdapterKind):
    name = label = "lora"
    required = (frozenset({"down"}), frozenset({"up"}))

    def missing_factor_name(self, module, factor: str) -> str:
        """Named after the pair's other key (`lora_A.weight` missing beside `lora_B.weight`):
        LoRA files have many spellings."""
        present = next(s for (k, f), s in module.suffixes.items() if k == self.name and f in ("down", "up"))
        for word, other in _SWAPPED.items():
            if word in present:
                return present.replace(word, other).lstrip("._")
        return factor

    def rank(self, factors: dict) -> int:
        return factors["down"].shape[0]

    def scale(self, factors: dict, alpha: float | None, target: str, config: dict) -> float:
        if alpha is None and config:
            return peft_scale(target, self.rank(factors), config)
        return super().scale(factors, alpha, target, config)

    def delta_shape(self, factors: dict) -> tuple[int, ...]:
        f = factors
        if "mid" in f:
            return (f["up"].shape[0], f["down"].shape[1], *f["mid"].shape[2:])
        return (f["up"].shape[0], *f["down"].shape[1:])

    def dense(self, f: dict[str, torch.Tensor]) -> torch.Tensor:
        down = matrix(f["down"])
        if "mid" in f:
            return tucker(f["mid"], matrix(f["up"]).T, down)
        return matrix(f["up"]) @ down

    def select_rows(self, factors: dict, rows: Rows) -> tuple[AdapterKind, dict]:
        f = factors | {"up": factors["up"][rows]}
        return self, {k: v.contiguous() for k, v in f.items()}

    def fast_write(self, factors: dict) -> FastWrite | None:
        return FastWrite("low_rank", (factors["up"], factors["down"])) if self.is_plain_pair(factors) else None

    def is_plain_pair(self, factors: dict) -> bool:
        return factors.keys() == {"down", "up"}

    def label_of(self, factors: dict, shape: tuple[int, ...]) -> str:
        """`locon` (LyCORIS's name) on a convolution wider than 1x1, else `lora`: kohya and
        LyCORIS call a LoRA of the 3x3 convolutions a LoCon."""
        kernel = shape[2:] if shape else factors.get("mid", factors["down"]).shape[2:]
        return "locon" if any(k > 1 for k in kernel) else "lora"

    def matrix_factors(self, factors: dict) -> frozenset[str]:
        """down [rank, fan_in] and up [out, rank], conv factors included (not a Tucker
        LoCon's): the shapes `addmm` and the swap kernel take, so a swap reshapes nothing."""
        return frozenset() if "mid" in factors else frozenset({"down", "up"})


def peft_scale(module: str, rank: int, config: dict) -> float:
    """PEFT's scale from diffusers' adapter metadata: lora_alpha, alpha_pattern, rsLoRA."""
    alpha = float(config.get("lora_alpha", config.get("r", rank)))
    patterns = config.get("alpha_pattern") or {}
    pattern = get_pattern_key(list(patterns), module)
    if pattern in patterns:
        alpha = float(patterns[pattern])
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


LORA = LoRA()
