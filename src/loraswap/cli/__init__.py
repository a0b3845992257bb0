"""`loraswap`: serve, generate, inspect and make adapters, benchmark.

Each setting of `serve` is a flag, a LORASWAP_<NAME> variable and a key of `serve --config FILE`.
"""

from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

import typer

from loraswap.cli.group import LazyCommand, LazyGroup
from loraswap.logs import hide_library_noise

# before any command imports torch, diffusers or transformers: their start-up warnings are
# held until the log level is known (shown at debug)
hide_library_noise()


class Commands(LazyGroup):
    # each command's module is imported when the command runs or its help is asked: they
    # import torch and diffusers, which `loraswap --help` and `--version` never need
    lazy_commands = {
        "serve": LazyCommand("loraswap.cli.serve", "serve", "Serve the model over HTTP (Hugging Face Inference API "
                             "and OpenAI images API)."),
        "deploy": LazyCommand("loraswap.cli.serve", "deploy", "Deploy loraswap on Ray Serve from a YAML file and "
                              "serve until SIGTERM (docs/ray.md)."),
        "generate": LazyCommand("loraswap.cli.generate", "generate", "Generate one image (or repaint one: --image, "
                                "--mask) or a video (-o out.mp4), with adapters fused the way the server fuses them."),
        "adapters": LazyCommand("loraswap.cli.adapter_tools", "adapters_app", "List, inspect and make adapters."),
        "bench": LazyCommand("loraswap.cli.bench", "bench_app", "Benchmarks (run them on a GPU)."),
    }


app = typer.Typer(cls=Commands, add_completion=False, no_args_is_help=True, help=__doc__, rich_markup_mode=None)


def _print_version(asked: bool) -> None:
    if asked:
        try:
            typer.echo(f"loraswap {version('loraswap')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            typer.echo("loraswap (not installed: no version)")
        raise typer.Exit()


@app.callback()
def _options(
    show_version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                               help="Print loraswap's version and exit.")] = False,
    debug: Annotated[bool, typer.Option("--debug", envvar="LORASWAP_DEBUG", show_envvar=False,
                                        help="Print the traceback of an unexpected error (also LORASWAP_DEBUG=1).")]
    = False,
) -> None:
    """The options every command shares; `debug` is read where errors are reported (`group.LazyGroup`)."""


def main() -> None:  # pragma: no cover
    app()
