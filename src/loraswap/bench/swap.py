"""`loraswap bench swap`: four ways of serving a LoRA on one denoiser, in one process.

Variants, interleaved round by round (the order rotates) and repeated:
1. seed1    diffusers `load_lora_adapter` + `fuse_lora` per request, eager (and unfuse +
            delete afterwards), as the Hugging Face Inference API image does;
2. seed2    diffusers + PEFT hotswap: `enable_lora_hotswap(target_rank)`, a first
            adapter, regional compile, then `load_lora_adapter(..., hotswap=True)`;
3. loraswap the fused swap from pristine copies under regional compile, the adapter
            read from disk, from pinned host RAM, or already on the GPU;
4. base     the compiled denoiser with no LoRA: the ceiling.

Each variant has its own copy of the same random-weight denoiser (real config). With
`quantize` (`--quantize fp8`, say) the compiled copies are float8: seed 2 is then a LoRA
kept unfused on a float8 base, loraswap re-quantizes the weights it touches (seed 1,
which merges through PEFT, is left out).
Per-image time is `steps` denoiser calls on fixed inputs (what LoRA serving changes);
text encoders and VAE run once per image whatever the variant and are measured by
`bench serve`. After the rounds, `recompile_swaps` fused swaps of mixed ranks and
target sets, each followed by a denoiser call, count graphs compiled.
"""

import copy
import logging
import tempfile
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from ..adapters.formats import load_adapter
from ..adapters.source import AdapterLocation
from ..engine.quantize import check_mode, quantize_module
from ..engine.swap import FusedSwapper
from ..models import SHAPE_PIPELINES
from ..models.shapes import build_shape_component
from .common import environment, plot_bars, print_table, summary, timed, write_random_adapters, write_results

logger = logging.getLogger(__name__)

DENOISER = {"flux-dev": "transformer", "sdxl": "unet", "sd15": "unet"}
DEFAULT_SPECS = [(128, "all"), (4, "attn"), (64, "all"), (16, "all"), (32, "attn"), (8, "all")]


