"""`loraswap`: serve, generate, inspect and make adapters, benchmark.

Every flag can also come from the environment as `LORASWAP_<NAME>` (e.g.
LORASWAP_MODEL, LORASWAP_ADAPTERS, LORASWAP_PORT).
"""

import json
import logging
import shlex
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from .errors import LoraswapError

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
adapters_app = typer.Typer(no_args_is_help=True, help="Inspect adapters and make random ones.")
app.add_typer(adapters_app, name="adapters")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (run them on a GPU).")
app.add_typer(bench_app, name="bench")


def _opt(*names: str, help: str, env: str | None = None, **kwargs):
    """An option whose value may also come from LORASWAP_<NAME>."""
    env = env or "LORASWAP_" + names[0].lstrip("-").replace("-", "_").upper()
    return typer.Option(*names, help=help, envvar=env, **kwargs)


Model = Annotated[str, _opt("--model", help="Preset (tiny-sd, tiny-sdxl, tiny-flux), hub id or local folder.")]
AdaptersDir = Annotated[Path | None, _opt("--adapters", help="Folder of .safetensors adapters.")]
Device = Annotated[str, _opt("--device", help="auto, cpu or cuda.")]


def _parse_lora(spec: str) -> tuple[str, float]:
    """`ID[:WEIGHT]` -> (id, weight)."""
    adapter_id, _, weight = spec.strip().partition(":")
    try:
        return adapter_id.strip(), float(weight) if weight else 1.0
    except ValueError:
        raise typer.BadParameter(f"--lora {spec!r}: the weight after ':' must be a number") from None


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@app.callback()
def _quiet_libraries() -> None:
    """Libraries' own warnings (dtype casts, load reports) are noise for users."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()


CompileMode = Annotated[str, _opt("--compile-mode", help="torch.compile mode: default, max-autotune-no-cudagraphs, "
                                  "reduce-overhead or max-autotune (CUDA graphs: the whole denoiser).")]
Quantize = Annotated[str, _opt("--quantize", help="Denoiser weights in float8 (torchao): none, fp8 (weights and "
                                "activations, row-wise scales; CUDA 8.9+), fp8-tensorwise (one scale per "
                                "tensor) or fp8-weight-only.")]
Attention = Annotated[str | None, _opt("--attention", help="Attention backend of diffusers' dispatcher (native, "
                                       "_native_cudnn, _native_flash, flex, ...; default: diffusers').")]
CompileVae = Annotated[bool | None, _opt("--compile-vae/--no-compile-vae", help="With --compile, also compile the "
                                         "VAE decoder: a faster decode, a longer start-up (default: with the "
                                         "CUDA-graph compile modes only).")]
CompileWhileLoading = Annotated[bool, _opt("--compile-while-loading/--no-compile-while-loading", help="A local "
                                            "diffusers folder with regional compile: build the modules, then "
                                            "compile a stand-in for the denoiser (FLUX.1) while the weights are "
                                            "copied in (experimental; default off).")]
CompileCache = Annotated[Path | None, _opt("--compile-cache", help="Folder for torch.compile's caches (FX graphs, "
                                           "AOTAutograd, Triton kernels, autotuning), kept across restarts: a "
                                           "restarted process compiles from it.")]


@app.command()
def serve(
    model: Annotated[list[str] | None, _opt("--model", help="Preset, hub id or local folder; repeat to host "
                                            "several base models (the first is the default).")] = None,
    adapters: AdaptersDir = None,
    host: Annotated[str, _opt("--host", help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, _opt("--port", help="TCP port.")] = 8888,
    device: Device = "auto",
    dtype: Annotated[str, _opt("--dtype", help="auto, float32, float16 or bfloat16.")] = "auto",
    compile: Annotated[bool | None, _opt("--compile/--no-compile", help="Regional torch.compile (default: on CUDA).",
                                         env="LORASWAP_COMPILE")] = None,
    compile_mode: CompileMode = "default",
    compile_vae: CompileVae = None,
    compile_while_loading: CompileWhileLoading = False,
    attention: Attention = None,
    quantize: Quantize = "none",
    quantize_text_encoders: Annotated[str, _opt("--quantize-text-encoders", help="Text encoders' weights in float8: "
                                               "none or fp8-weight-only (the low-memory mode).")] = "none",
    pristine: Annotated[str, _opt("--pristine", help="Where pristine copies of swapped weights live: device, or "
                                  "host (pinned RAM; the low-memory mode).")] = "device",
    max_gpu_memory_gb: Annotated[float | None, _opt("--max-gpu-memory-gb", help="Cap this process's GPU memory "
                                                    "(a 24 GB card on a larger one).")] = None,
    compile_cache: CompileCache = None,
    swap_mode: Annotated[str, _opt("--swap-mode", help="fused (loraswap) or diffusers (seed 1's load + fuse per "
                                   "request, eager: a benchmark baseline).")] = "fused",
    max_queue: Annotated[int, _opt("--max-queue", help="Requests waiting before 503.")] = 32,
    max_batch: Annotated[int, _opt("--max-batch", help="Requests with the same adapters and parameters batched "
                                   "into one pipeline call.")] = 1,
    max_wait_s: Annotated[float, _opt("--max-wait-s", help="Fairness: a request waiting this long goes next.")] = 30.0,
    max_skips: Annotated[int, _opt("--max-skips", help="Fairness: a request passed over this often goes next.")] = 8,
    host_cache_mb: Annotated[float, _opt("--host-cache-mb", help="Host RAM for ready adapters, MiB.")] = 8192,
    gpu_cache_mb: Annotated[float, _opt("--gpu-cache-mb", help="GPU memory for adapter copies, MiB.")] = 2048,
    prefetch_threads: Annotated[int, _opt("--prefetch-threads", help="Threads reading adapters ahead.")] = 4,
    max_width: Annotated[int, _opt("--max-width", help="Largest width.")] = 2048,
    max_height: Annotated[int, _opt("--max-height", help="Largest height.")] = 2048,
    max_steps: Annotated[int, _opt("--max-steps", help="Most steps.")] = 100,
    max_prompt_chars: Annotated[int, _opt("--max-prompt-chars", help="Longest prompt.")] = 2000,
    max_blend: Annotated[int, _opt("--max-blend", help="Most adapters blended per request.")] = 4,
    max_rank: Annotated[int, _opt("--max-rank", help="Highest LoRA rank accepted.")] = 1024,
    max_adapter_mb: Annotated[float, _opt("--max-adapter-mb", help="Largest adapter file, MiB.")] = 2048,
    max_body_kb: Annotated[int, _opt("--max-body-kb", help="Largest request body, KiB.")] = 64,
    hub: Annotated[bool, _opt("--hub", help="Also serve hub adapters (owner/name[@revision]); HF_HUB_OFFLINE=1 "
                              "serves them from the huggingface_hub cache alone.")] = False,
    hub_allow: Annotated[list[str] | None, _opt("--hub-allow", help="fnmatch pattern of hub ids served; "
                                                "repeatable (default: all).")] = None,
    hub_deny: Annotated[list[str] | None, _opt("--hub-deny", help="fnmatch pattern of hub ids refused; "
                                               "repeatable.")] = None,
    demo_adapters: Annotated[bool, _opt("--demo-adapters", help="Write a few random adapters for the model into "
                                        "--adapters if it has none (for trying the server).")] = False,
    ray: Annotated[bool, _opt("--ray", help="Serve on Ray Serve: an HTTP ingress and, per model, --replicas "
                              "replicas of one GPU each (CPU without GPUs), routed by adapter (docs/ray.md).")] = False,
    replicas: Annotated[int, _opt("--replicas", min=1, help="--ray: replicas per model.")] = 1,
    max_adapters: Annotated[int, _opt("--max-adapters", min=1, help="--ray: adapters held per replica; the least "
                                      "recently used is evicted past this.")] = 32,
    ray_address: Annotated[str | None, _opt("--ray-address", help="--ray: the Ray cluster to join (default: "
                                            "RAY_ADDRESS, else a new local one).", env="RAY_ADDRESS")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Serve the model over HTTP (Hugging Face Inference API and OpenAI images API)."""
    import uvicorn

    from .adapters.cache import CacheConfig
    from .engine.config import EngineConfig
    from .engine.worker import SchedulerConfig
    from .server.app import create_app
    from .server.config import ServerConfig

    _setup_logging(verbose)
    models = model or ["tiny-sd"]
    if demo_adapters:
        if adapters is None:
            raise typer.BadParameter("--demo-adapters needs --adapters DIR to write into")
        write_demo_adapters(models[0], adapters)
    config_cls, engine_cls, per_model = ServerConfig, EngineConfig, {}
    if ray:
        cluster = _import_cluster()
        config_cls, engine_cls = cluster.ClusterConfig, cluster.ModelDeploymentConfig
        per_model = {"replicas": replicas, "max_adapters": max_adapters}
    try:
        config = config_cls(
            engines=[engine_cls(model=name, adapters=adapters, device=device, dtype=dtype, compile=compile,
                                compile_mode=compile_mode, compile_vae=compile_vae,
                                compile_while_loading=compile_while_loading, attention=attention,
                                compile_cache=compile_cache,
                                quantize=quantize, quantize_text_encoders=quantize_text_encoders,
                                pristine=pristine, max_gpu_memory_gb=max_gpu_memory_gb,
                                swap_mode=swap_mode, hub=hub,
                                hub_allow=hub_allow or ["*"], hub_deny=hub_deny or [], max_blend=max_blend,
                                max_rank=max_rank, max_adapter_mb=max_adapter_mb,
                                cache=CacheConfig(host_bytes=int(host_cache_mb * 2**20),
                                                  gpu_bytes=int(gpu_cache_mb * 2**20)),
                                prefetch_threads=prefetch_threads, **per_model) for name in models],
            scheduler=SchedulerConfig(max_queue=max_queue, max_batch=max_batch, max_wait_s=max_wait_s,
                                      max_skips=max_skips),
            host=host, port=port, max_width=max_width, max_height=max_height,
            max_steps=max_steps, max_prompt_chars=max_prompt_chars, max_body_bytes=max_body_kb * 1024)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if ray:
        cluster.run(config, address=ray_address)
        return
    # uvicorn finishes in-flight requests on SIGTERM, then re-raises the signal to the handler
    # it found: make that one a clean exit, so a graceful stop exits 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(create_app(config), host=host, port=port, log_level="info", timeout_graceful_shutdown=60)


