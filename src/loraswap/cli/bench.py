"""`loraswap bench ...`: the benchmarks (run them on a GPU; BENCHMARKS.md has their figures)."""

import shlex
from pathlib import Path
from typing import Annotated

import typer

from loraswap.cli.group import PanelsCommand, PanelsGroup
from loraswap.cli.options import setup_logging

bench_app = typer.Typer(cls=PanelsGroup, add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                        help="Benchmarks (run them on a GPU).")

Out = Annotated[Path, typer.Option("--out", help="Folder for JSON and PNG.")]
# `--shape`: the flag's earlier name, still accepted
ArchitectureName = Annotated[str, typer.Option("--architecture", "--shape", help="A real architecture (flux-dev, sdxl, "
                                               "sd15, qwen-image, ...; random weights), or a tiny preset for a "
                                               "quick run.")]
ServedModel = Annotated[str, typer.Option("--model", help="<architecture>-random (sdxl-random, flux-dev-random, "
                                                       "qwen-image-random, ...) or a preset.")]


def _split(text: str) -> tuple[str, ...]:
    """`a, b,c` -> ("a", "b", "c")."""
    return tuple(part.strip() for part in text.split(","))


def _parse_specs(text: str) -> list[tuple[int, str]]:
    """`128:all,4:attn` -> [(128, "all"), (4, "attn")]."""
    specs = []
    for part in text.split(","):
        rank, _, targets = part.strip().partition(":")
        if not rank.isdigit() or targets not in ("attn", "all"):
            raise typer.BadParameter(f"--adapters-spec part {part!r} must look like 64:all or 4:attn")
        specs.append((int(rank), targets))
    return specs


@bench_app.command("swap", cls=PanelsCommand)
def bench_swap(
    architecture: ArchitectureName = "flux-dev",
    width: Annotated[int, typer.Option("--width")] = 1024,
    height: Annotated[int, typer.Option("--height")] = 1024,
    steps: Annotated[int, typer.Option("--steps")] = 28,
    rounds: Annotated[int, typer.Option("--rounds", help="Interleaved rounds of all variants.")] = 5,
    recompile_swaps: Annotated[int, typer.Option("--recompile-swaps", help="Mixed swaps in the recompile check.")]
    = 60,
    specs: Annotated[str, typer.Option("--adapters-spec", help="rank:targets list of the random adapters; "
                                       "the hotswap baseline is prepared for the highest rank on every layer.")]
    = "128:all,4:attn,64:all,16:all,32:attn,8:all",
    variants: Annotated[str, typer.Option("--variants", help="Comma-separated: load-and-fuse, hotswap, fused "
                                          "(loraswap), base (the compiled base model).")]
    = "load-and-fuse,hotswap,fused,base",
    quantize: Annotated[str, typer.Option("--quantize", help="The compiled copies in float8 (fp8, fp8-tensorwise, "
                                          "fp8-weight-only): hotswap is then a LoRA kept unfused on them; "
                                          "load-and-fuse stays in full precision.")] = "none",
    out: Out = Path("bench/results"),
    workdir: Annotated[Path | None, typer.Option("--workdir", help="Where adapters are written.")] = None,
) -> None:
    """Swap time and per-image time: load-and-fuse, hotswap, fused (loraswap), compiled base."""
    from loraswap.bench.swap import run_swap_bench

    setup_logging(False)
    try:
        run_swap_bench(architecture, width, height, steps, rounds, recompile_swaps, out, workdir, _split(variants),
                       _parse_specs(specs), quantize)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


@bench_app.command("kinds", cls=PanelsCommand)
def bench_kinds(
    architecture: ArchitectureName = "flux-dev",
    width: Annotated[int, typer.Option("--width")] = 1024,
    height: Annotated[int, typer.Option("--height")] = 1024,
    steps: Annotated[int, typer.Option("--steps")] = 28,
    rank: Annotated[int, typer.Option("--rank", help="Rank of the LoRA, LoKr and DoRA adapters (LoHa: half, for "
                                      "the same bytes).")] = 32,
    swaps: Annotated[int, typer.Option("--swaps", help="Timed swaps per kind and tier.")] = 10,
    rounds: Annotated[int, typer.Option("--rounds", help="Interleaved image rounds (base and each kind).")] = 3,
    out: Out = Path("bench/results"),
    workdir: Annotated[Path | None, typer.Option("--workdir", help="Where adapters are written.")] = None,
) -> None:
    """Each adapter kind (LoRA, LoHa, LoKr, DoRA) on every linear layer: swap time from host RAM and from the
    GPU, and the image time against the compiled base."""
    from loraswap.bench.kinds import run_kinds_bench

    setup_logging(False)
    run_kinds_bench(architecture, width, height, steps, rank, swaps, rounds, out, workdir)


