"""`loraswap bench swap`: four ways of serving a LoRA on one denoiser, in one process.

Variants, interleaved round by round (the order rotates) and repeated:
1. load-and-fuse  diffusers `load_lora_adapter` + `fuse_lora` per request, eager (and
                  unfuse + unload before the next), as the Hugging Face Inference API image does;
2. hotswap        diffusers + PEFT hotswap: `enable_lora_hotswap(target_rank)`, a zero
                  placeholder adapter of the highest rank on every targeted layer, regional
                  compile, then `load_lora_adapter(..., hotswap=True)`;
3. fused          loraswap's fused swap from pristine copies under regional compile, the
                  adapter read from disk, from pinned host RAM, or already on the GPU;
4. base           the compiled denoiser with no LoRA: the ceiling.

The baselines are the engine's own swappers (`engine/swap/baselines.py`) driving a bare
denoiser. Each variant has its own copy of the same random-weight denoiser (real config,
or a tiny preset's denoiser for a quick run on CPU). With `quantize` (`--quantize fp8`,
say) the compiled copies are float8: hotswap is then a LoRA kept unfused on a float8
base, the fused swap re-quantizes the weights it touches; load-and-fuse, which merges
through PEFT and cannot merge into float8, runs in full precision, as a server using
diffusers' loader would. Per-image time is `steps` denoiser calls on fixed inputs
(what LoRA serving changes); text encoders and VAE run once per image whatever the
variant and are measured by `bench serve`. After the rounds, `recompile_swaps` fused
swaps of mixed ranks and target sets, each followed by a denoiser call, count graphs
compiled.
"""

import logging
import tempfile
from pathlib import Path

import torch

from loraswap.bench.common import environment, on_device_column, plot_bars, print_table, summary, timed, write_results
from loraswap.bench.swap_setup import (
    DenoiserLoRA,
    bound_reader,
    build_denoiser,
    denoiser_inputs,
    make_adapters,
    make_baseline,
)
from loraswap.engine.quantize.weights import check_mode, quantize_module
from loraswap.engine.startup.compile import graph_count
from loraswap.engine.swap.fused import FusedSwapper
from loraswap.progress import tracked

logger = logging.getLogger(__name__)

VARIANTS = ("load-and-fuse", "hotswap", "fused", "base")
DEFAULT_SPECS = [(128, "all"), (4, "attn"), (64, "all"), (16, "all"), (32, "attn"), (8, "all")]


class Denoise:
    """`steps` forward calls of a denoiser on fixed inputs: one image's worth of denoising."""

    def __init__(self, model, inputs, steps):
        self.model, self.inputs, self.steps = model, inputs, steps

    @torch.inference_mode()
    def __call__(self, steps: int | None = None):
        for _ in range(steps or self.steps):
            out = self.model(**self.inputs)[0]
        return out


