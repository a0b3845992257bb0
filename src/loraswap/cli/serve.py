"""`loraswap serve` (HTTP, or Ray Serve with --ray) and `loraswap deploy` (Ray Serve from a YAML file)."""

import logging
import shutil
import signal
import socket
import sys
from pathlib import Path
from typing import Annotated

import typer

from loraswap.cli.checks import bind_port, check_adapters_folder, check_step_cache, known_family
from loraswap.cli.options import Verbose, env_option, setup_logging, with_settings
from loraswap.cli.settings import SETTINGS, SettingsError, defaults, printable, read_config_file, server_config
from loraswap.tracing import configure_tracing

ConfigFile = Annotated[Path | None, env_option(
    "--config", help="A TOML or YAML file of these settings: its keys are the flags' names (max-queue = 64; "
    "examples/serve.toml). LORASWAP_* variables and flags override it.", exists=True, dir_okay=False)]
PrintConfig = Annotated[bool, typer.Option("--print-config", help="Print the settings as a config file (API keys "
                                           "left out) and exit.")]


@with_settings(*SETTINGS)
def serve(config_file: ConfigFile = None, print_config: PrintConfig = False, verbose: Verbose = False, *,
          given: dict) -> None:
    """Serve the model over HTTP (Hugging Face Inference API and OpenAI images API).

    Every flag is also the LORASWAP_* variable shown with it, and a key of a --config file.
    docs/settings.md has them all in one table."""
    # 1. the settings: the file's, then LORASWAP_* variables and flags over them
    try:
        given = {**(read_config_file(config_file) if config_file else {}), **given}
    except SettingsError as e:
        raise typer.BadParameter(str(e), param_hint="--config") from None
    values = {**defaults(), **given}
    # 2. the typed configuration, checked before anything is printed, written or loaded
    cluster = _import_cluster() if values["ray"] else None
    try:
        config = server_config(given, ray=values["ray"])
    except SettingsError as e:
        raise typer.BadParameter(str(e)) from None
    if print_config:
        typer.echo(printable(values), nl=False)
        return
    check_before_loading(config, values)
    listening = None if cluster is not None else bind_port(config.host, config.port)
    setup_logging(verbose, config.log_level, config.log_format)
    configure_tracing(config.otel)
    if values["demo-adapters"]:
        write_demo_adapters(config.engines[0].model, values["adapters"])
    # 3. serve until stopped
    if cluster is not None:
        cluster.run(config, address=values["ray-address"])
        return
    serve_on_socket(config, listening)


def check_before_loading(config, values: dict) -> None:
    """What the command line can get wrong, refused before a model loads: the models' names, the
    adapter folder (unless --demo-adapters makes it)."""
    if values["demo-adapters"] and values["adapters"] is None:
        raise typer.BadParameter("--demo-adapters needs --adapters DIR to write into")
    for engine in config.engines:
        check_step_cache(engine, known_family(engine.model))
    if not values["demo-adapters"]:
        check_adapters_folder(values["adapters"])


def serve_on_socket(config, listening: socket.socket) -> None:
    """Serve on the socket `bind_port` bound before the model loaded."""
    from loraswap.engine.engine import Engine
    from loraswap.server.access_log import log_config
    from loraswap.server.app import create_app
    from loraswap.server.shutdown import serve_http

    ranks = _start_ranks(config)  # the other processes of a context-parallel engine, if any
    # on SIGTERM the server drains (`server/shutdown.py`), then uvicorn re-raises the signal to
    # the handler it found: make that one a clean exit, so a graceful stop exits 0
    try:
        app = create_app(config, engine_factory=ranks.engine_factory if ranks else Engine)
    except ValueError as e:  # an unreadable keys file or a malformed key (the message never holds a key)
        raise typer.BadParameter(str(e)) from None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # uvicorn names its address only for a socket it binds itself
    host, port = listening.getsockname()[:2]
    logging.getLogger(__name__).info("serving on http://%s:%d (Ctrl-C to stop)", f"[{host}]" if ":" in host else host,
                                     port)
    try:
        serve_http(app, config, sockets=[listening], log_config=log_config(config.log_format))
    finally:
        listening.close()
        if ranks:
            ranks.stop()


