"""The `loraswap` command group: each command's module imported only when that command runs
or its help is asked (they import torch and diffusers, which take seconds), and the one
place where errors become the lines a user reads.

A user error is one or two lines, `error: ...` and what to do, with exit code 2 for a
wrong use of the command line and 1 for anything else that failed; no traceback. An
unexpected error (a bug) says so in one line; `loraswap --debug` or `LORASWAP_DEBUG=1`
shows its traceback.
"""

import importlib
import inspect
import re
import textwrap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import typer
from typer.core import TyperCommand, TyperGroup

from loraswap.errors import LoraswapError


class Failure(Exception):
    """A command that cannot do what was asked, for a reason the user can fix (a port in use);
    the message says what to do. Exit code 1."""


# a refused input or adapter, a file that cannot be read or written: the message says it all
EXPECTED_ERRORS = (Failure, LoraswapError, OSError)


@dataclass(frozen=True)
class LazyCommand:
    """Where a command lives (`module`'s attribute `attribute`: a command function or a
    typer app of subcommands) and the one line `loraswap --help` shows for it."""

    module: str
    attribute: str
    summary: str

    def load(self, name: str) -> TyperCommand:
        found = getattr(importlib.import_module(self.module), self.attribute)
        if isinstance(found, typer.Typer):
            command = typer.main.get_command(found)
        else:
            single = typer.Typer(add_completion=False, rich_markup_mode=None)
            single.command(name, cls=PanelsCommand)(found)
            command = typer.main.get_command(single)
        command.name = name
        return command


class LazyCommands(Mapping):
    """Command name -> click command, each loaded when first looked up."""

    def __init__(self, commands: dict[str, LazyCommand]):
        self.lazy = commands
        self._loaded: dict[str, TyperCommand] = {}

    def __getitem__(self, name: str) -> TyperCommand:
        if name not in self._loaded:
            self._loaded[name] = self.lazy[name].load(name)
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.lazy)

    def __len__(self) -> int:
        return len(self.lazy)


def _format_panels(command: TyperCommand, ctx: typer.Context, formatter) -> None:
    """The options in sections, one per panel (`rich_help_panel`), as plain wrapped text: an
    option's variable and default follow its help, never cut off by a column."""
    sections: dict[str, list[tuple[str, str]]] = {}
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        if param.param_type_name == "argument":
            sections.setdefault("Arguments", []).append((param.metavar, record[1]))  # PROMPT, not `PROMPT <str>`
        else:
            sections.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
    for name, rows in sections.items():
        with formatter.section(name):
            write_rows(formatter, rows)


def write_rows(formatter, rows: list[tuple[str, str]], col_max: int = 30, spacing: int = 2) -> None:
    """click's `write_dl`, but a line never breaks inside a hyphenated word (`flux-dev-random`,
    `LORASWAP_DEMO_ADAPTERS`, `--max-queue`)."""
    first = min(max(len(term) for term, _ in rows), col_max)
    pad = " " * formatter.current_indent
    text_width = max(formatter.width - first - spacing - formatter.current_indent, 20)
    for term, text in rows:
        lines = textwrap.wrap(text, text_width, break_on_hyphens=False, break_long_words=False) or [""]
        if len(term) <= first:
            formatter.write(f"{pad}{term:<{first}}{' ' * spacing}{lines.pop(0)}\n")
        else:
            formatter.write(f"{pad}{term}\n")
        formatter.write("".join(f"{pad}{' ' * (first + spacing)}{line}\n" for line in lines))


class PanelsCommand(TyperCommand):
    """A command whose --help groups its options by panel, in plain text."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        for param in self.params:  # PROMPT in the usage line, not {prompt}
            if param.param_type_name == "argument" and param.metavar is None:
                param.metavar = param.name.upper()

    def format_options(self, ctx: typer.Context, formatter) -> None:
        for param in self.params:
            if param.metavar is None and not getattr(param, "is_flag", False):
                param.metavar = value_name(param.display_type(ctx))
        _format_panels(self, ctx, formatter)


VALUE_NAMES = {"str": "TEXT", "int": "INTEGER", "float": "NUMBER"}


def value_name(display_type: str) -> str:
    """click's names for an option's value (TEXT, INTEGER, PATH) for typer's `<str>`, `<list[str]>`, `<path>`."""
    bare = display_type.strip("<>").removeprefix("list[").removesuffix("]")
    return VALUE_NAMES.get(bare, bare.upper())


class PanelsGroup(TyperGroup):
    """A group of subcommands (`adapters`, `bench`) listing each with its help's first paragraph, whole."""

    def format_commands(self, ctx: typer.Context, formatter) -> None:
        commands = [(name, self.get_command(ctx, name)) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            write_rows(formatter, [(name, " ".join(inspect.cleandoc(command.help or "").split("\n\n")[0].split()))
                                   for name, command in commands if not command.hidden])


class LazyGroup(TyperGroup):
    """`loraswap`: the commands of `lazy_commands`, loaded on first use; errors turned into short lines."""

    lazy_commands: dict[str, LazyCommand] = {}

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.commands = LazyCommands(self.lazy_commands)

    def format_commands(self, ctx: typer.Context, formatter) -> None:
        """The commands' one-line summaries, without importing them."""
        with formatter.section("Commands"):
            write_rows(formatter, [(name, command.summary) for name, command in self.lazy_commands.items()])

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except typer.TyperException as e:
            raise _short_error(e) from None

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort):
            raise
        except typer.TyperException as e:  # click's: a usage error (exit code 2, with its context) or a failure
            raise _short_error(e) from None
        except EXPECTED_ERRORS as e:
            _echo_error(str(getattr(e, "message", None) or e))
            raise typer.Exit(1) from None
        except Exception as e:
            if ctx.params.get("debug"):
                raise
            _echo_error(f"unexpected {type(e).__name__}: {e}")
            typer.echo("This is a bug in loraswap; run again with --debug (loraswap --debug ...) or LORASWAP_DEBUG=1 "
                       "for the traceback, and report it.", err=True)
            raise typer.Exit(1) from None


# the server's words in errors the engine and the adapter sources raise, and the command line's
CLI_WORDS = (
    (re.compile(r"GET /adapters lists the ids this server knows"),
     "`loraswap adapters list --adapters DIR` lists the ids there"),
    (re.compile(r"this server was started without"), "it was run without"),
    (re.compile(r"\b([Ss])tart (?:the server|it) with\b"), lambda m: ("R" if m[1] == "S" else "r") + "un it with"),
    (re.compile(r"\bthis server\b"), "loraswap"),
    (re.compile(r"the server's (--[a-z-]+)"), r"\1"),
    (re.compile(r"use the videos API \(POST /v1/videos\)"), "write a video (-o out.mp4)"),
)


def in_cli_words(message: str) -> str:
    """An error message as the command line says it: flags and commands, not routes and servers."""
    for pattern, words in CLI_WORDS:
        message = pattern.sub(words, message)
    return message


def _echo_error(message: str) -> None:
    typer.echo(f"error: {in_cli_words(message)}", err=True)


def _short_error(e: typer.TyperException) -> Exception:
    """click's error in two lines: what is wrong, and where the help is (for a wrong use)."""
    if type(e).__name__ == "NoArgsIsHelpError":  # a group given no command: its help, as click shows it
        return e
    _echo_error(e.format_message())
    context = getattr(e, "ctx", None)
    if context is not None:
        typer.echo(f"See '{context.command_path} --help'.", err=True)
    return typer.Exit(e.exit_code)
