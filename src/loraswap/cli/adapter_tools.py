"""`loraswap adapters inspect` and `loraswap adapters make-random`."""

import json
from pathlib import Path
from typing import Annotated

import typer

from ..errors import LoraswapError
from .options import setup_logging, with_settings
from .settings import defaults, one_model, pick

adapters_app = typer.Typer(no_args_is_help=True, help="Inspect adapters and make random ones.")

INSPECT_SETTINGS = [one_model(), *pick("adapters", "max-rank")]


@adapters_app.command("inspect")
@with_settings(*INSPECT_SETTINGS)
def inspect_adapter(
    path_or_id: Annotated[str, typer.Argument(help="A .safetensors file, or an id under --adapters.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    *,
    given: dict,
) -> None:
    """Layout, kinds per component, base model, ranks, scales, what it changes where, size;
    exit 1 if it does not fit --model (naming the first key it cannot apply and why)."""
    setup_logging(False)
    values = {**defaults(INSPECT_SETTINGS), **given}
    location = _locate(path_or_id, values["adapters"])
    report = _inspect(location, path_or_id, values["model"], values["adapters"], values["max-rank"])
    if as_json:
        typer.echo(json.dumps(report, indent=1))
    else:
        for key, value in report.items():
            if key == "targets":
                for component, names in value.items():
                    typer.echo(f"targets.{component}: {len(names)} parameters, e.g. {', '.join(names[:3])}")
            elif key == "kinds":
                for component, counts in value.items():
                    typer.echo(f"kinds.{component}: " + ", ".join(f"{k} x{n}" for k, n in sorted(counts.items())))
            else:
                typer.echo(f"{key}: {value}")
    raise typer.Exit(0 if report["fits"] else 1)


def _locate(path_or_id: str, adapters: Path | None):
    """The location of a file given by path; None for an id (looked up under `adapters` later)."""
    from ..adapters.source import AdapterLocation

    path = Path(path_or_id)
    if path.is_file():
        return AdapterLocation(path.stem, path, path.parent if path.name == "pytorch_lora_weights.safetensors"
                               else None)
    if adapters is None:
        typer.echo(f"error: {path_or_id} is not a file; give --adapters DIR to look up an id", err=True)
        raise typer.Exit(2)
    return None


def _inspect(location, path_or_id: str, model: str, adapters: Path | None, max_rank: int) -> dict:
    """What the adapter is, and whether (else why not) it fits `model`: read as the server
    reads it (`read_adapter`: converted, checked, bound), then described from what it became."""
    from ..adapters.bound import ModelLayers
    from ..adapters.source import LocalAdapterSource
    from ..adapters.store import StoreLimits, TargetModel, read_adapter
    from ..models import lora_components

    pipeline_cls, components = lora_components(model)
    unet = components.get("unet")
    target = TargetModel(model, pipeline_cls, ModelLayers(components), None, unet.config if unet else None)
    # no size limit: a large file is one to inspect, not to refuse; read without a rank limit
    # too, so that an adapter over --max-rank is still described, then refused in the server's words
    unlimited = StoreLimits(max_adapter_bytes=2**40, max_rank=2**31)
    report: dict = {"adapter": path_or_id, "model": model}
    try:
        location = location or LocalAdapterSource(adapters).locate(path_or_id)
        report.update(_describe(location, read_adapter(location, target, unlimited)))
        if max(report["ranks"], default=0) > max_rank:
            read_adapter(location, target, StoreLimits(max_adapter_bytes=2**40, max_rank=max_rank))
    except LoraswapError as e:
        return {**report, "fits": False, "problem": e.message}
    return {**report, "fits": True, "problem": None}


def _describe(location, bound) -> dict:
    """The report's figures of a read adapter: its files' layout and tensors (from their headers),
    then per component its kinds, modules and parameters changed, and its ranks and scales."""
    from safetensors import safe_open

    from ..adapters.parse import detect_layout

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


@adapters_app.command("make-random")
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

    from ..adapters.random import KINDS, make_random_adapter
    from ..engine.config import DTYPES
    from ..models import lora_components

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