@app.command()
def deploy(
    config_file: Annotated[Path, typer.Argument(help="YAML: a ClusterConfig (server fields, `engines` with "
                                                "replicas), or a Serve config file using "
                                                "loraswap.cluster:app_builder.", exists=True, dir_okay=False)],
    address: Annotated[str | None, _opt("--address", help="The Ray cluster (default: RAY_ADDRESS, else a new "
                                        "local one).", env="RAY_ADDRESS")] = None,
    detach: Annotated[bool, typer.Option("--detach", help="Return once healthy and leave it running on the "
                                         "cluster (needs --address).")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Deploy loraswap on Ray Serve from a YAML file and serve until SIGTERM (docs/ray.md)."""
    _setup_logging(verbose)
    cluster = _import_cluster()
    try:
        config = cluster.load_config(config_file)
    except ValueError as e:  # pydantic's errors are ValueErrors too
        raise typer.BadParameter(str(e)) from None
    try:
        cluster.run(config, address=address, detach=detach)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _import_cluster():
    try:
        from . import cluster
    except ImportError as e:
        typer.echo(f"error: Ray Serve is not installed ({e}); pip install 'loraswap[ray]'", err=True)
        raise typer.Exit(2) from None
    return cluster


DEMO_ADAPTERS = (("demo/watercolor", 4, "attn"), ("demo/neon", 16, "all"), ("demo/sketch", 64, "all"))


def write_demo_adapters(model: str, folder: Path) -> None:
    """A few random adapters for `model`, written once (a folder with adapters is left alone)."""
    from safetensors.torch import save_file

    from .adapters.random import make_random_adapter
    from .models import lora_components

    if folder.exists() and any(folder.rglob("*.safetensors")):
        return
    _, components = lora_components(model)
    for i, (adapter_id, rank, targets) in enumerate(DEMO_ADAPTERS):
        path = folder / f"{adapter_id}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        state_dict, metadata = make_random_adapter(components, rank, targets, text_encoder=True, alpha=2.0 * rank,
                                                   seed=i)
        save_file(state_dict, str(path), metadata=metadata)
    logging.getLogger(__name__).info("wrote demo adapters %s into %s", [a for a, _, _ in DEMO_ADAPTERS], folder)


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="What to draw.")],
    model: Model = "tiny-sd",
    adapters: AdaptersDir = None,
    lora: Annotated[list[str] | None, _opt("--lora", help="Adapter ID[:WEIGHT]; repeat to blend.")] = None,
    steps: Annotated[int | None, _opt("--steps", help="Denoising steps.")] = None,
    guidance: Annotated[float | None, _opt("--guidance", help="Guidance scale.")] = None,
    width: Annotated[int | None, _opt("--width", help="Image width, a multiple of 8.")] = None,
    height: Annotated[int | None, _opt("--height", help="Image height, a multiple of 8.")] = None,
    seed: Annotated[int | None, _opt("--seed", help="Seed of the CPU generator (same image on any device).")] = None,
    negative_prompt: Annotated[str | None, _opt("--negative-prompt", help="What not to draw.")] = None,
    output: Annotated[Path, typer.Option("-o", "--output", help="Image file (png, jpg, webp).")] = Path("out.png"),
    device: Device = "auto",
    compile: Annotated[bool | None, _opt("--compile/--no-compile", help="Regional torch.compile (default: on CUDA).",
                                         env="LORASWAP_COMPILE")] = None,
    compile_mode: CompileMode = "default",
    compile_vae: CompileVae = None,
    attention: Attention = None,
    quantize: Quantize = "none",
    compile_cache: CompileCache = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Generate one image, with adapters fused the way the server fuses them."""
    from .engine.config import EngineConfig, GenerateRequest
    from .engine.engine import Engine

    _setup_logging(verbose)
    try:
        engine = Engine(EngineConfig(model=model, adapters=adapters, device=device, compile=compile,
                                     compile_mode=compile_mode, compile_vae=compile_vae, attention=attention,
                                     compile_cache=compile_cache, quantize=quantize, warmup=False))
        request = GenerateRequest(prompt=prompt, negative_prompt=negative_prompt, steps=steps, guidance=guidance,
                                  width=width, height=height, seed=seed,
                                  loras=[_parse_lora(s) for s in lora or []])
        result = engine.generate(request)
    except LoraswapError as e:
        typer.echo(f"error: {e.message}", err=True)
        raise typer.Exit(1) from None
    except ValueError as e:  # a bad option value (EngineConfig, attention backend)
        raise typer.BadParameter(str(e)) from None
    result.image.save(output)
    typer.echo(f"{output}  seed={result.seed} swap={result.swap_seconds * 1e3:.1f}ms "
               f"generate={result.generate_seconds:.2f}s")


@adapters_app.command("inspect")
def inspect_adapter(
    path_or_id: Annotated[str, typer.Argument(help="A .safetensors file, or an id under --adapters.")],
    model: Model = "tiny-sd",
    adapters: AdaptersDir = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    max_rank: Annotated[int, _opt("--max-rank", help="Highest rank accepted.")] = 1024,
) -> None:
    """Format, base model, ranks, alphas, targets, size; exit 1 if it does not fit --model."""
    from .adapters.formats import load_adapter
    from .adapters.metadata import refuse_other_base
    from .adapters.source import AdapterLocation, LocalAdapterSource
    from .engine.swap import FusedSwapper
    from .models import lora_components

    _setup_logging(False)
    path = Path(path_or_id)
    if path.is_file():
        location = AdapterLocation(path.stem, path, path.parent if path.name == "pytorch_lora_weights.safetensors"
                                   else None)
    elif adapters is not None:
        location = None
    else:
        typer.echo(f"error: {path_or_id} is not a file; give --adapters DIR to look up an id", err=True)
        raise typer.Exit(2)
    pipeline_cls, components = lora_components(model)
    swapper = FusedSwapper(components, max_rank=max_rank)
    report: dict = {"adapter": path_or_id, "model": model}
    fits, problem = True, None
    try:
        location = location or LocalAdapterSource(adapters).locate(path_or_id)
        unet = components.get("unet")
        parsed = load_adapter(location, pipeline_cls, swapper.component_modules, 2**40, unet.config if unet else None)
        report.update(
            format=parsed.format, base_models=parsed.base_models, bytes=location.weights.stat().st_size,
            ranks=parsed.ranks, layers=parsed.num_layers,
            scales=sorted({round(layer.scale, 6) for mods in parsed.layers.values() for layer in mods.values()}),
            targets={c: sorted(mods) for c, mods in parsed.layers.items()},
        )
        swapper.bind(parsed)
        refuse_other_base(parsed.adapter_id, parsed.base_models, [model])
    except LoraswapError as e:
        fits, problem = False, e.message
    report.update(fits=fits, problem=problem)
    if as_json:
        typer.echo(json.dumps(report, indent=1))
    else:
        for key, value in report.items():
            if key == "targets":
                for component, names in value.items():
                    typer.echo(f"targets.{component}: {len(names)} layers, e.g. {', '.join(names[:3])}")
            else:
                typer.echo(f"{key}: {value}")
    raise typer.Exit(0 if fits else 1)


@adapters_app.command("make-random")
def make_random(
    model: Annotated[str, typer.Option("--model", help="Preset, or a real shape: sd15, sdxl, flux-dev.")],
    rank: Annotated[int, typer.Option("--rank", min=1, help="LoRA rank.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="The .safetensors file to write.")],
    targets: Annotated[str, typer.Option("--targets", help="attn or all.")] = "attn",
    fmt: Annotated[str, typer.Option("--format", help="diffusers or kohya.")] = "diffusers",
    text_encoder: Annotated[bool, typer.Option("--text-encoder", help="Also target the text encoder(s).")] = False,
    base_model: Annotated[str | None, typer.Option("--base-model", help="Declare this base model.")] = None,
    alpha: Annotated[float | None, typer.Option("--alpha", help="LoRA alpha (default: the rank).")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    dtype: Annotated[str, typer.Option("--dtype", help="float16, bfloat16 or float32.")] = "float16",
) -> None:
    """Write a random adapter with a real key layout, for tests and benchmarks."""
    from safetensors.torch import save_file

    from .adapters.random import make_random_adapter
    from .engine.config import DTYPES
    from .models import lora_components

    for name, value, allowed in (("--targets", targets, ("attn", "all")), ("--format", fmt, ("diffusers", "kohya")),
                                 ("--dtype", dtype, tuple(DTYPES))):
        if value not in allowed:
            raise typer.BadParameter(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
    _, components = lora_components(model)
    state_dict, metadata = make_random_adapter(components, rank, targets, fmt, text_encoder=text_encoder, alpha=alpha,
                                               base_model=base_model, dtype=DTYPES[dtype], seed=seed)
    output.parent.mkdir(parents=True, exist_ok=True)
    save_file(state_dict, str(output), metadata=metadata)
    typer.echo(f"{output}: {len(state_dict)} tensors, {output.stat().st_size / 2**20:.1f} MiB")


def _parse_specs(text: str) -> list[tuple[int, str]]:
    """`128:all,4:attn` -> [(128, "all"), (4, "attn")]."""
    specs = []
    for part in text.split(","):
        rank, _, targets = part.strip().partition(":")
        if not rank.isdigit() or targets not in ("attn", "all"):
            raise typer.BadParameter(f"--adapters-spec part {part!r} must look like 64:all or 4:attn")
        specs.append((int(rank), targets))
    return specs


@bench_app.command("swap")
def bench_swap(
    shape: Annotated[str, typer.Option("--shape", help="flux-dev, sdxl or sd15 (real config, random weights).")]
    = "flux-dev",
    width: Annotated[int, typer.Option("--width")] = 1024,
    height: Annotated[int, typer.Option("--height")] = 1024,
    steps: Annotated[int, typer.Option("--steps")] = 28,
    rounds: Annotated[int, typer.Option("--rounds", help="Interleaved rounds of all variants.")] = 5,
    recompile_swaps: Annotated[int, typer.Option("--recompile-swaps", help="Mixed swaps in the recompile check.")]
    = 60,
    specs: Annotated[str, typer.Option("--adapters-spec", help="rank:targets list; the first is seed 2's first "
                                       "adapter, so give it the widest targets and the highest rank.")]
    = "128:all,4:attn,64:all,16:all,32:attn,8:all",
    variants: Annotated[str, typer.Option("--variants")] = "seed1,seed2,loraswap,base",
    quantize: Annotated[str, typer.Option("--quantize", help="The compiled copies in float8 (fp8, fp8-tensorwise, "
                                          "fp8-weight-only): seed 2 is then a LoRA kept unfused on them; leave "
                                          "seed1 out.")] = "none",
    out: Annotated[Path, typer.Option("--out", help="Folder for JSON and PNG.")] = Path("bench/results"),
    workdir: Annotated[Path | None, typer.Option("--workdir", help="Where adapters are written.")] = None,
) -> None:
    """Swap time and per-image time: seed 1, seed 2 (hotswap), loraswap, compiled base."""
    from .bench.swap import run_swap_bench

    _setup_logging(False)
    try:
        run_swap_bench(shape, width, height, steps, rounds, recompile_swaps, out, workdir,
                       tuple(v.strip() for v in variants.split(",")), _parse_specs(specs), quantize)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


@bench_app.command("options")
def bench_options(
    shape: Annotated[str, typer.Option("--shape", help="flux-dev, sdxl or sd15 (real config, random weights).")]
    = "sdxl",
    variants: Annotated[str, typer.Option("--variants", help="Comma-separated ATTENTION@MODE[@QUANTIZE], e.g. "
                                          "native@default,_native_cudnn@default,native@reduce-overhead,"
                                          "native@default@fp8-tensorwise.")]
    = "native@default,_native_cudnn@default,_native_flash@default,native@reduce-overhead",
    width: Annotated[int, typer.Option("--width")] = 1024,
    height: Annotated[int, typer.Option("--height")] = 1024,
    steps: Annotated[int, typer.Option("--steps")] = 25,
    rounds: Annotated[int, typer.Option("--rounds", help="Interleaved rounds of all variants.")] = 4,
    out: Annotated[Path, typer.Option("--out", help="Folder for JSON and PNG.")] = Path("bench/results"),
    workdir: Annotated[Path | None, typer.Option("--workdir", help="Where adapters are written.")] = None,
) -> None:
    """Per-image time under attention backends, compile modes and float8 quantization, a LoRA swapped before each
    image."""
    from .bench.options import run_options_bench

    _setup_logging(False)
    try:
        run_options_bench(shape, tuple(v.strip() for v in variants.split(",")), width, height, steps, rounds,
                          out, workdir)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


@bench_app.command("serve")
def bench_serve(
    model: Annotated[str, typer.Option("--model", help="sdxl-random, flux-dev-random, sd15-random or a preset.")]
    = "sdxl-random",
    num_ids: Annotated[int, typer.Option("--adapters-count", help="Adapter ids in the Zipf stream.")] = 2500,
    requests: Annotated[int, typer.Option("--requests", help="Requests per run.")] = 24,
    concurrency: Annotated[int, typer.Option("--concurrency", help="Clients in the concurrent run.")] = 4,
    steps: Annotated[int, typer.Option("--steps")] = 25,
    width: Annotated[int, typer.Option("--width")] = 1024,
    height: Annotated[int, typer.Option("--height")] = 1024,
    modes: Annotated[str, typer.Option("--modes", help="fused (loraswap) and/or diffusers (seed 1).")]
    = "fused,diffusers",
    out: Annotated[Path, typer.Option("--out", help="Folder for JSON and PNG.")] = Path("bench/results"),
    fused_args: Annotated[str, typer.Option("--fused-args", help="Extra `loraswap serve` flags for loraswap's "
                                            "server only, e.g. '--compile-mode reduce-overhead'.")] = "",
    workdir: Annotated[Path | None, typer.Option("--workdir", help="Adapters and server logs.")] = None,
) -> None:
    """Latency and throughput of the HTTP server under a Zipf stream, against seed-1 mode."""
    from .bench.serve import run_serve_bench

    _setup_logging(False)
    run_serve_bench(model, num_ids, requests, concurrency, steps, width, height, workdir, out,
                    tuple(m.strip() for m in modes.split(",")), fused_args=tuple(shlex.split(fused_args)))


@bench_app.command("startup")
def bench_startup(
    model: Annotated[str, typer.Option("--model", help="sdxl-random, flux-dev-random, sd15-random or a preset.")]
    = "sdxl-random",
    compile_cache: Annotated[Path | None, typer.Option("--compile-cache", help="An empty or new folder for the "
                                                       "caches (default: a new one under --workdir).")] = None,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Cold + warm pairs, each on a new cache.")] = 1,
    steps: Annotated[int, typer.Option("--steps", help="Steps of the first request after ready.")] = 2,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    serve_args: Annotated[str, typer.Option("--serve-args", help="More loraswap serve flags, e.g. "
                                            "'--compile-mode max-autotune-no-cudagraphs'.")] = "",
    out: Annotated[Path, typer.Option("--out", help="Folder for JSON and PNG.")] = Path("bench/results"),
    workdir: Annotated[Path | None, typer.Option("--workdir", help="Server logs and the default cache.")] = None,
) -> None:
    """Time to the first image after a restart: cold, then with the compile cache the cold start filled."""
    from .bench.startup import run_startup_bench

    _setup_logging(False)
    try:
        run_startup_bench(model, compile_cache, rounds, steps, device, serve_args, out, workdir)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def main() -> None:  # pragma: no cover
    app()


