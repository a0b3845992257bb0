"""`loraswap generate`: one image (from a prompt, or from an image: --image, --mask), with
adapters fused the way the server fuses them."""

from pathlib import Path
from typing import Annotated

import typer

from loraswap.adapters.naming.specs import parse_adapter_specs
from loraswap.adapters.reference import AdapterRef
from loraswap.cli.checks import (
    check_adapter_ids,
    check_adapters_folder,
    check_output,
    check_size,
    check_step_cache,
    known_family,
)
from loraswap.cli.options import Verbose, env_option, setup_logging, with_settings
from loraswap.cli.settings import SettingsError, defaults, engine_config, one_model, pick, server_config
from loraswap.errors import BadRequest

# the settings `serve` has that make sense for one image, from the same table: the engine's,
# and the bounds of an input image (the server's checks, run here on --image and --mask)
IMAGE_SETTINGS = pick("max-image-mb", "max-image-pixels")
IMAGE_NAMES = {s.name for s in IMAGE_SETTINGS}
REMOTE_SETTINGS = pick("url-allow", "civitai", "civitai-api", "civitai-token-file", "s3", "s3-endpoint-url",
                       "download-dir", "download-cache-gb", "max-adapter-mb")
GENERATE_SETTINGS = [one_model(), *pick("max-size", "adapters", "hub"), *REMOTE_SETTINGS,
                     *pick("device", "dtype", "compile", "compile-mode", "compile-vae", "attention", "quantize",
                           "quantize-text-encoders", "max-gpu-memory-gb", "compile-cache", "step-cache",
                           "step-cache-calibration"), *IMAGE_SETTINGS]


def parse_loras(specs: list[str]) -> list[AdapterRef]:
    """Each `--lora NAME[:WEIGHT]` (or `a:0.8, b:0.5`), read as the `lora` header is: an id, a
    URL, a Civitai AIR or s3://bucket/key, made a checked ref here, once (a URL inside it)."""
    try:
        return [lora for spec in specs for lora in parse_adapter_specs(spec)]
    except BadRequest as e:
        raise typer.BadParameter(f"--lora: {e}") from None


@with_settings(*GENERATE_SETTINGS)
def generate(
    prompt: Annotated[str, typer.Argument(help="What to draw.")],
    lora: Annotated[list[str] | None, env_option(
        "--lora", help="Adapter ID[:WEIGHT], or an https:// URL or civitai:MODEL@VERSION; repeat to blend.")] = None,
    steps: Annotated[int | None, env_option("--steps", help="Denoising steps.")] = None,
    guidance: Annotated[float | None, env_option("--guidance", help="Guidance scale.")] = None,
    width: Annotated[int | None, env_option("--width", help="Image width, a multiple of 8.")] = None,
    height: Annotated[int | None, env_option("--height", help="Image height, a multiple of 8.")] = None,
    seed: Annotated[int | None, env_option("--seed", help="Seed of the CPU generator (same image on any "
                                           "device).")] = None,
    negative_prompt: Annotated[str | None, env_option("--negative-prompt", help="What not to draw.")] = None,
    image: Annotated[Path | None, typer.Option("--image", help="Image-to-image: the image to start from (PNG, JPEG "
                                               "or WebP); the output keeps its size unless --width/--height.",
                                               exists=True, dir_okay=False)] = None,
    mask: Annotated[Path | None, typer.Option("--mask", help="Inpainting: with --image, a mask of its size, white "
                                              "(or transparent) where to repaint.", exists=True,
                                              dir_okay=False)] = None,
    strength: Annotated[float | None, env_option("--strength", help="With --image: how much of it to repaint, "
                                                 "0 < S <= 1 (default: the model's).")] = None,
    frames: Annotated[int | None, env_option("--frames", help="A video model's number of frames (default: the "
                                             "model's).")] = None,
    output: Annotated[Path, typer.Option("-o", "--output", help="Image file (png, jpg, webp), or an mp4 for a "
                                         "video model.")] = Path("out.png"),
    verbose: Verbose = False,
    *,
    given: dict,
) -> None:
    """Generate one image (or repaint one: --image, --mask) or a video (-o out.mp4), with adapters fused the way
    the server fuses them."""
    setup_logging(verbose)
    values = {**defaults(GENERATE_SETTINGS), **given}
    # 1. everything the command line can get wrong, refused before the model loads
    family = known_family(values["model"])
    check_output(output, family)
    check_adapters_folder(values["adapters"])
    inputs = read_image_inputs(image, mask, strength, width, height, given)
    request = checked_request(dict(prompt=prompt, negative_prompt=negative_prompt, steps=steps, guidance=guidance,
                                   seed=seed, frames=frames, loras=parse_loras(lora or []), **inputs))
    try:
        config = engine_config(given, warmup=False)
    except SettingsError as e:
        raise typer.BadParameter(str(e)) from None
    if not request.size_from_image:
        check_size(request.width, request.height, values["model"], family, config.max_size)
    check_step_cache(config, family)
    check_adapter_ids(config, request.loras)
    # 2. the model, then the image (LoraswapErrors become one line in `group.LazyGroup`)
    result = _generate(config, request)
    write_output(result, output, request)
    skipped = f" steps_skipped={result.steps_skipped}/{result.steps_run}" if result.step_cache else ""
    typer.echo(f"{output}  seed={result.seed} swap={result.swap_seconds * 1e3:.1f}ms "
               f"generate={result.generate_seconds:.2f}s{skipped}")


