"""The settings of `loraswap serve`, built from the config classes.

Every config field marked with a `Flag` (`loraswap/flags.py`) is one setting: its flag
(`--max-queue`), its `LORASWAP_*` variable (`LORASWAP_MAX_QUEUE`), its key in a `--config`
file (`max-queue` or `max_queue`, TOML or YAML), its --help text and its row of
docs/settings.md all come from the field's type, default, description and mark, so none
of them can disagree with the config. A few settings belong to the command itself
(`--ray`, `--demo-adapters`): they are written here.

Precedence, lowest first: the config classes' own defaults, the file, `LORASWAP_*`, flags.
Only what was given reaches the config classes.
"""

import difflib
import tomllib
import types
import typing
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import BaseModel, ValidationError

from loraswap.cluster.config import ClusterConfig, ModelDeploymentConfig
from loraswap.engine.config.engine import EngineConfig
from loraswap.flags import ADAPTERS, PANELS, RAY, Flag
from loraswap.server.config import ServerConfig


@dataclass(frozen=True)
class Setting:
    name: str  # the flag without "--", and the key in a config file
    type: type  # of one value: str, int, float, bool or Path
    default: object  # in the flag's unit; shown in --help
    target: str | None  # the field it sets, dotted from ServerConfig ("engines." = every model); None: the command's
    help: str
    panel: str = ""
    multiple: bool = False  # a repeatable flag; a list (or one value) in a file
    scale: int = 1  # the flag's unit in the config's unit (MiB -> bytes: 2**20)
    secret: bool = False  # never printed, never in an error message
    ray_only: bool = False  # a field of ModelDeploymentConfig: applied with --ray only
    envvar: str | None = None  # default: LORASWAP_<NAME>

    @property
    def param(self) -> str:
        """The Python name of the flag's parameter."""
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return self.envvar or "LORASWAP_" + self.param.upper()


def _value_type(annotation) -> tuple[type, bool]:
    """(the type of one value, repeatable?) of a field's annotation: `list[str] | None` -> (str, True)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is list:
        return _value_type(typing.get_args(annotation)[0])[0], True
    if typing.get_origin(annotation) is typing.Literal:
        return type(typing.get_args(annotation)[0]), False
    return annotation, False


def _setting(target: str, field, flag: Flag, ray_only: bool) -> Setting:
    """The setting of one marked field, in the flag's unit."""
    kind, multiple = _value_type(field.annotation)
    default = field.get_default(call_default_factory=True)
    help_text = field.description
    if flag.scale != 1:
        kind = float  # a fraction of a MiB is a size too
        default = default // flag.scale if default % flag.scale == 0 else default / flag.scale
        help_text = f"{help_text.removesuffix('.')}, {flag.unit}."
    if flag.repeat:
        multiple, default, help_text = True, (default,), f"{help_text} {flag.repeat}"
    if ray_only:
        help_text = "--ray: " + help_text
    return Setting(flag.name or target.rsplit(".", 1)[-1].replace("_", "-"), kind,
                   tuple(default) if multiple else default, target, help_text, flag.panel, multiple=multiple,
                   scale=flag.scale, secret=field.repr is False, ray_only=ray_only)


def _marked(model: type[BaseModel], prefix: str = "", ray_only: bool = False, skip: tuple[str, ...] = ()):
    """The settings of `model`'s marked fields, nested configs opened; `skip`: fields another walk covers."""
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _marked(field.annotation, f"{prefix}{name}.", ray_only)
        flag = next((m for m in field.metadata if isinstance(m, Flag)), None)
        if flag is not None:
            yield _setting(prefix + name, field, flag, ray_only)


def _config_settings() -> list[Setting]:
    engine = [*_marked(EngineConfig, "engines."),
              *_marked(ModelDeploymentConfig, "engines.", ray_only=True, skip=tuple(EngineConfig.model_fields))]
    server = [*_marked(ServerConfig, skip=("engines",)),
              *_marked(ClusterConfig, ray_only=True, skip=tuple(ServerConfig.model_fields))]
    return engine + server


COMMAND_SETTINGS = [
    Setting("demo-adapters", bool, False, None, "Put adapters to try the server with into --adapters: the `demo` "
            "model's trained ones (outline, striped, pastel, night, big), or for another model a few random ones "
            "if the folder has none.", ADAPTERS),
    Setting("ray", bool, False, None, "Serve on Ray Serve: an HTTP ingress and, per model, --replicas replicas of "
            "one GPU each (CPU without GPUs), routed by adapter (docs/ray.md).", RAY),
    Setting("ray-address", str, None, None, "--ray: the Ray cluster to join (default: a new local one).", RAY,
            envvar="RAY_ADDRESS"),
]
# by panel; in a panel, the command's own first, then in the order the config classes declare them
SETTINGS: list[Setting] = sorted([*COMMAND_SETTINGS, *_config_settings()], key=lambda s: PANELS.index(s.panel))
BY_NAME = {s.name: s for s in SETTINGS}


def pick(*names: str) -> list[Setting]:
    """The settings named, in that order (a command that takes some of them)."""
    return [BY_NAME[name] for name in names]


def one_model() -> Setting:
    """`--model` taken once (generate, inspect)."""
    field = EngineConfig.model_fields["model"]
    return replace(BY_NAME["model"], default=field.default, multiple=False, help=field.description)


