"""`loraswap bench kinds`: every adapter kind through the fused swap, on a real architecture
with random weights: swap time from pinned host RAM and from the GPU tier, and the time of
one image's denoising with each kind applied against the compiled base model.

The adapters are written by `adapters make-random` in LyCORIS's kohya-style keys (FLUX.1
in BFL naming, so fused modules are split as real files are) and read, converted and
bound as the adapter store does it. Kinds are interleaved round by round.
"""

import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraswap.adapters import kinds
from loraswap.adapters.random import KINDS, make_random_adapter
from loraswap.bench.common import environment, on_device_column, print_table, summary, timed, write_results
from loraswap.bench.swap import Denoise
from loraswap.bench.swap_setup import bound_reader, build_denoiser, denoiser_inputs
from loraswap.engine.startup.compile import graph_count
from loraswap.engine.swap.fused import FusedSwapper
from loraswap.models import lora_components
from loraswap.progress import tracked

logger = logging.getLogger(__name__)


def write_kind_adapters(architecture: str, rank: int, folder: Path) -> dict[str, Path]:
    """kind -> a random adapter of it on every linear layer of the denoiser. LoHa holds two
    low-rank pairs: at half the rank it has the bytes of the LoRA."""
    _, components = lora_components(architecture)
    denoiser = {k: v for k, v in components.items() if not k.startswith("text_encoder")}
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for kind in KINDS:
        kind_rank = max(1, rank // 2) if kind == "loha" else rank
        path = folder / f"{architecture}-{kind}-r{kind_rank}-all.safetensors"
        if not path.exists():
            state_dict, metadata = make_random_adapter(denoiser, kind_rank, "all", "kohya", dtype=torch.bfloat16,
                                                       kind=kind)
            save_file(state_dict, str(path), metadata=metadata)
        paths[kind] = path
    return paths


class KindsBench:
    def __init__(self, architecture: str, width: int, height: int, steps: int, rank: int, workdir: Path):
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.paths = write_kind_adapters(architecture, rank, workdir)
        model, prefix, pipeline_cls = build_denoiser(architecture, self.device, self.dtype)
        self.model = model
        self.fused = FusedSwapper({prefix: model})
        read = bound_reader(pipeline_cls, prefix, model, self.fused.layers)
        bound = {kind: read(path) for kind, path in self.paths.items()}
        self.host = {k: b.to("cpu", self.dtype, pin_memory=self.device.type == "cuda") for k, b in bound.items()}
        self.gpu = {k: b.to(self.device, self.dtype) for k, b in bound.items()}
        self.denoise = Denoise(model, denoiser_inputs(model, width, height, self.device, self.dtype), steps)
        self.results = {"shape": architecture, "width": width, "height": height, "steps": steps, "rank": rank,
                        "env": environment(), "adapters": {k: {"file": p.name, "MiB": round(b.nbytes / 2**20, 1),
                                                              "kinds": b.kinds(), "layers": len(b.layers)}
                                                          for (k, p), b in zip(self.paths.items(), bound.values())}}

    def prepare(self) -> None:
        """Compile, warm the swap kernels, make every pristine copy (a one-time cost)."""
        self.model.compile_repeated_blocks(fullgraph=True)
        self.fused.warm_up_kernel()
        self.results["warmup_s"], _ = timed(lambda: self.denoise(2))
        for adapter in self.gpu.values():
            self.fused.apply([(adapter, 1.0)])
            self.denoise(1)
        self.fused.restore_base()
        self.graphs_after_warmup = graph_count()

    @torch.no_grad()
    def check(self, samples: int = 12) -> None:
        """What the swap wrote (kernels, bf16) against the same change computed in fp32 by
        `kinds.write` from the pristine copy, on sampled layers: the largest error in units
        of the weight dtype's rounding step at the weight's largest value (at most 0.5 when
        rounded once)."""
        worst = {}
        for kind, adapter in self.gpu.items():
            self.fused.apply([(adapter, 1.0)])
            keys = list(adapter.layers)[:: max(1, len(adapter.layers) // samples)]
            errors = []
            for key in keys:
                pristine = self.fused._pristine[key].float()
                expected = pristine.clone()
                kinds.write(expected, expected, adapter.layers[key], 1.0)
                written = self.fused.layers.params[key].float()
                step = torch.finfo(self.dtype).eps * expected.abs().max()
                errors.append(((written - expected).abs().max() / step).item())
            worst[kind] = max(errors)
        self.fused.restore_base()
        self.results["max_error_in_rounding_steps"] = worst

    def swaps(self, count: int) -> None:
        times: dict[str, list[float]] = {}
        kinds = list(self.gpu)
        for s in range(count):
            for kind in kinds[s % len(kinds):] + kinds[: s % len(kinds)]:
                for tier, cache in (("host", self.host), ("gpu", self.gpu)):
                    times.setdefault(f"{kind}_{tier}", []).append(self.fused.apply([(cache[kind], 1.0)]))
        self.results["swap_s"] = {k: summary(v) for k, v in times.items()}

    def images(self, rounds: int) -> None:
        times: dict[str, list[float]] = {}
        variants = ["base", *self.gpu]
        for r in tracked(range(rounds), "rounds"):
            for variant in variants[r % len(variants):] + variants[: r % len(variants)]:
                self.fused.apply([] if variant == "base" else [(self.gpu[variant], 1.0)])
                seconds, _ = timed(self.denoise)
                times.setdefault(variant, []).append(seconds)
                logger.info("round %d %-5s image %.3f s", r, variant, seconds)
        self.fused.restore_base()
        self.results["image_s"] = {k: summary(v) for k, v in times.items()}
        self.results["recompiles"] = graph_count() - self.graphs_after_warmup


def run_kinds_bench(architecture: str = "flux-dev", width: int = 1024, height: int = 1024, steps: int = 28,
                    rank: int = 32, swaps: int = 10, rounds: int = 3, out: Path = Path("bench/results"),
                    workdir: Path | None = None) -> dict:
    bench = KindsBench(architecture, width, height, steps, rank, workdir or out / "adapters")
    bench.prepare()
    bench.check()
    bench.swaps(swaps)
    bench.images(rounds)
    results = bench.results
    write_results(out, "kinds", results)
    _report(results)
    return results


def _report(results: dict) -> None:
    swap, image = results["swap_s"], results["image_s"]
    base = image["base"]["p50"]
    lora_gpu = swap["lora_gpu"]["p50"]
    rows = [[kind, results["adapters"][kind]["MiB"], f"{swap[f'{kind}_host']['p50'] * 1e3:.1f}",
             f"{swap[f'{kind}_gpu']['p50'] * 1e3:.1f}", f"{swap[f'{kind}_gpu']['p50'] / lora_gpu:.2f}",
             f"{image[kind]['p50']:.3f}", f"{image[kind]['p50'] / base:.3f}"] for kind in results["adapters"]]
    errors = results["max_error_in_rounding_steps"]
    for row, kind in zip(rows, results["adapters"]):
        row.append(f"{errors[kind]:.2f}")
    print_table(f"{results['shape']} {results['width']}x{results['height']}, {results['steps']} steps, "
                f"base image {base:.3f} s, {results['recompiles']} recompiles ({results['env'].get('gpu', 'cpu')})",
                ["kind", "MiB", "swap host ms", on_device_column(results["env"]),
                 "GPU swap / LoRA's" if "gpu" in results["env"] else "swap / LoRA's", "image s", "vs base",
                 "max error (rounding steps)"], rows)
