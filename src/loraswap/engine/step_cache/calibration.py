"""MagCache's calibration: the ratio of the residual's magnitude from one step to the next,
per step, measured on the served model (its own, not FLUX.1's published ratios: a
fine-tune, a quantized model or another scheduler changes them) or read from a file the
operator gives.

The ratios are measured once at start-up on the base model, with the model's default
steps, one prompt and seed; a request with other steps interpolates them (diffusers'
`nearest_interp`). What an adapter does to them is measured, not assumed:
`tools/demo/demo_flux_step_cache.py` calibrates with each trained adapter of `demo-flux` and
compares the steps each calibration would skip.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist

from loraswap.errors import LoraswapError

PROMPT = "a photograph of a red circle on a white ground"  # any prompt: ratios vary little with it


class BadCalibration(LoraswapError):
    status = 500


def read_ratios(path: Path) -> list[float]:
    """A calibration file: a JSON list of ratios, one per step (the first is 1), or an object
    with a `ratios` list (as `loraswap` writes them in its start-up log)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise BadCalibration(f"--step-cache-calibration {path}: {e}") from None
    ratios = data.get("ratios") if isinstance(data, dict) else data
    # JSON's true and false would pass as 1 and 0 (bool is an int): not ratios
    numbers = isinstance(ratios, list) and all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in ratios)
    if not (numbers and len(ratios) >= 2):
        raise BadCalibration(f"--step-cache-calibration {path}: give a JSON list of at least 2 numbers, one per "
                             'step, or {"ratios": [...]}')
    if not all(0 < r < 100 for r in ratios):
        raise BadCalibration(f"--step-cache-calibration {path}: every ratio must be above 0 and below 100")
    return [float(r) for r in ratios]


def shared(ratios: list[float], device: torch.device) -> list[float]:
    """With several processes (context parallelism), the first process's ratios on every one:
    each measured a slice of the sequence, and every process must skip the same steps."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return ratios
    values = torch.tensor(ratios, dtype=torch.float64, device=device)
    dist.broadcast(values, src=0)
    return values.tolist()