class SwapBench:
    """The variants' models, adapters and swappers; `run` measures them."""

    def __init__(self, architecture, width, height, steps, variants, specs, quantize, workdir: Path):
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.variants, self.specs = variants, specs
        self.results = {"shape": architecture, "width": width, "height": height, "steps": steps, "quantize": quantize,
                        "env": environment(), "rows": [], "memory_GiB": {}}
        # 1. adapters on disk (one kohya copy last, to time conversion)
        logger.info("writing adapters to %s", workdir)
        self.paths = make_adapters(architecture, specs, workdir)
        self.kohya_path = self.paths.pop()
        self.results["adapters"] = [{"file": p.name, "MiB": round(p.stat().st_size / 2**20, 1)} for p in self.paths]
        # 2. one random denoiser per variant, each built from the same seed (same weights)
        self.models, self.prefix, pipeline_cls = build_variants(architecture, variants, quantize, self.device,
                                                                self.dtype)
        inputs = denoiser_inputs(self.models["fused"], width, height, self.device, self.dtype)
        self.results["memory_GiB"]["denoiser_copies"] = self._memory()
        # 3. the swappers: the baselines on their copies, the fused swap on its own
        self.swappers = {name: make_baseline(name, DenoiserLoRA(self.models[name], self.prefix), max(specs)[0])
                         for name in ("load-and-fuse", "hotswap") if name in variants}
        self.fused = FusedSwapper({self.prefix: self.models["fused"]})
        self.read = bound_reader(pipeline_cls, self.prefix, self.models["fused"], self.fused.layers)
        self.denoise = {name: Denoise(model, inputs, steps) for name, model in self.models.items()}
        self.denoise["base"] = self.denoise["fused"]

    def _memory(self) -> float:
        return torch.cuda.memory_allocated() / 2**30 if self.device.type == "cuda" else 0.0

    # ---------------------------------------------------------------- phases
    def prepare(self) -> None:
        """Compile, cache the adapters in host RAM and on the GPU, warm up."""
        if "hotswap" in self.swappers:
            self.swappers["hotswap"].prepare_to_compile()
            self.models["hotswap"].compile_repeated_blocks(fullgraph=True)
        self.models["fused"].compile_repeated_blocks(fullgraph=True)
        bound = [self.read(p) for p in self.paths]
        self.host = [b.to("cpu", self.dtype, pin_memory=self.device.type == "cuda") for b in bound]
        self.gpu = [b.to(self.device, self.dtype) for b in bound]
        self.results["memory_GiB"]["after_adapter_caches"] = self._memory()
        for name in ("hotswap", "fused"):
            if name in self.variants:
                seconds, _ = timed(lambda: self.denoise[name](2))
                self.results[f"warmup_{name}_s"] = seconds
                logger.info("warm-up %s: %.1f s", name, seconds)
        if "load-and-fuse" in self.denoise:
            timed(lambda: self.denoise["load-and-fuse"](1))
        for adapter in self.gpu:  # pristine copies are made on first touch: keep that one-time cost out
            self.fused.apply([(adapter, 1.0)])
        self.fused.restore_base()
        self.graphs_after_warmup = graph_count()

    def rounds(self, rounds: int) -> None:
        """Interleaved rounds: each variant swaps (where it swaps) and makes an image."""
        order = [v for v in VARIANTS if v in self.variants]
        n = len(self.paths)
        for r in tracked(range(rounds), "rounds"):
            rotated = order[r % len(order):] + order[: r % len(order)]
            for variant in rotated:
                i = r % n
                row = {"round": r, "variant": variant, "adapter": self.paths[i].name, **self._swap(variant, i)}
                row["image_s"], _ = timed(self.denoise[variant])
                self.results["rows"].append(row)
                logger.info("round %d %-13s swap %s image %.3f s", r, variant,
                            {k: round(v * 1e3, 1) for k, v in row.items() if k.startswith("swap_")
                             and isinstance(v, float)}, row["image_s"])

    def _swap(self, variant: str, i: int) -> dict:
        if variant in self.swappers:
            location = DenoiserLoRA.location(self.paths[i])
            return {"swap_disk_s": timed(lambda: self.swappers[variant].apply([(location, 1.0)]))[0]}
        if variant == "base":
            return {"swap_gpu_s": timed(self.fused.restore_base)[0]}
        n = len(self.paths)
        j, k = (i + 1) % n, (i + 2) % n
        return {"swap_disk_s": timed(lambda: self.fused.apply([(self.read(self.paths[i]), 1.0)]))[0],
                "swap_host_s": timed(lambda: self.fused.apply([(self.host[j], 1.0)]))[0],
                "swap_host_adapter": self.paths[j].name,
                "swap_gpu_s": timed(lambda: self.fused.apply([(self.gpu[k], 1.0)]))[0],
                "swap_gpu_adapter": self.paths[k].name}

    def swap_only(self) -> None:
        """Rank-64 all-linear swaps from host RAM and GPU, with the one-pass kernel and with
        `addmm` (interleaved); the kohya file from disk."""
        fused, n = self.fused, len(self.paths)
        r64 = next((i for i, (r, t) in enumerate(self.specs) if r == 64 and t == "all"), None)
        if r64 is not None:
            times = {}
            for _ in range(10):
                for tier, cache in (("host", self.host), ("gpu", self.gpu)):
                    for kernel in (True, False):
                        fused.kernel = fused.float8_kernel = kernel
                        fused.apply([(cache[(r64 + 1) % n], 1.0)])
                        seconds, _ = timed(lambda: fused.apply([(cache[r64], 1.0)]))
                        times.setdefault(f"swap_r64_all_{tier}{'' if kernel else '_addmm'}", []).append(seconds)
            fused.kernel = fused.float8_kernel = True
            self.results.update({key: summary(values) for key, values in times.items()})
        kohya = [timed(lambda: fused.apply([(self.read(self.kohya_path), 1.0)]))[0] for _ in range(3)]
        self.results["swap_r64_all_kohya_disk"] = summary(kohya)

    def recompile_check(self, swaps: int) -> None:
        """Mixed fused swaps, a denoiser call after each: graphs compiled must stay 0."""
        graphs, n = graph_count(), len(self.paths)
        for s in range(swaps):
            gpu = self.gpu
            self.fused.apply([(gpu[s % n], 1.0)] if s % 7 else [(gpu[s % n], 0.6), (gpu[(s + 3) % n], 0.5)])
            self.denoise["fused"](1)
        self.results["recompile_check"] = {"swaps": swaps, "graphs_compiled": graph_count() - graphs,
                                           "graphs_compiled_during_rounds": graphs - self.graphs_after_warmup}
        self.fused.restore_base()
        self.results["memory_GiB"]["pristine_copies"] = self.fused.pristine_bytes / 2**30
        if self.device.type == "cuda":
            self.results["memory_GiB"]["peak"] = torch.cuda.max_memory_allocated() / 2**30


