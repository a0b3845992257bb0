"""Where a never-seen adapter's first read goes: reading the file, parsing and placing its
keys (the probe through diffusers' converters among them), binding and packing it into one
buffer. The cold path of a request, without a model's weights (the real architecture's
layers on the meta device), on this machine's CPU.

    PYTHONPATH=src python tools/bench/cold_read_profile.py [--architecture flux-dev] [--rank 64] [--rounds 7]

It writes a random kohya adapter (all linear layers) once under /tmp, then reads it
`--rounds` times (the first one is dropped: imports and caches), and prints the median
of each phase in ms: for a file whose key layout was read before (the probe through
diffusers' converters is remembered per layout), and for the first file of its layout.
"""

import argparse
import functools
import gc
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraswap.adapters import bound, store
from loraswap.adapters.bound import ModelLayers
from loraswap.adapters.parse import changes as parse
from loraswap.adapters.parse import layout
from loraswap.adapters.random import make_random_adapter
from loraswap.adapters.sources.local import AdapterLocation
from loraswap.models import lora_components

PHASES = {"read file": (parse, "_read"), "parse and place": (parse, "parse_adapter"),
          "probe": (layout.DiffusersProbe, "places"), "pack": (bound.BoundAdapter, "_pack")}


def timed(phases: dict[str, list[float]]) -> None:
    """Each phase's function wrapped to add its seconds to `phases[name]` (summed per read)."""
    for name, (owner, attribute) in PHASES.items():
        original = getattr(owner, attribute)

        def wrapper(*args, _original=original, _name=name, **kwargs):
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                phases[_name][-1] += time.perf_counter() - started

        setattr(owner, attribute, functools.wraps(original)(wrapper))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--architecture", default="flux-dev")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    cls, components = lora_components(args.architecture)
    path = Path(f"/tmp/loraswap-cold-{args.architecture}-r{args.rank}.safetensors")
    if not path.exists():
        state_dict, metadata = make_random_adapter(components, args.rank, "all", "kohya", dtype=torch.bfloat16)
        save_file(state_dict, str(path), metadata=metadata)
    target = store.TargetModel(args.architecture, cls, ModelLayers(components), torch.bfloat16, None)
    phases: dict[str, list[float]] = {name: [] for name in [*PHASES, "total"]}
    store.read_adapter(AdapterLocation("cold", path, None), target)  # imports and first uses
    gc.freeze()  # as a server does once loaded: full collections keep off what is loaded
    timed(phases)
    medians = {}
    for layout_seen in (True, False):
        for times in phases.values():
            times.clear()
        for _ in range(args.rounds):
            if not layout_seen:
                layout.DiffusersProbe._memo.clear()
            for times in phases.values():
                times.append(0.0)
            started = time.perf_counter()
            store.read_adapter(AdapterLocation("cold", path, None), target)
            phases["total"][-1] = time.perf_counter() - started
        medians[layout_seen] = {name: statistics.median(times[1:]) * 1e3 for name, times in phases.items()}
    print(f"{path.name}: {path.stat().st_size / 2**20:.0f} MiB, median of {args.rounds - 1} reads, ms")
    print(f"  {'':16s} {'layout seen':>12s} {'new layout':>12s}")
    for name in phases:
        print(f"  {name:16s} {medians[True][name]:12.1f} {medians[False][name]:12.1f}")


if __name__ == "__main__":
    main()
