"""The settings of `loraswap serve`, defined once.

Each row of `SETTINGS` is one setting: its flag, type, default, help, help panel and the
config field it sets. The flags (`--max-queue`), their `LORASWAP_*` variables
(`LORASWAP_MAX_QUEUE`) and the keys of a `--config` file (`max-queue` or `max_queue`, TOML
or YAML) are all built from this table, so the three cannot disagree.

Precedence, lowest first: the config classes' own defaults, the file, `LORASWAP_*`, flags.
Only what was given reaches the config classes; the table's defaults are shown in --help
(tests/unit/test_settings.py checks that they equal the classes' defaults).
"""

import difflib
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

MODELS = "Models"
ADAPTERS = "Adapters and caches"
SCHEDULING = "Scheduling"
SPEED = "Speed and memory"
SERVER = "Server and limits"
RAY = "Ray"


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


def _panel(title: str, *settings: Setting) -> list[Setting]:
    return [replace(s, panel=title) for s in settings]


S = Setting
MODEL_HELP = "A preset (tiny-sd, tiny-sdxl, tiny-flux, ...), a hub id or a local diffusers folder."
SETTINGS: list[Setting] = [
    *_panel(
        MODELS,
        S("model", str, ("tiny-sd",), "engines.model", MODEL_HELP + " Repeat to host several base models: the "
          "first is the default.", multiple=True),
        S("device", str, "auto", "engines.device", "auto, cpu or cuda."),
        S("dtype", str, "auto", "engines.dtype", "auto (bfloat16 on CUDA, float32 on CPU), float32, float16 or "
          "bfloat16."),
        S("warmup", bool, True, "engines.warmup", "Generate once at start-up, so that the first request finds the "
          "model compiled."),
    ),
    *_panel(
        ADAPTERS,
        S("adapters", Path, None, "engines.adapters", "Folder of .safetensors adapters; an adapter's id is its "
          "path under it without the suffix."),
        S("demo-adapters", bool, False, None, "Put adapters to try the server with into --adapters: the `demo` "
          "model's trained ones (outline, striped, pastel, night, big), or for another model a few random "
          "ones if the folder has none."),
        S("hub", bool, False, "engines.hub", "Also serve hub adapters (owner/name, or owner/name@revision); "
          "HF_HUB_OFFLINE=1 serves them from the huggingface_hub cache alone."),
        S("hub-allow", str, ("*",), "engines.hub_allow", "fnmatch pattern of hub ids served; repeatable.",
          multiple=True),
        S("hub-deny", str, (), "engines.hub_deny", "fnmatch pattern of hub ids refused; repeatable.", multiple=True),
        S("hub-cache-dir", Path, None, "engines.hub_cache_dir", "huggingface_hub's cache folder (default: "
          "HF_HUB_CACHE)."),
        S("swap-mode", str, "fused", "engines.swap_mode", "fused (loraswap's swap), or a benchmark baseline: "
          "load-and-fuse (diffusers' load_lora_weights + fuse_lora per request, eager) or hotswap (diffusers + "
          "PEFT hotswap, compiled)."),
        S("hotswap-rank", int, 128, "engines.hotswap_rank", "--swap-mode hotswap: the highest rank served (every "
          "adapter is padded to it)."),
        S("max-blend", int, 4, "engines.max_blend", "Most adapters blended in one request."),
        S("max-rank", int, 1024, "engines.max_rank", "Highest LoRA rank accepted."),
        S("max-adapter-mb", float, 2048, "engines.max_adapter_mb", "Largest adapter file, MiB."),
        S("host-cache-mb", float, 8192, "engines.cache.host_bytes", "Host RAM for adapters ready to fuse, MiB.",
          scale=2**20),
        S("gpu-cache-mb", float, 2048, "engines.cache.gpu_bytes", "GPU memory for adapter copies, MiB (at most "
          "--host-cache-mb).", scale=2**20),
        S("prefetch-threads", int, 4, "engines.prefetch_threads", "Threads reading adapters ahead of the GPU."),
    ),
    *_panel(
        SCHEDULING,
        S("max-queue", int, 32, "scheduler.max_queue", "Requests waiting before 503."),
        S("max-batch", int, 1, "scheduler.max_batch", "Requests with the same adapters and parameters batched "
          "into one pipeline call."),
        S("max-wait-s", float, 30.0, "scheduler.max_wait_s", "Fairness: a request waiting this long goes next."),
        S("max-skips", int, 8, "scheduler.max_skips", "Fairness: a request passed over this often goes next."),
        S("retry-after-s", int, 2, "retry_after_s", "Retry-After sent with a 503, seconds."),
    ),
    *_panel(
        SPEED,
        S("compile", bool, None, "engines.compile", "Regional torch.compile of the denoiser (default: on CUDA)."),
        S("compile-mode", str, "default", "engines.compile_mode", "torch.compile mode: default, "
          "max-autotune-no-cudagraphs, reduce-overhead or max-autotune (CUDA graphs: the whole denoiser)."),
        S("compile-vae", bool, None, "engines.compile_vae", "With --compile, also compile the VAE decoder: a "
          "faster decode, a longer start-up (default: with the CUDA-graph compile modes only)."),
        S("compile-while-loading", bool, False, "engines.compile_while_loading", "A local diffusers folder with "
          "regional compile: compile a stand-in for the denoiser (FLUX.1) while the weights are copied in "
          "(experimental)."),
        S("compile-cache", Path, None, "engines.compile_cache", "Folder for torch.compile's caches, kept across "
          "restarts: a restarted process compiles from it."),
        S("attention", str, None, "engines.attention", "Attention backend of diffusers' dispatcher (native, "
          "_native_cudnn, _native_flash, flex, ...; default: diffusers')."),
        S("quantize", str, "none", "engines.quantize", "Denoiser weights in float8 (torchao): none, fp8 (weights "
          "and activations, row-wise scales; CUDA 8.9+), fp8-tensorwise (one scale per tensor) or "
          "fp8-weight-only."),
        S("quantize-text-encoders", str, "none", "engines.quantize_text_encoders", "Text encoders' weights in "
          "float8: none or fp8-weight-only (the low-memory mode)."),
        S("pristine", str, "device", "engines.pristine", "Where pristine copies of swapped weights live: device, "
          "or host (pinned RAM; the low-memory mode)."),
        S("max-gpu-memory-gb", float, None, "engines.max_gpu_memory_gb", "Cap this process's GPU memory (a "
          "smaller card on a larger one)."),
    ),
    *_panel(
        SERVER,
        S("host", str, "127.0.0.1", "host", "Interface to listen on."),
        S("port", int, 8888, "port", "TCP port (0: any free one)."),
        S("api-key", str, (), "api_keys", "A key clients send as `Authorization: Bearer KEY`; repeatable. Prefer "
          "LORASWAP_API_KEY (keys separated by spaces), --api-keys-file or --config: a flag shows in `ps`.",
          multiple=True, secret=True),
        S("api-keys-file", Path, None, "api_keys_file", "A file of API keys, one a line."),
        S("admin-key", str, (), "admin_keys", "A key for the adapter routes (load, evict, list); repeatable. Prefer "
          "LORASWAP_ADMIN_KEY or --config.",
          multiple=True, secret=True),
        S("auth-health", bool, False, "auth_health", "Require a key on /health, /ready and /metrics too."),
        S("max-width", int, 2048, "max_width", "Largest image width."),
        S("max-height", int, 2048, "max_height", "Largest image height."),
        S("max-steps", int, 100, "max_steps", "Most denoising steps."),
        S("max-prompt-chars", int, 2000, "max_prompt_chars", "Longest prompt, characters."),
        S("max-body-kb", int, 64, "max_body_bytes", "Largest request body, KiB.", scale=1024),
        S("max-images", int, 4, "max_images", "Most images in one OpenAI request (n)."),
        S("max-video-frames", int, 121, "max_video_frames", "Most frames in one video (frames, or seconds x fps)."),
        S("max-video-fps", int, 60, "max_video_fps", "Highest frame rate a video request may ask for."),
        S("video-fps", int, 16, "video_fps", "The frame rate a video's seconds count in when the request gives "
          "none, and the MP4's when the model gives none."),
        S("video-ttl-s", float, 3600.0, "video_ttl_s", "How long a finished video (and its MP4) is kept, seconds."),
        S("max-video-jobs", int, 64, "max_video_jobs", "Video jobs kept, finished or not; past it the oldest "
          "finished one is dropped."),
        S("max-video-jobs-pending", int, 8, "max_video_jobs_pending", "Video jobs queued or in progress at once; "
          "more: 503."),
        S("max-image-mb", float, 20, "max_image_bytes", "Largest input image (or mask) file, MiB.", scale=2**20),
        S("max-image-pixels", int, 4096 * 4096, "max_image_pixels", "Most pixels (width x height) of an input "
          "image, read from its header before decoding."),
    ),
    *_panel(
        RAY,
        S("ray", bool, False, None, "Serve on Ray Serve: an HTTP ingress and, per model, --replicas replicas of "
          "one GPU each (CPU without GPUs), routed by adapter (docs/ray.md)."),
        S("replicas", int, 1, "engines.replicas", "--ray: replicas per model.", ray_only=True),
        S("max-adapters", int, 32, "engines.max_adapters", "--ray: adapters held per replica; the least recently "
          "used is evicted past this.", ray_only=True),
        S("ray-address", str, None, None, "--ray: the Ray cluster to join (default: a new local one).",
          envvar="RAY_ADDRESS"),
    ),
]
BY_NAME = {s.name: s for s in SETTINGS}


def pick(*names: str) -> list[Setting]:
    """The settings named, in that order (a command that takes some of them)."""
    return [BY_NAME[name] for name in names]


def one_model() -> Setting:
    """`--model` taken once (generate, inspect)."""
    return replace(BY_NAME["model"], default="tiny-sd", multiple=False, help=MODEL_HELP)


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
    from pydantic import ValidationError

    if ray:
        from ..cluster.config import ClusterConfig as config_cls
    else:
        from ..server.config import ServerConfig as config_cls
    try:
        return config_cls.model_validate(config_tree(values, ray))
    except ValidationError as e:
        raise SettingsError(describe(e)) from None


def engine_config(values: dict[str, object], **fields):
    """One EngineConfig from the given settings (the first model's), plus `fields`."""
    from pydantic import ValidationError

    from ..engine.config import EngineConfig

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