def _generate(config, request):
    """Load the model (a spinner), then make the image (a bar of its steps), on a terminal."""
    from loraswap.engine.engine import Engine
    from loraswap.progress import counting, waiting

    with waiting(f"loading {config.model}"):
        try:
            engine = Engine(config)
        except ValueError as e:  # an option the model cannot take (an attention backend)
            raise typer.BadParameter(str(e)) from None
    request = engine.calls.sized(request)  # the model's largest size (a hub model's is known once loaded)
    with counting("steps") as on_step:
        return engine.generate(request, on_step=on_step)


# a request field -> the flag that sets it
FIELD_FLAGS = {"prompt": "PROMPT", "loras": "--lora", "image": "--image", "mask": "--mask"}


def checked_request(fields: dict):
    """The engine's request, or BadParameter naming each flag out of its bounds in plain words
    (the request schema's own bounds, checked before the model loads)."""
    from pydantic import ValidationError

    from loraswap.engine.request import GenerateRequest

    try:
        return GenerateRequest(**fields)
    except ValidationError as e:
        flags, problems = [], []
        for error in e.errors(include_url=False):
            field = str(error["loc"][0])
            flags.append(FIELD_FLAGS.get(field, "--" + field.replace("_", "-")))
            problems.append(f"{error['msg'].replace('Input should be', 'must be')}, not {fields.get(field)!r}")
        raise typer.BadParameter("; ".join(problems), param_hint=" / ".join(dict.fromkeys(flags))) from None


def write_output(result, output: Path, request=None) -> None:
    """The image, or a video model's frames as an MP4 (H.264, at the model's frame rate); an
    image carries the record of what made it (`request`'s prompts, and what ran), as the
    server's do."""
    wants_video = output.suffix.lower() == ".mp4"
    if result.frames is not None and not wants_video:
        raise BadRequest(f"this model makes videos: write one with -o {output.with_suffix('.mp4')}")
    if wants_video and result.frames is None:
        raise BadRequest("this model makes images: write a png, jpg or webp")
    if wants_video:
        from loraswap.media.mp4 import encode_mp4

        output.write_bytes(encode_mp4(result.frames, result.fps))
    else:
        from loraswap.media.images import encode_image, format_for_file

        output.write_bytes(encode_image(result.image, format_for_file(output), record=_record(request, result)))


def _record(request, result):
    """The image's record (`server/images/output.py:build_record`); None without what ran."""
    if request is None or result.ran is None:
        return None
    from loraswap.server.images.output import build_record

    return build_record(request, result)


def read_image_inputs(image: Path | None, mask: Path | None, strength: float | None, width: int | None,
                      height: int | None, given: dict) -> dict:
    """The request's image fields, with the server's checks (media/images.py): the image as
    RGB, the mask as "L", the size to generate (the image's, rounded down to a multiple of 16,
    when --width and --height are not given)."""
    from loraswap.media.images import output_size, read_inputs, require_image
    from loraswap.server.requests.limits import engine_bounds, image_limits

    require_image(image is not None, mask is not None, strength)
    if image is None:
        return {"width": width, "height": height}
    limits = image_limits(server_config({name: given[name] for name in given if name in IMAGE_NAMES}))
    picture, painted = read_inputs(_read_file(image, "image", limits), _read_file(mask, "mask", limits) if mask
                                   else None, limits)
    most = int(engine_bounds("width")[1])  # no server limits here: the engine's
    # no size asked: the image's, scaled down to the model's largest size once it is loaded (`calls.sized`)
    from_image = width is None and height is None
    width, height = output_size(picture, width, height, most, most)
    return {"width": width, "height": height, "image": picture, "mask": painted, "strength": strength,
            "size_from_image": from_image}


def _read_file(path: Path, what: str, limits) -> bytes:
    """The file's bytes, refused by its size before it is read."""
    from loraswap.media.images import check_file_bytes

    check_file_bytes(path.stat().st_size, what, limits)
    return path.read_bytes()
