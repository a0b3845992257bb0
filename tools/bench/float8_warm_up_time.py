"""How long the float8 swap kernel's warm-up takes at start-up, for one model's weight shapes.

The warm-up compiles every variant a request's swap could launch (`engine/kernels/float8_warm_up.py`),
so its time is paid by each start that finds no Triton cache. Run it in a fresh process
with a fresh cache each time (Triton keeps compiled kernels in memory and on disk):

    TRITON_CACHE_DIR=$(mktemp -d) python tools/bench/float8_warm_up_time.py --architecture flux-dev
    TRITON_CACHE_DIR=$(mktemp -d) python tools/bench/float8_warm_up_time.py --architecture flux-dev --threads 1

--threads sets how many variants compile at once (1: one at a time); --row-ranks replaces
the per-row ranks the warm-up compiles (`ROW_RANKS`), to compare sets. The shapes are those
of every linear layer of the denoiser (built on the meta device, no memory), the float8 ones
among them.
The warm-up runs twice: the second time every variant is in memory (launches only).
--out appends one JSON line.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from loraswap.engine.kernels import float8_warm_up, triton_compile
from loraswap.models import lora_components
from loraswap.models.architectures import build_architecture_component


def linear_shapes(architecture: str) -> set[tuple[int, int]]:
    """The (out, in) shapes of the denoisers' linear layers, both experts where there are two."""
    shapes = set()
    for component in lora_components(architecture)[1]:
        model = build_architecture_component(architecture, component)
        shapes |= {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--architecture", default="flux-dev")
    parser.add_argument("--row-ranks", help="comma-separated ranks instead of ROW_RANKS")
    parser.add_argument("--threads", type=int, help="compile threads (1: one variant at a time)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.row_ranks:
        float8_warm_up.ROW_RANKS = tuple(int(r) for r in args.row_ranks.split(","))
    if args.threads:
        triton_compile.compile_threads = lambda: args.threads
    shapes = linear_shapes(args.architecture)
    device = torch.device("cuda")
    torch.zeros(1, device=device)  # the CUDA context is not the warm-up's
    start = time.perf_counter()
    float8_warm_up.warm_up_float8(device, False, shapes)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    float8_warm_up.warm_up_float8(device, False, shapes)  # every variant in memory now: launches only
    torch.cuda.synchronize()
    again = time.perf_counter() - start
    row = {"architecture": args.architecture, "row_ranks": list(float8_warm_up.ROW_RANKS),
           "shapes": len(shapes), "threads": triton_compile.compile_threads(),
           "warm_up_s": round(seconds, 2), "again_s": round(again, 3), "torch": torch.__version__}
    print(json.dumps(row))
    if args.out:
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
