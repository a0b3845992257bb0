"""`loraswap adapters list`, `loraswap adapters inspect` and `loraswap adapters make-random`."""

import json
from pathlib import Path
from typing import Annotated

import typer

from loraswap.cli.adapter_family import UNLIMITED_BYTES, fits, known_models, route, target_model, what_it_says
from loraswap.cli.checks import check_adapters_folder, known_family
from loraswap.cli.group import PanelsCommand, PanelsGroup
from loraswap.cli.options import quiet_libraries, setup_logging, with_settings
from loraswap.cli.settings import defaults, one_model, pick
from loraswap.errors import LoraswapError

adapters_app = typer.Typer(cls=PanelsGroup, add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                           help="List, inspect and make adapters.")

INSPECT_SETTINGS = [one_model(), *pick("adapters", "max-rank")]


@adapters_app.command("list", cls=PanelsCommand)
@with_settings(*pick("adapters"))
def list_adapters(*, given: dict) -> None:
    """The ids of the adapters under --adapters, one a line (what --lora and the `lora` header take)."""
    from loraswap.adapters.sources.folder import FolderSource

    folder = given.get("adapters")
    if folder is None:
        raise typer.BadParameter("give the folder of your .safetensors adapters", param_hint="--adapters")
    check_adapters_folder(folder)
    for adapter_id in FolderSource(folder).list_ids():
        typer.echo(adapter_id)


