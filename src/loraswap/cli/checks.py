"""What a user can get wrong on the command line, checked before any model loads: a model
name, a folder, an output file, a request's numbers, a port. Each refusal is a
`typer.BadParameter` naming the flag and what to give instead (exit code 2)."""

import difflib
import errno
import re
import socket
from pathlib import Path

import typer

from loraswap.cli.group import Failure
from loraswap.errors import LoraswapError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as the hub spells repository ids
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_SUFFIX = ".mp4"


def known_family(model: str, bare_architectures: bool = False):
    """The family of a preset or an `<architecture>-random` (None for a hub id or a folder,
    whose family is known once loaded), or BadParameter for a name that is none of these.
    `bare_architectures`: `sdxl` names the architecture too (where only its layers are needed)."""
    from loraswap.models import ARCHITECTURES, PRESETS
    from loraswap.models.architectures import RANDOM_SUFFIX
    from loraswap.models.families import ARCHITECTURE_FAMILIES, PRESET_FAMILIES

    if model in PRESETS:
        return PRESET_FAMILIES[model]
    architecture = model.removesuffix(RANDOM_SUFFIX) if model.endswith(RANDOM_SUFFIX) else (
        model if bare_architectures else None)
    if architecture in ARCHITECTURES:
        return ARCHITECTURE_FAMILIES[architecture]
    if Path(model).is_dir() or HUB_ID.match(model):
        return None
    names = [*PRESETS, *(a + RANDOM_SUFFIX for a in ARCHITECTURES)]
    nearest = difflib.get_close_matches(model, names, n=1)
    hint = f" (did you mean {nearest[0]}?)" if nearest else ""
    raise typer.BadParameter(
        f"{model!r} is no model loraswap knows{hint}. Give a preset ({', '.join(PRESETS)}), a real architecture "
        f"with random weights (<architecture>-random: {', '.join(a + RANDOM_SUFFIX for a in ARCHITECTURES[:3])}, "
        "...), a hub id (owner/name) or a diffusers folder that exists", param_hint="--model")


def check_step_cache(engine_config, family) -> None:
    """A default step cache for a model whose family takes none (a UNet), and a MagCache
    calibration file that does not read, refused before the model loads."""
    from loraswap.engine.step_cache import read_ratios, transformer_families
    from loraswap.errors import LoraswapError

    step_caching = engine_config.step_caching
    if step_caching.step_cache != "off" and family is not None and family.name not in transformer_families():
        raise typer.BadParameter(f"{engine_config.model} takes no step cache: step caching serves the transformer "
                                 f"families ({', '.join(transformer_families())}); use --step-cache off",
                                 param_hint="--step-cache")
    if step_caching.step_cache_calibration is not None:
        try:
            read_ratios(step_caching.step_cache_calibration)
        except LoraswapError as e:
            raise typer.BadParameter(str(e).removeprefix("--step-cache-calibration "),
                                     param_hint="--step-cache-calibration") from None


def check_adapters_folder(folder: Path | None) -> None:
    if folder is not None and not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise typer.BadParameter(f"{folder} {what}: give the folder that holds your .safetensors adapters",
                                 param_hint="--adapters")


def check_adapter_ids(config, loras: list) -> None:
    """Each adapter (a ref) found in --adapters, as the engine will look it up (AdapterNotFound,
    or a pickle file refused); hub ids and files elsewhere (URLs, Civitai, S3) are fetched
    when the model is loaded, as the server fetches them."""
    from loraswap.adapters.sources.choose import build_sources

    sources = build_sources(config.sources.settings())
    for ref in loras:
        source = sources.source_for(ref)  # AdapterNotFound without --adapters, unless a hub id
        if source is sources.folder:
            source.locate(ref)


def check_output(output: Path, family) -> None:
    """A suffix the writer takes, and the kind of output the model makes (when known before loading)."""
    suffix = output.suffix.lower()
    if suffix not in (*IMAGE_SUFFIXES, VIDEO_SUFFIX):
        raise typer.BadParameter(f"cannot write {output.name}: write an image (.png, .jpg or .webp) or a video "
                                 "(.mp4)", param_hint="-o")
    makes = family.output if family is not None else None
    if makes == "video" and suffix != VIDEO_SUFFIX:
        raise typer.BadParameter(f"this model makes videos: write one with -o {output.with_suffix(VIDEO_SUFFIX)}",
                                 param_hint="-o")
    if makes == "image" and suffix == VIDEO_SUFFIX:
        raise typer.BadParameter("this model makes images: write a .png, .jpg or .webp", param_hint="-o")
    if not output.parent.is_dir():
        raise typer.BadParameter(f"the folder {output.parent} does not exist", param_hint="-o")


def check_size(width: int | None, height: int | None, model: str, family, max_size: str | None) -> None:
    """Width and height against what the model needs and the largest size it makes (the
    engine's own checks, run before loading where the name tells the model: a preset's
    native size is its family's default)."""
    from loraswap.engine.calls import check_size_multiple
    from loraswap.engine.sizes import LargestSize
    from loraswap.models import PRESETS

    if family is None:
        return
    try:
        check_size_multiple(width, height, family.size_multiple, model)
        native = (family.defaults.get("width"), family.defaults.get("height"))
        if model in PRESETS and None not in native and (width or height):
            LargestSize.of(model, native, max_size).check(width or native[0], height or native[1])
    except LoraswapError as e:
        raise typer.BadParameter(e.message, param_hint="--width/--height") from None


def bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (as uvicorn binds it), held until the server listens on it:
    a port in use is found before any model loads, and no other process takes it meanwhile."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        reason = "another program listens on it" if e.errno == errno.EADDRINUSE else e.strerror
        raise Failure(f"cannot serve on {host}:{port}: {reason}. Stop that program, or serve on another port: "
                      "--port N (or LORASWAP_PORT=N)") from None
    sock.listen(2048)  # held: a second server started meanwhile finds it in use (uvicorn's backlog)
    sock.set_inheritable(True)
    return sock
