"""`loraswap bench options`: one denoiser's per-image time under attention backends,
torch.compile modes and float8 quantization, with a LoRA swapped before every image.

Each variant, `ATTENTION@MODE[@QUANTIZE]` (`native@default`, `_native_cudnn@default`,
`native@reduce-overhead`, `native@default@fp8-tensorwise`, ...), is its own copy of the
same random-weight denoiser (real config) with its backend set, quantized as `--quantize`
would, and compiled in its mode. Each variant's output with the same adapter is compared
with the first variant's (`rel_diff_vs_first`). Rounds are interleaved (the order
rotates). Before every image a fused swap writes another adapter into the variant's
weights in place, so the figures are LoRA serving, and the CUDA-graph variants show
whether a swap re-records a graph (`cuda_graphs_recorded`) or recompiles one.
"""

import copy
import logging
import tempfile
from pathlib import Path

import torch

from loraswap.bench.common import (
    environment,
    plot_bars,
    print_table,
    summary,
    timed,
    write_random_adapters,
    write_results,
)
from loraswap.bench.swap import Denoise
from loraswap.bench.swap_setup import bound_reader, build_denoiser, denoiser_inputs
from loraswap.engine.config.compilation import check_backend_name
from loraswap.engine.quantize.weights import check_mode, quantize_module
from loraswap.engine.startup.attention import AttentionBackend
from loraswap.engine.startup.compile import compile_denoiser, graph_count
from loraswap.engine.swap.fused import FusedSwapper
from loraswap.progress import tracked

logger = logging.getLogger(__name__)

MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")


def parse_variant(text: str) -> tuple[str, str, str]:
    """`ATTENTION@MODE[@QUANTIZE]` -> (backend, compile mode, quantization); any part may be
    left out (native, default, none)."""
    attention, _, rest = text.strip().partition("@")
    mode, _, quantize = rest.partition("@")
    mode = mode or "default"
    if mode not in MODES:
        raise ValueError(f"unknown compile mode '{mode}' in '{text}'; choose one of {', '.join(MODES)}")
    return check_backend_name(attention or "native"), mode, check_mode(quantize or "none")


def cuda_graphs_recorded() -> int:
    """CUDA graphs recorded so far by torch.compile's CUDA-graph trees on this device."""
    if not torch.cuda.is_available():
        return 0
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    if manager is None or manager.roots is None:
        return 0
    count, stack = 0, [node for nodes in manager.roots.values() for node in nodes]
    while stack:
        node = stack.pop()
        count += 1
        stack.extend(child for children in node.children.values() for child in children)
    return count


class Variant:
    """One compiled (and maybe quantized) copy of the denoiser, its attention backend and
    its swapper."""

    def __init__(self, name: str, base: torch.nn.Module, prefix: str, inputs: dict, steps: int):
        self.name = name
        attention, mode, quantize = parse_variant(name)
        self.model = copy.deepcopy(base)
        quantize_module(self.model, quantize)
        self.attention = AttentionBackend(attention, {prefix: self.model})
        compile_denoiser(self.model, mode)
        self.swapper = FusedSwapper({prefix: self.model})
        self.denoise = Denoise(self.model, inputs, steps)

    def image(self, steps: int | None = None):
        with self.attention.context():
            return self.denoise(steps)