@adapters_app.command("inspect", cls=PanelsCommand)
@with_settings(*INSPECT_SETTINGS)
def inspect_adapter(
    path_or_id: Annotated[str, typer.Argument(help="A .safetensors file, or an id under --adapters.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    *,
    given: dict,
) -> None:
    """What an adapter is: the model family it is for (as a server routes it), layout, kinds, ranks, size.

    Per component: its kinds, the parameters it changes, its base model, ranks and scales. Exit 1 if it does not
    fit --model (naming the first key it cannot apply and why); without --model it is described against the
    first preset or architecture whose layers it fits."""
    setup_logging(False)
    values = {**defaults(INSPECT_SETTINGS), **given}
    model = given.get("model")
    if model is not None:
        known_family(model, bare_architectures=True)
    check_adapters_folder(values["adapters"])
    location = _locate(path_or_id, values["adapters"])
    report = inspect_report(location, path_or_id, model, values["adapters"], values["max-rank"])
    if as_json:
        typer.echo(json.dumps(report, indent=1))
    else:
        _print_report(report)
    raise typer.Exit(0 if report["fits"] else 1)


def _print_report(report: dict) -> None:
    for key, value in report.items():
        if key == "targets":
            for component, names in value.items():
                typer.echo(f"targets.{component}: {len(names)} parameters, e.g. {', '.join(names[:3])}")
        elif key == "kinds":
            for component, counts in value.items():
                typer.echo(f"kinds.{component}: " + ", ".join(f"{k} x{n}" for k, n in sorted(counts.items())))
        else:
            typer.echo(f"{key}: {value}")


def _locate(path_or_id: str, adapters: Path | None):
    """The location of a file given by path; None for an id (looked up under `adapters` later)."""
    from loraswap.adapters.files.location import AdapterLocation

    path = Path(path_or_id)
    if path.is_file():
        return AdapterLocation(path.stem, path, path.parent if path.name == "pytorch_lora_weights.safetensors"
                               else None)
    if adapters is None:
        raise typer.BadParameter(f"{path_or_id} is not a file; give --adapters DIR to look up an id",
                                 param_hint="PATH_OR_ID")
    return None


def inspect_report(location, path_or_id: str, model: str | None, adapters: Path | None, max_rank: int) -> dict:
    """The family it is for, and what the adapter is and whether (else why not) it fits `model`
    (None: the known model routing finds for it): read as the server reads it (`read_adapter`:
    converted, checked, bound), then described from what it became."""
    from loraswap.adapters.reference import AdapterRef
    from loraswap.adapters.sources.folder import FolderSource
    from loraswap.adapters.store import StoreLimits, read_adapter

    report: dict = {"adapter": path_or_id, "model": model}
    try:
        location = location or FolderSource(adapters).locate(AdapterRef.named(path_or_id))  # (a bad id: refused)
        report.update(_family(location, model))
        model = report["model"]
        if model is None:
            return {**report, "fits": False, "problem": "give --model NAME to see why it does not fit that model"}
        target = target_model(model)
        # read without a rank limit, so that an adapter over --max-rank is still described,
        # then refused in the server's words
        report.update(_describe(location, read_adapter(location, target, StoreLimits(UNLIMITED_BYTES, 2**31))))
        if max(report["ranks"], default=0) > max_rank:
            read_adapter(location, target, StoreLimits(max_adapter_bytes=UNLIMITED_BYTES, max_rank=max_rank))
    except LoraswapError as e:
        return {**report, "fits": False, "problem": e.message}
    return {**report, "fits": True, "problem": None}


def _family(location, model: str | None) -> dict:
    """model, family, and how the family was found: from what the file declares, else from the
    known models whose layers it fits. With `model` given and fitting, that model's family
    unless the file names another."""
    declared, hint = what_it_says(location)
    if model is not None and not declared and hint is None:
        family = known_models().get(model) or known_models().get(f"{model}-random")
        if family is not None and fits(location, model):
            return {"model": model, "family": family, "family_from": f"its layers fit {model}"}
    routed = route(location)
    return {"model": model or routed.model, "family": routed.family, "family_from": routed.reason}


def _describe(location, bound) -> dict:
    """The report's figures of a read adapter: its files' layout and tensors (from their headers),
    then per component its kinds, modules and parameters changed, and its ranks and scales."""
    from safetensors import safe_open

    from loraswap.adapters.parse.changes import detect_layout

    files = [f for f in (location.weights, location.second_expert) if f]
    keys = []
    for file in files:
        with safe_open(str(file), "pt") as opened:
            keys.append(list(opened.keys()))
    targets: dict[str, list[str]] = {}
    kinds: dict[str, dict[str, int]] = {}
    for (component, param), layer in bound.layers.items():
        targets.setdefault(component, []).append(param)
        counts = kinds.setdefault(component, {})
        counts[layer.label(param)] = counts.get(layer.label(param), 0) + 1
    layers = bound.layers.values()
    return dict(
        format=detect_layout(keys[0]), tensors=sum(map(len, keys)), kinds=kinds, base_models=list(bound.base_models),
        bytes=sum(f.stat().st_size for f in files), ranks=sorted({layer.rank for layer in layers if layer.rank}),
        layers=len(bound.layers),
        modules={c: len({p.rsplit(".", 1)[0] for p in params}) for c, params in targets.items()},
        scales=sorted({round(layer.scale, 6) for layer in layers}),
        targets={c: sorted(params) for c, params in targets.items()},
    )


@adapters_app.command("make-random", cls=PanelsCommand)
def make_random(
    model: Annotated[str, typer.Option("--model", help="Preset, or a real architecture: sd15, sdxl, flux-dev.")],
    rank: Annotated[int, typer.Option("--rank", min=1, help="LoRA rank.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="The .safetensors file to write.")],
    targets: Annotated[str, typer.Option("--targets", help="attn or all.")] = "attn",
    fmt: Annotated[str, typer.Option("--format", help="diffusers or kohya.")] = "diffusers",
    text_encoder: Annotated[bool, typer.Option("--text-encoder", help="Also target the text encoder(s).")] = False,
    base_model: Annotated[str | None, typer.Option("--base-model", help="Declare this base model.")] = None,
    alpha: Annotated[float | None, typer.Option("--alpha", help="LoRA alpha (default: the rank).")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    dtype: Annotated[str, typer.Option("--dtype", help="float16, bfloat16 or float32.")] = "float16",
    kind: Annotated[str, typer.Option("--kind", help="lora, loha, lokr or dora (LyCORIS keys: --format kohya).")]
    = "lora",
) -> None:
    """Write a random adapter with a real key layout, for tests and benchmarks."""
    from safetensors.torch import save_file

    from loraswap.adapters.random import KINDS, make_random_adapter
    from loraswap.engine.config.engine import DTYPES
    from loraswap.models import lora_components

    quiet_libraries()
    for name, value, allowed in (("--targets", targets, ("attn", "all")), ("--format", fmt, ("diffusers", "kohya")),
                                 ("--dtype", dtype, tuple(DTYPES)), ("--kind", kind, KINDS)):
        if value not in allowed:
            raise typer.BadParameter(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
    if kind != "lora" and fmt != "kohya":
        raise typer.BadParameter(f"--kind {kind} is written in LyCORIS's kohya-style keys: add --format kohya")
    _, components = lora_components(model)
    state_dict, metadata = make_random_adapter(components, rank, targets, fmt, text_encoder=text_encoder, alpha=alpha,
                                               base_model=base_model, dtype=DTYPES[dtype], seed=seed, kind=kind)
    output.parent.mkdir(parents=True, exist_ok=True)
    save_file(state_dict, str(output), metadata=metadata)
    typer.echo(f"{output}: {len(state_dict)} tensors, {output.stat().st_size / 2**20:.1f} MiB")