def _start_ranks(config):
    """With --ulysses-degree, --ring-degree or --cfg-parallel: ranks 1..N-1 started, this process rank 0."""
    parallel = [e for e in config.engines if e.parallel.parallelism.world > 1]
    if not parallel:
        return None
    if len(config.engines) > 1:
        raise typer.BadParameter("--ulysses-degree, --ring-degree and --cfg-parallel serve one model per server: "
                                 "give one --model")
    from loraswap.engine.parallel.processes import RankProcesses

    try:
        return RankProcesses(parallel[0])
    except ValueError as e:  # fewer GPUs than ranks
        raise typer.BadParameter(str(e)) from None


def deploy(
    config_file: Annotated[Path, typer.Argument(help="YAML: a ClusterConfig (server fields, `engines` with "
                                                "replicas), or a Serve config file using "
                                                "loraswap.cluster:app_builder.", exists=True, dir_okay=False)],
    address: Annotated[str | None, env_option("--address", help="The Ray cluster (default: RAY_ADDRESS, else a "
                                              "new local one).", env="RAY_ADDRESS")] = None,
    detach: Annotated[bool, typer.Option("--detach", help="Return once healthy and leave it running on the "
                                         "cluster (needs --address).")] = False,
    verbose: Verbose = False,
) -> None:
    """Deploy loraswap on Ray Serve from a YAML file and serve until SIGTERM (docs/ray.md)."""
    setup_logging(verbose)
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
    """loraswap's Ray Serve application (`run`, `load_config`), or exit 2 saying how to install Ray."""
    try:
        from loraswap.cluster import app as cluster
    except ImportError as e:
        typer.echo(f"error: Ray Serve is not installed ({e}); pip install 'loraswap[ray]'", err=True)
        raise typer.Exit(2) from None
    return cluster


RANDOM_ADAPTERS = (("demo/watercolor", 4, "attn"), ("demo/neon", 16, "all"), ("demo/sketch", 64, "all"))


def write_demo_adapters(model: str, folder: Path) -> None:
    """Adapters to try the server with, put into `folder`: a demo model's trained ones
    (those missing are copied), or for another model a few random ones, written once (a
    folder with adapters is left alone)."""
    from loraswap.models.families import demo, demo_flux

    log = logging.getLogger(__name__)
    trained = {"demo": demo, "demo-flux": demo_flux}.get(model)
    if trained is not None:
        folder.mkdir(parents=True, exist_ok=True)
        missing = [a for a in trained.DEMO_ADAPTERS if not (folder / f"{a}.safetensors").exists()]
        for adapter_id in missing:
            shutil.copyfile(trained.ADAPTERS / f"{adapter_id}.safetensors", folder / f"{adapter_id}.safetensors")
        log.info("%s adapters in %s: %s", model, folder, ", ".join(f"{a} ({kind})" for a, (kind, _) in
                                                                   trained.DEMO_ADAPTERS.items()))
        return
    if folder.exists() and any(folder.rglob("*.safetensors")):
        return
    _write_random_adapters(model, folder)
    log.info("wrote random demo adapters %s into %s", [a for a, _, _ in RANDOM_ADAPTERS], folder)


def _write_random_adapters(model: str, folder: Path) -> None:
    from safetensors.torch import save_file

    from loraswap.adapters.random import make_random_adapter
    from loraswap.models import lora_components

    _, components = lora_components(model)
    for i, (adapter_id, rank, targets) in enumerate(RANDOM_ADAPTERS):
        path = folder / f"{adapter_id}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        state_dict, metadata = make_random_adapter(components, rank, targets, text_encoder=True, alpha=2.0 * rank,
                                                   seed=i)
        save_file(state_dict, str(path), metadata=metadata)