def run_options_bench(architecture: str = "sdxl",
                      variants: tuple[str, ...] = ("native@default", "_native_cudnn@default"),
                      width: int = 1024, height: int = 1024, steps: int = 25, rounds: int = 4,
                      out_dir: Path = Path("bench/results"), workdir: Path | None = None) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    attentions = {parse_variant(name)[0] for name in variants}  # refuses a typo before minutes of building
    if len(attentions) > 1:
        # the UNets' SDPA kernel is chosen outside the compiled graphs, which do not re-check
        # it, and copies of one model share compiled blocks: one backend per process
        raise ValueError(f"one attention backend per run (got {', '.join(sorted(attentions))}): compiled copies "
                         "of one model share their kernels; run one `bench options` per backend")
    results = {"shape": architecture, "width": width, "height": height, "steps": steps, "rounds": rounds,
               "env": environment(), "variants": list(variants), "rows": []}
    # 1. one random denoiser, copied per variant; two real-size adapters to alternate
    base, prefix, pipeline_cls = build_denoiser(architecture, device, dtype)
    inputs = denoiser_inputs(base, width, height, device, dtype)
    built = {name: Variant(name, base, prefix, inputs, steps) for name in variants}
    del base
    workdir = Path(workdir or tempfile.mkdtemp(prefix="loraswap-bench-options-"))
    paths = write_random_adapters(architecture, [(16, "all"), (32, "attn")], workdir)
    adapters = {name: [bound_reader(pipeline_cls, prefix, v.model, v.swapper.layers)(p).to(device, dtype)
                       for p in paths] for name, v in built.items()}
    # 2. warm-up: compile (and record) with both adapters
    for name, variant in built.items():
        results[f"warmup_{name}_s"] = 0.0
        for adapter in adapters[name]:
            variant.swapper.apply([(adapter, 1.0)])
            results[f"warmup_{name}_s"] += timed(lambda: variant.image(2))[0]
    graphs, recorded = graph_count(), cuda_graphs_recorded()
    # 3. interleaved rounds, a swap before each image
    order = list(variants)
    for r in tracked(range(rounds), "rounds"):
        for name in order[r % len(order):] + order[: r % len(order)]:
            variant = built[name]
            swap_s = variant.swapper.apply([(adapters[name][r % 2], 1.0)])
            image_s, _ = timed(variant.image)
            results["rows"].append({"round": r, "variant": name, "swap_s": swap_s, "image_s": image_s})
            logger.info("round %d %-32s swap %.1f ms image %.3f s", r, name, swap_s * 1e3, image_s)
    results["graphs_compiled_during_rounds"] = graph_count() - graphs
    results["cuda_graphs_recorded_during_rounds"] = cuda_graphs_recorded() - recorded
    # 4. numerics: one denoiser call of each variant with the first adapter, against the first variant's
    outputs = {}
    for name, variant in built.items():
        variant.swapper.apply([(adapters[name][0], 1.0)])
        outputs[name] = variant.image(1).float().clone()  # a CUDA-graph output is overwritten by the next replay
    reference = outputs[variants[0]]
    results["rel_diff_vs_first"] = {name: float((out - reference).norm() / reference.norm())
                                    for name, out in outputs.items()}
    results["summary"] = {name: summary([row["image_s"] for row in results["rows"] if row["variant"] == name])
                          for name in variants}
    _report(results, out_dir)
    return results


def _report(results: dict, out_dir: Path) -> None:
    s = results["summary"]
    first = s[results["variants"][0]]["p50"]
    rows = [[name, f"{d['p50']:.3f}", f"{d['min']:.3f}-{d['max']:.3f}", f"{d['p50'] / first:.3f}",
             f"{results['rel_diff_vs_first'][name]:.4f}"] for name, d in s.items()]
    name = f"options-{results['shape']}"
    title = (f"bench options {results['shape']} {results['width']}x{results['height']} {results['steps']} steps, "
             f"{results['rounds']} rounds, a swap before each image ({results['env'].get('gpu', 'cpu')})")
    results["table"] = print_table(title, ["attention@mode@quantize", "image s p50", "range", "vs first",
                                           "rel. diff vs first"], rows)
    print(f"graphs compiled during the rounds: {results['graphs_compiled_during_rounds']}; CUDA graphs recorded "
          f"during the rounds: {results['cuda_graphs_recorded_during_rounds']}", flush=True)
    write_results(out_dir, name, results)
    plot_bars(out_dir / f"{name}.png", title, list(s), [d["p50"] for d in s.values()], "seconds per image (p50)")
