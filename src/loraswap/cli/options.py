"""Typer options built from the settings (`settings.py`), and the small helpers every command shares."""

import functools
import inspect
from typing import Annotated

import typer

from loraswap.cli.settings import Setting
from loraswap.logs import configure_logging


def env_option(*names: str, help: str, env: str | None = None, **kwargs):
    """An option (not a setting of `serve`) whose value may also come from LORASWAP_<NAME>."""
    env = env or "LORASWAP_" + names[0].lstrip("-").split("/")[0].replace("-", "_").upper()
    return typer.Option(*names, help=help, envvar=env, **kwargs)


def _parameter(setting: Setting) -> inspect.Parameter:
    """The typer parameter of one setting: `--name` (`--name/--no-name` for a bool), its env variable, its panel."""
    flag = f"--{setting.name}/--no-{setting.name}" if setting.type is bool else f"--{setting.name}"
    kind = list[setting.type] if setting.multiple else setting.type
    if setting.default is None:
        kind = kind | None
    option = typer.Option(flag, help=setting.help, envvar=setting.env, rich_help_panel=setting.panel or None,
                          show_default=not setting.secret)
    default = list(setting.default) if setting.multiple else setting.default
    return inspect.Parameter(setting.param, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[kind, option])


def with_settings(*settings: Setting):
    """Give a command one flag per setting.

    The command takes a `given` parameter instead: {setting name: value} of the settings
    given as a flag or a LORASWAP_* variable (those left at their default are not in it).
    """
    def decorate(command):
        own = [p for p in inspect.signature(command).parameters.values() if p.name != "given"]

        @functools.wraps(command)
        def wrapper(settings_context: typer.Context, **kwargs):
            values = {s.name: kwargs.pop(s.param) for s in settings}
            given = {s.name: values[s.name] for s in settings
                     if _source(settings_context, s.param) in ("COMMANDLINE", "ENVIRONMENT")}
            return command(given=given, **kwargs)

        context = inspect.Parameter("settings_context", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
        wrapper.__signature__ = inspect.Signature([*own, context, *(_parameter(s) for s in settings)])
        return wrapper

    return decorate


def _source(ctx: typer.Context, param: str) -> str | None:
    """Where click took a parameter's value from: COMMANDLINE, ENVIRONMENT, DEFAULT, ..."""
    source = ctx.get_parameter_source(param)
    return source.name if source is not None else None


def setup_logging(verbose: bool, level: str = "info", fmt: str = "text") -> None:
    """Log lines at `level` (debug with `verbose`) as `fmt` says (`logs.configure_logging`)."""
    configure_logging("debug" if verbose else level, fmt)
    quiet_libraries()


def quiet_libraries() -> None:
    """Libraries' own warnings (dtype casts, load reports) are noise for users. Called by the
    commands that load models: importing diffusers and transformers takes seconds."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()


Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Log debug messages.")]