def defaults(settings: list[Setting] = SETTINGS) -> dict[str, object]:
    """{name: default} of `settings`."""
    return {s.name: list(s.default) if s.multiple else s.default for s in settings}


class SettingsError(ValueError):
    """A config file or a setting's value that cannot be served; the message says which."""


def read_config_file(path: Path) -> dict[str, object]:
    """The settings in a TOML (.toml) or YAML (.yaml, .yml) file, checked against the table."""
    text = Path(path).read_text()
    if path.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise SettingsError(f"{path}: {e}") from None
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise SettingsError(f"{path}: {e}") from None
    else:
        raise SettingsError(f"{path}: a config file is .toml, .yaml or .yml")
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: expected a table of settings (key = value), not {type(data).__name__}")
    settings = {}
    for key, value in data.items():
        name = _known_name(key, path)
        if name in settings:
            raise SettingsError(f"{path}: {name} is given twice")
        settings[name] = _checked(BY_NAME[name], value, path)
    return settings


def _known_name(key: object, path: Path) -> str:
    name = str(key).replace("_", "-")
    if name not in BY_NAME:
        nearest = difflib.get_close_matches(name, BY_NAME, n=1)
        hint = f"did you mean '{nearest[0]}'?" if nearest else "the keys are serve's flags (loraswap serve --help)"
        raise SettingsError(f"{path}: unknown setting '{key}'; {hint}")
    return name


TYPE_WORDS = {str: "a string", int: "an integer", float: "a number", bool: "true or false", Path: "a path"}


def _checked(setting: Setting, value: object, path: Path) -> object:
    """`value` as the flag would give it, or a SettingsError naming the key (and the value, unless secret)."""
    if setting.multiple and not isinstance(value, list):
        value = [value]
    values = value if setting.multiple else [value]
    if not all(_is(setting, v) for v in values):
        shown = "" if setting.secret else f", not {value!r}"
        many = " (or a list of them)" if setting.multiple else ""
        raise SettingsError(f"{path}: {setting.name} must be {TYPE_WORDS[setting.type]}{many}{shown}")
    values = [Path(v) if setting.type is Path and v is not None else v for v in values]
    return values if setting.multiple else values[0]


def _is(setting: Setting, value: object) -> bool:
    if value is None:
        return setting.default is None
    if setting.type is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if setting.type is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, str if setting.type is Path else setting.type)


def printable(values: dict[str, object]) -> str:
    """`values` as a YAML config file that `--config` reads back; secrets are left out (a comment counts them)."""
    import yaml

    shown = {name: _plain(value) for name, value in values.items() if not BY_NAME[name].secret}
    hidden = [f"{name}: {len(value)} not printed" for name, value in values.items()
              if BY_NAME[name].secret and value]
    header = "".join(f"# {line}\n" for line in hidden)
    return header + yaml.safe_dump(shown, sort_keys=False)


def _plain(value: object) -> object:
    """A value as YAML writes it: paths as strings, lists as lists."""
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value


def config_tree(values: dict[str, object], ray: bool = False) -> dict:
    """The given settings as the keyword tree of a ServerConfig (ClusterConfig with `ray`).

    `engines.*` fields go to every model: one engine per `model`.
    """
    tree: dict = {}
    for name, value in values.items():
        setting = BY_NAME[name]
        if setting.target is None or (setting.ray_only and not ray):
            continue
        if setting.scale != 1 and value is not None:
            value = int(value * setting.scale)
        *parents, leaf = setting.target.split(".")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    engine = tree.pop("engines", {})
    models = engine.pop("model", [])
    models = [models] if isinstance(models, str) else models  # `generate --model` is one name
    tree["engines"] = [{**engine, "model": m} for m in models] or [engine]  # no model given: the default one
    return tree


def server_config(values: dict[str, object], ray: bool = False):
    """The ServerConfig (ClusterConfig with `ray`) the given settings describe; SettingsError if it is wrong."""
    config_cls = ClusterConfig if ray else ServerConfig
    try:
        return config_cls.model_validate(config_tree(values, ray))
    except ValidationError as e:
        raise SettingsError(describe(e)) from None


def engine_config(values: dict[str, object], **fields):
    """One EngineConfig from the given settings (the first model's), plus `fields`."""
    engine = config_tree(values)["engines"][0]
    try:
        return EngineConfig.model_validate({**engine, **fields})
    except ValidationError as e:
        raise SettingsError(describe(e, within=("engines",))) from None


def describe(error, within: tuple[str, ...] = ()) -> str:
    """A pydantic ValidationError of the config at `within` (("engines",) for an EngineConfig) as
    `--flag: problem` lines, without the values (an API key may be one)."""
    lines = []
    for item in error.errors(include_input=False, include_url=False):
        where = ".".join([*within, *(str(part) for part in item["loc"] if not isinstance(part, int))])
        lines.append(f"{_flags_of(where)}: {item['msg'].removeprefix('Value error, ')}")
    return "; ".join(dict.fromkeys(lines))  # one line per problem, not one per model


def _flags_of(where: str) -> str:
    """The flags that set config field `where` (`engines.cache`: --host-cache-mb / --gpu-cache-mb)."""
    exact = [s for s in SETTINGS if s.target == where]
    inside = [s for s in SETTINGS if s.target and s.target.startswith(where + ".")]
    chosen = exact or (inside if len(inside) <= 3 else [])
    return " / ".join("--" + s.name for s in chosen) or where or "config"
