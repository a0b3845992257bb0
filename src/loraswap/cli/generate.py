"""`loraswap generate`: one image, with adapters fused the way the server fuses them."""

from pathlib import Path
from typing import Annotated

import typer

from ..errors import LoraswapError
from .options import Verbose, env_option, setup_logging, with_settings
from .settings import engine_config, one_model, pick

# the engine settings `serve` has that make sense for one image, from the same table
GENERATE_SETTINGS = [one_model(), *pick("adapters", "hub", "device", "dtype", "compile", "compile-mode",
                                        "compile-vae", "attention", "quantize", "quantize-text-encoders",
                                        "max-gpu-memory-gb", "compile-cache")]


def parse_lora(spec: str) -> tuple[str, float]:
    """`ID[:WEIGHT]` -> (id, weight)."""
    adapter_id, _, weight = spec.strip().partition(":")
    try:
        return adapter_id.strip(), float(weight) if weight else 1.0
    except ValueError:
        raise typer.BadParameter(f"--lora {spec!r}: the weight after ':' must be a number") from None


@with_settings(*GENERATE_SETTINGS)
def generate(
    prompt: Annotated[str, typer.Argument(help="What to draw.")],
    lora: Annotated[list[str] | None, env_option("--lora", help="Adapter ID[:WEIGHT]; repeat to blend.")] = None,
    steps: Annotated[int | None, env_option("--steps", help="Denoising steps.")] = None,
    guidance: Annotated[float | None, env_option("--guidance", help="Guidance scale.")] = None,
    width: Annotated[int | None, env_option("--width", help="Image width, a multiple of 8.")] = None,
    height: Annotated[int | None, env_option("--height", help="Image height, a multiple of 8.")] = None,
    seed: Annotated[int | None, env_option("--seed", help="Seed of the CPU generator (same image on any "
                                           "device).")] = None,
    negative_prompt: Annotated[str | None, env_option("--negative-prompt", help="What not to draw.")] = None,
    output: Annotated[Path, typer.Option("-o", "--output", help="Image file (png, jpg, webp).")] = Path("out.png"),
    verbose: Verbose = False,
    *,
    given: dict,
) -> None:
    """Generate one image, with adapters fused the way the server fuses them."""
    from ..engine.config import GenerateRequest
    from ..engine.engine import Engine

    setup_logging(verbose)
    try:
        engine = Engine(engine_config(given, warmup=False))
        request = GenerateRequest(prompt=prompt, negative_prompt=negative_prompt, steps=steps, guidance=guidance,
                                  width=width, height=height, seed=seed,
                                  loras=[parse_lora(s) for s in lora or []])
        result = engine.generate(request)
    except LoraswapError as e:
        typer.echo(f"error: {e.message}", err=True)
        raise typer.Exit(1) from None
    except ValueError as e:  # a bad option value (SettingsError, attention backend)
        raise typer.BadParameter(str(e)) from None
    result.image.save(output)
    typer.echo(f"{output}  seed={result.seed} swap={result.swap_seconds * 1e3:.1f}ms "
               f"generate={result.generate_seconds:.2f}s")

