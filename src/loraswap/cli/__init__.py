"""`loraswap`: serve, generate, inspect and make adapters, benchmark.

Each setting of `serve` is a flag, a LORASWAP_<NAME> variable and a key of `serve --config FILE`.
"""

import typer

from . import adapter_tools, bench, generate, serve

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
app.command()(serve.serve)
app.command()(serve.deploy)
app.command()(generate.generate)
app.add_typer(adapter_tools.adapters_app, name="adapters")
app.add_typer(bench.bench_app, name="bench")


@app.callback()
def _quiet_libraries() -> None:
    """Libraries' own warnings (dtype casts, load reports) are noise for users."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()


def main() -> None:  # pragma: no cover
    app()