@bench_app.command("family", cls=PanelsCommand)
def bench_family(
    model: ServedModel = "flux-dev-random",
    rank: Annotated[int, typer.Option("--rank", help="Rank of the all-linear random adapters.")] = 32,
    rounds: Annotated[int, typer.Option("--rounds", help="Rounds of base and adapter images.")] = 3,
    steps: Annotated[int | None, typer.Option("--steps")] = None,
    width: Annotated[int | None, typer.Option("--width")] = None,
    height: Annotated[int | None, typer.Option("--height")] = None,
    frames: Annotated[int | None, typer.Option("--frames", help="Frames of a video model.")] = None,
    quantize: Annotated[str, typer.Option("--quantize", help="The fused engine's denoisers in float8 (fp8, ...); "
                                          "load-and-fuse stays in full precision.")] = "none",
    load_and_fuse: Annotated[bool, typer.Option("--load-and-fuse/--no-load-and-fuse",
                                                help="Also run the load-and-fuse engine after the fused one.")]
    = True,
    out: Out = Path("bench/results"),
    workdir: Annotated[Path | None, typer.Option("--workdir", help="Where adapters are written.")] = None,
) -> None:
    """Any family's full pipeline (images or videos): a LoRA swapped per request against the compiled base, and
    against load-and-fuse per request."""
    from loraswap.bench.family import run_family_bench

    setup_logging(False)
    run_family_bench(model, rank, 3, rounds, steps, width, height, frames, quantize, None, load_and_fuse, out,
                     workdir)


@bench_app.command("options", cls=PanelsCommand)
def bench_options(
    architecture: ArchitectureName = "sdxl",
    variants: Annotated[str, typer.Option("--variants", help="Comma-separated ATTENTION@MODE or "
                                          "ATTENTION@MODE@QUANTIZE, e.g. "
                                          "native@default,_native_cudnn@default,native@reduce-overhead,"
                                          "native@default@fp8-tensorwise.")]
    = "native@default,_native_cudnn@default,_native_flash@default,native@reduce-overhead",
    width: Annotated[int, typer.Option("--width")] = 1024,
    height: Annotated[int, typer.Option("--height")] = 1024,
    steps: Annotated[int, typer.Option("--steps")] = 25,
    rounds: Annotated[int, typer.Option("--rounds", help="Interleaved rounds of all variants.")] = 4,
    out: Out = Path("bench/results"),
    workdir: Annotated[Path | None, typer.Option("--workdir", help="Where adapters are written.")] = None,
) -> None:
    """Per-image time under attention backends, compile modes and float8 quantization, a LoRA swapped before each
    image."""
    from loraswap.bench.options import run_options_bench

    setup_logging(False)
    try:
        run_options_bench(architecture, _split(variants), width, height, steps, rounds, out, workdir)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


@bench_app.command("serve", cls=PanelsCommand)
def bench_serve(
    model: ServedModel = "sdxl-random",
    num_ids: Annotated[int, typer.Option("--adapters-count", help="Adapter ids in the Zipf stream.")] = 2500,
    requests: Annotated[int, typer.Option("--requests", help="Requests per run.")] = 24,
    concurrency: Annotated[int, typer.Option("--concurrency", help="Clients in the concurrent run.")] = 4,
    steps: Annotated[int, typer.Option("--steps")] = 25,
    width: Annotated[int, typer.Option("--width")] = 1024,
    height: Annotated[int, typer.Option("--height")] = 1024,
    modes: Annotated[str, typer.Option("--modes", help="Comma-separated servers: fused (loraswap), ray (the same "
                                       "on Ray Serve, one replica), load-and-fuse (the baseline).")]
    = "fused,load-and-fuse",
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Passes round the servers (all started first); "
                                        "the table gives medians over rounds.")] = 1,
    out: Out = Path("bench/results"),
    fused_args: Annotated[str, typer.Option("--fused-args", help="Extra `loraswap serve` flags for loraswap's "
                                            "servers (fused, ray) only, e.g. '--compile-mode reduce-overhead'.")]
    = "",
    workdir: Annotated[Path | None, typer.Option("--workdir", help="Adapters and server logs.")] = None,
) -> None:
    """Latency and throughput of the HTTP server under a Zipf stream, against the load-and-fuse
    baseline and on Ray Serve."""
    from loraswap.bench.serve import run_serve_bench

    setup_logging(False)
    run_serve_bench(model, num_ids, requests, concurrency, steps, width, height, workdir, out, _split(modes),
                    fused_args=tuple(shlex.split(fused_args)), rounds=rounds)


@bench_app.command("startup", cls=PanelsCommand)
def bench_startup(
    model: ServedModel = "sdxl-random",
    compile_cache: Annotated[Path | None, typer.Option("--compile-cache", help="An empty or new folder for the "
                                                       "caches (default: a new one under --workdir).")] = None,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Cold + warm pairs, each on a new cache.")] = 1,
    steps: Annotated[int, typer.Option("--steps", help="Steps of the first request after ready.")] = 2,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    serve_args: Annotated[str, typer.Option("--serve-args", help="More loraswap serve flags, e.g. "
                                            "'--compile-mode max-autotune-no-cudagraphs'.")] = "",
    out: Out = Path("bench/results"),
    workdir: Annotated[Path | None, typer.Option("--workdir", help="Server logs and the default cache.")] = None,
) -> None:
    """Time to the first image after a restart: cold, then with the compile cache the cold start filled."""
    from loraswap.bench.startup import run_startup_bench

    setup_logging(False)
    try:
        run_startup_bench(model, compile_cache, rounds, steps, device, serve_args, out, workdir)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