def run_swap_bench(architecture: str = "flux-dev", width: int = 1024, height: int = 1024, steps: int = 28,
                   rounds: int = 5, recompile_swaps: int = 60, out_dir: Path = Path("bench/results"),
                   workdir: Path | None = None, variants: tuple[str, ...] = VARIANTS,
                   specs=DEFAULT_SPECS, quantize: str = "none") -> dict:
    check_mode(quantize)
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    workdir = Path(workdir or tempfile.mkdtemp(prefix="loraswap-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    bench = SwapBench(architecture, width, height, steps, variants, specs, quantize, workdir)
    bench.results["rounds"] = rounds
    bench.prepare()
    bench.rounds(rounds)
    bench.swap_only()
    bench.recompile_check(recompile_swaps)
    results = bench.results
    results["summary"] = _summarise(results)
    report_swap_bench(results, out_dir)
    return results


def _summarise(results: dict) -> dict:
    rows = results["rows"]
    out = {}
    for variant in VARIANTS:
        mine = [r for r in rows if r["variant"] == variant]
        if not mine:
            continue
        out[variant] = {"image_s": summary([r["image_s"] for r in mine])}
        for key in ("swap_disk_s", "swap_host_s", "swap_gpu_s"):
            values = [r[key] for r in mine if key in r]
            if values:
                out[variant][key] = summary(values)
    base = out.get("base", {}).get("image_s", {}).get("p50")
    if base:
        for variant in out:
            out[variant]["vs_compiled_base"] = out[variant]["image_s"]["p50"] / base
    return out


def report_swap_bench(results: dict, out_dir: Path) -> None:
    """Print the run's table (kept as `results["table"]`) and write its results and chart to `out_dir`."""
    s = results["summary"]
    ms = lambda d, k: f"{d[k]['p50'] * 1e3:.1f} ({d[k]['min'] * 1e3:.0f}-{d[k]['max'] * 1e3:.0f})" \
        if k in d else "-"  # noqa: E731
    rows = [[v, ms(d, "swap_disk_s"), ms(d, "swap_host_s"), ms(d, "swap_gpu_s"), f"{d['image_s']['p50']:.3f}",
             f"{d.get('vs_compiled_base', float('nan')):.3f}"] for v, d in s.items()]
    quantized = "" if results["quantize"] == "none" else f"-{results['quantize']}"
    name = f"swap-{results['shape']}{quantized}"
    title = (f"bench swap {results['shape']}{quantized} {results['width']}x{results['height']} {results['steps']} "
             f"steps, {results['rounds']} rounds ({results['env'].get('gpu', 'cpu')})")
    results["table"] = print_table(title, ["variant", "swap disk ms p50 (range)", "swap host ms",
                                           on_device_column(results["env"]),
                                           "image s p50", "vs compiled base"], rows)
    for key in ("swap_r64_all_host", "swap_r64_all_gpu", "swap_r64_all_host_addmm", "swap_r64_all_gpu_addmm",
                "swap_r64_all_kohya_disk"):
        if key in results:
            print(f"{key}: p50 {results[key]['p50'] * 1e3:.1f} ms (min {results[key]['min'] * 1e3:.1f}, "
                  f"max {results[key]['max'] * 1e3:.1f})", flush=True)
    print("recompile check:", results["recompile_check"], "memory GiB:", results["memory_GiB"], flush=True)
    write_results(out_dir, name, results)
    plot_bars(out_dir / f"{name}.png", title, list(s), [d["image_s"]["p50"] for d in s.values()],
              "seconds per image (p50)")


def build_variants(architecture: str, variants, quantize: str, device: torch.device,
                   dtype: torch.dtype) -> tuple[dict, str, type]:
    """The variants' denoisers ({variant: model}, the LoRA prefix, the pipeline class), built
    one at a time so that only one full-precision copy is ever being made (a 32 B FLUX.2
    transformer is 64 GB in bf16). Base is fused's, reset. load-and-fuse stays in full
    precision: diffusers cannot merge into float8."""
    models = {}
    for name in ("hotswap", "fused", "load-and-fuse"):
        if name == "fused" or name in variants:
            model, prefix, pipeline_cls = build_denoiser(architecture, device, dtype)
            if name != "load-and-fuse":
                quantize_module(model, quantize)
            models[name] = model
    return models, prefix, pipeline_cls