def denoiser_inputs(shape: str, width: int, height: int, device, dtype) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    if shape == "flux-dev":
        tokens = (height // 16) * (width // 16)
        return dict(hidden_states=rand(1, tokens, 64), encoder_hidden_states=rand(1, 512, 4096),
                    pooled_projections=rand(1, 768), timestep=torch.tensor([0.5], device=device, dtype=dtype),
                    img_ids=torch.zeros(tokens, 3, device=device, dtype=dtype),
                    txt_ids=torch.zeros(512, 3, device=device, dtype=dtype),
                    guidance=torch.tensor([3.5], device=device, dtype=dtype), return_dict=False)
    context = 2048 if shape == "sdxl" else 768
    inputs = dict(sample=rand(2, 4, height // 8, width // 8), timestep=torch.tensor([500.0], device=device),
                  encoder_hidden_states=rand(2, 77, context), return_dict=False)
    if shape == "sdxl":
        inputs["added_cond_kwargs"] = {"text_embeds": rand(2, 1280), "time_ids": rand(2, 6)}
    return inputs


class Denoise:
    """`steps` forward calls of a denoiser on fixed inputs: one image's worth of denoising."""

    def __init__(self, model, inputs, steps):
        self.model, self.inputs, self.steps = model, inputs, steps

    @torch.inference_mode()
    def __call__(self, steps: int | None = None):
        for _ in range(steps or self.steps):
            out = self.model(**self.inputs)[0]
        return out


def graph_count() -> int:
    return counters["stats"]["unique_graphs"]


def make_adapters(shape: str, specs, workdir: Path, kohya_rank: int | None = 64) -> list[Path]:
    """Real-size random adapters (diffusers format; one kohya copy last, to time conversion)."""
    paths = write_random_adapters(shape, specs, workdir)
    if kohya_rank:
        paths += write_random_adapters(shape, [(kohya_rank, "all")], workdir, fmt="kohya", seed=99)
    return paths


def run_swap_bench(shape: str = "flux-dev", width: int = 1024, height: int = 1024, steps: int = 28,
                   rounds: int = 5, recompile_swaps: int = 60, out_dir: Path = Path("bench/results"),
                   workdir: Path | None = None, variants: tuple[str, ...] = ("seed1", "seed2", "loraswap", "base"),
                   specs=DEFAULT_SPECS, quantize: str = "none") -> dict:
    if check_mode(quantize) != "none" and "seed1" in variants:
        raise ValueError("seed 1 merges adapters through PEFT, which cannot merge into float8 weights: "
                         "leave seed1 out of --variants with --quantize")
    device, dtype = torch.device("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16
    if device.type == "cpu":
        dtype = torch.float32
    workdir = Path(workdir or tempfile.mkdtemp(prefix="loraswap-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    import diffusers

    pipeline_cls = getattr(diffusers, SHAPE_PIPELINES[shape])
    prefix = DENOISER[shape]
    results = {"shape": shape, "width": width, "height": height, "steps": steps, "rounds": rounds,
               "quantize": quantize, "env": environment(), "rows": [], "memory_GiB": {}}

    # 1. adapters on disk
    logger.info("writing adapters to %s", workdir)
    paths = make_adapters(shape, specs, workdir)
    kohya_path = paths.pop()
    results["adapters"] = [{"file": p.name, "MiB": round(p.stat().st_size / 2**20, 1)} for p in paths]

    # 2. one random denoiser, copied per variant (same weights)
    torch.manual_seed(0)
    base_model = build_shape_component(shape, prefix, device=device, dtype=dtype)
    inputs = denoiser_inputs(shape, width, height, device, dtype)
    copies = ("seed2", "loraswap") if "seed2" in variants else ("loraswap",)  # base is loraswap's, reset
    models = {name: copy.deepcopy(base_model) for name in copies}
    for model in models.values():
        quantize_module(model, quantize)
    if "seed1" in variants:
        models["seed1"] = base_model
    del base_model
    mem = lambda: torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else 0.0  # noqa: E731
    results["memory_GiB"]["denoiser_copies"] = mem()

    # 3. seed 2: hotswap prepared for the largest rank, first adapter = the widest target set
    max_rank = max(r for r, _ in specs)
    if "seed2" in variants:
        hot = models["seed2"]
        hot.enable_lora_hotswap(target_rank=max_rank)
        hot.load_lora_adapter(str(paths[0]), prefix=prefix, adapter_name="hot")
        hot.compile_repeated_blocks(fullgraph=True)
    # 4. loraswap: fused swapper on the compiled copy; adapters parsed once for the host and GPU tiers
    fused = models["loraswap"]
    swapper = FusedSwapper({prefix: fused})
    fused.compile_repeated_blocks(fullgraph=True)

    unet_config = fused.config if prefix == "unet" else None  # SDXL kohya files number blocks as SGM does

    def parse(path):
        return swapper.bind(load_adapter(AdapterLocation(path.stem, path, None), pipeline_cls,
                                         swapper.component_modules, 2**40, unet_config))

    bound = [parse(p) for p in paths]
    host = [b.to("cpu", dtype, pin_memory=device.type == "cuda") for b in bound]
    gpu = [b.to(device, dtype) for b in bound]
    results["memory_GiB"]["after_adapter_caches"] = mem()

    denoise = {name: Denoise(model, inputs, steps) for name, model in models.items()}
    denoise["base"] = denoise["loraswap"]
    # 5. warm-up (compiles)
    for name in ("seed2", "loraswap"):
        if name in variants:
            seconds, _ = timed(lambda: denoise[name](2))
            results[f"warmup_{name}_s"] = seconds
            logger.info("warm-up %s: %.1f s", name, seconds)
    if "seed1" in denoise:
        timed(lambda: denoise["seed1"](1))
    for adapter in gpu:  # pristine copies are made on first touch: keep that one-time cost out of the rounds
        swapper.apply([(adapter, 1.0)])
    swapper.reset()
    graphs_after_warmup = graph_count()

    applied = {"seed1": None}

    def swap_seed1(i):
        model, previous = models["seed1"], applied["seed1"]
        if previous is not None:
            model.unfuse_lora()
            model.delete_adapters(previous)
        name = f"a{i}_{len(results['rows'])}"
        model.load_lora_adapter(str(paths[i]), prefix=prefix, adapter_name=name)
        model.fuse_lora(adapter_names=[name])
        applied["seed1"] = name

    def swap_seed2(i):
        models["seed2"].load_lora_adapter(str(paths[i]), prefix=prefix, adapter_name="hot", hotswap=True)

    # 6. interleaved rounds
    order = [v for v in ("seed1", "seed2", "loraswap", "base") if v in variants]
    n = len(paths)
    for r in range(rounds):
        rotated = order[r % len(order):] + order[: r % len(order)]
        for variant in rotated:
            i = (r + 1) % n  # round 0 would re-apply seed 2's first adapter: start at 1
            row = {"round": r, "variant": variant, "adapter": paths[i].name}
            if variant == "seed1":
                row["swap_disk_s"], _ = timed(lambda: swap_seed1(i))
            elif variant == "seed2":
                row["swap_disk_s"], _ = timed(lambda: swap_seed2(i))
            elif variant == "loraswap":
                row["swap_disk_s"], _ = timed(lambda: swapper.apply([(parse(paths[i]), 1.0)]))
                j = (i + 1) % n
                row["swap_host_s"], _ = timed(lambda: swapper.apply([(host[j], 1.0)]))
                row["swap_host_adapter"] = paths[j].name
                k = (i + 2) % n
                row["swap_gpu_s"], _ = timed(lambda: swapper.apply([(gpu[k], 1.0)]))
                row["swap_gpu_adapter"] = paths[k].name
            else:
                row["swap_gpu_s"], _ = timed(swapper.reset)
            row["image_s"], _ = timed(denoise[variant])
            results["rows"].append(row)
            logger.info("round %d %-8s swap %s image %.3f s", r, variant,
                        {k: round(v * 1e3, 1) for k, v in row.items() if k.startswith("swap_") and
                         isinstance(v, float)}, row["image_s"])

    # 7. swap-only figures: rank-64 all-linear from host RAM and GPU, with the one-pass
    #    kernel and with `addmm` (interleaved), kohya from disk
    r64 = next((i for i, (r, t) in enumerate(specs) if r == 64 and t == "all"), None)
    if r64 is not None:
        other = (r64 + 1) % n
        times = {}
        for _ in range(10):
            for tier, cache in (("host", host), ("gpu", gpu)):
                for kernel in (True, False):
                    swapper.kernel = swapper.float8_kernel = kernel
                    swapper.apply([(cache[other], 1.0)])
                    seconds, _ = timed(lambda: swapper.apply([(cache[r64], 1.0)]))
                    times.setdefault(f"swap_r64_all_{tier}{'' if kernel else '_addmm'}", []).append(seconds)
        swapper.kernel = swapper.float8_kernel = True
        results.update({key: summary(values) for key, values in times.items()})
    kohya_times = [timed(lambda: swapper.apply([(parse(kohya_path), 1.0)]))[0] for _ in range(3)]
    results["swap_r64_all_kohya_disk"] = summary(kohya_times)

    # 8. recompiles over many mixed swaps (+ a forward after each), fused and hotswap
    graphs = graph_count()
    for s in range(recompile_swaps):
        swapper.apply([(gpu[s % n], 1.0)] if s % 7 else [(gpu[s % n], 0.6), (gpu[(s + 3) % n], 0.5)])
        denoise["loraswap"](1)
    results["recompile_check"] = {"swaps": recompile_swaps, "graphs_compiled": graph_count() - graphs,
                                  "graphs_compiled_during_rounds": graphs - graphs_after_warmup}
    swapper.reset()
    results["memory_GiB"]["pristine_copies"] = swapper.pristine_bytes / 2**30
    if device.type == "cuda":
        results["memory_GiB"]["peak"] = torch.cuda.max_memory_allocated() / 2**30
    results["summary"] = _summarise(results)
    _report(results, out_dir)
    return results


def _summarise(results: dict) -> dict:
    rows = results["rows"]
    out = {}
    for variant in ("seed1", "seed2", "loraswap", "base"):
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


def _report(results: dict, out_dir: Path) -> None:
    s = results["summary"]
    ms = lambda d, k: f"{d[k]['p50'] * 1e3:.1f} ({d[k]['min'] * 1e3:.0f}-{d[k]['max'] * 1e3:.0f})" \
        if k in d else "-"  # noqa: E731
    rows = [[v, ms(d, "swap_disk_s"), ms(d, "swap_host_s"), ms(d, "swap_gpu_s"), f"{d['image_s']['p50']:.3f}",
             f"{d.get('vs_compiled_base', float('nan')):.3f}"] for v, d in s.items()]
    quantized = "" if results["quantize"] == "none" else f"-{results['quantize']}"
    name = f"swap-{results['shape']}{quantized}"
    title = (f"bench swap {results['shape']}{quantized} {results['width']}x{results['height']} {results['steps']} "
             f"steps, {results['rounds']} rounds ({results['env'].get('gpu', 'cpu')})")
    results["table"] = print_table(title, ["variant", "swap disk ms p50 (range)", "swap host ms", "swap GPU ms",
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
