"""The settings of `loraswap serve`, built from the config classes' `Flag` marks: every config
field reachable, flags whose defaults, units and help are the fields', config files (TOML,
YAML) read against them, and configs built from them."""

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from loraswap.adapters.cache import CacheConfig
from loraswap.cli.settings import (
    BY_NAME,
    SETTINGS,
    SettingsError,
    config_tree,
    engine_config,
    printable,
    read_config_file,
    server_config,
)
from loraswap.engine.config.engine import EngineConfig
from loraswap.server.config import ServerConfig

EXAMPLES = Path(__file__).parents[2] / "examples"
NOT_SETTINGS = {"engines.sources.source"}  # an object handed in by code (tests, hub), not a setting


def _fields(model: type[BaseModel], prefix: str = "") -> dict[str, object]:
    """{dotted path: field} of every leaf field of `model`, nested configs opened."""
    leaves = {}
    for name, field in model.model_fields.items():
        inner = EngineConfig if name == "engines" else field.annotation
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            leaves.update(_fields(inner, f"{prefix}{name}."))
        else:
            leaves[prefix + name] = field
    return leaves


def test_every_config_field_has_a_setting():
    targets = {s.target for s in SETTINGS}
    missing = set(_fields(ServerConfig)) - targets - NOT_SETTINGS
    assert not missing, f"no flag sets {sorted(missing)}: mark the field with a Flag (loraswap/flags.py)"
    assert {"retry_after_s", "max_images", "engines.warmup", "engines.sources.max_adapter_mb",
            "engines.sources.hub_cache_dir", "engines.swap.hotswap_rank", "api_keys", "api_keys_file", "admin_keys",
            "auth_health"} <= targets


def _default_in_flag_unit(field, setting):
    value = field.get_default(call_default_factory=True)
    return value / setting.scale if setting.scale != 1 else value


def test_table_defaults_are_the_config_defaults():
    fields = _fields(ServerConfig)
    for setting in SETTINGS:
        if setting.target is None or setting.ray_only:
            continue
        expected = _default_in_flag_unit(fields[setting.target], setting)
        if setting.target == "engines.model":
            expected = [expected]
        shown = list(setting.default) if setting.multiple else setting.default
        assert shown == expected, setting.name
    assert CacheConfig().host_bytes == BY_NAME["host-cache-mb"].default * 2**20


# fields of a Ray deployment set in its YAML file (`loraswap deploy`), not by a `serve --ray` flag
DEPLOY_FILE_ONLY = {"engines.name", "engines.max_ongoing_requests", "engines.num_gpus", "engines.num_cpus",
                    "engines.torch_threads", "engines.health_check_period_s", "engines.graceful_shutdown_timeout_s",
                    "app_name", "ingress_replicas", "report_interval_s"}


def test_every_ray_field_is_a_flag_or_named_as_deploy_file_only():
    from loraswap.cluster.config import ClusterConfig, ModelDeploymentConfig

    deployment = set(ModelDeploymentConfig.model_fields) - set(EngineConfig.model_fields)
    cluster = set(ClusterConfig.model_fields) - set(ServerConfig.model_fields)
    ray_fields = {f"engines.{name}" for name in deployment} | cluster
    flagged = {s.target for s in SETTINGS if s.ray_only}
    assert ray_fields - flagged == DEPLOY_FILE_ONLY
    assert flagged == {"engines.replicas", "engines.max_adapters"}


def test_help_and_units_come_from_the_fields():
    fields = _fields(ServerConfig)
    for setting in SETTINGS:
        if setting.target is None or setting.ray_only:
            continue
        assert fields[setting.target].description.removesuffix(".") in setting.help, setting.name
    assert BY_NAME["host-cache-mb"].help == "Host RAM for adapters ready to fuse, MiB."
    assert (BY_NAME["max-body-kb"].default, BY_NAME["max-body-kb"].scale) == (64, 1024)
    assert BY_NAME["api-key"].secret and BY_NAME["admin-key"].secret and not BY_NAME["api-keys-file"].secret
    assert BY_NAME["model"].multiple and BY_NAME["model"].help.endswith("the first is the default.")
    assert BY_NAME["replicas"].help.startswith("--ray: ")


def test_a_flag_names_a_known_panel():
    from loraswap.flags import Flag

    with pytest.raises(ValueError, match="unknown panel 'Colours'"):
        Flag("Colours")


def test_ray_settings_defaults_are_the_deployment_defaults():
    pytest.importorskip("ray")
    from loraswap.cluster.config import ModelDeploymentConfig

    for setting in (s for s in SETTINGS if s.ray_only):
        field = ModelDeploymentConfig.model_fields[setting.target.removeprefix("engines.")]
        assert field.get_default() == setting.default, setting.name


def test_no_flag_or_help_names_the_seeds():
    cli_sources = (Path(__file__).parents[2] / "src/loraswap/cli").glob("*.py")
    for path in cli_sources:
        assert not re.search(r"seed[ _-]?[12]\b", path.read_text(), re.IGNORECASE), path


@pytest.mark.parametrize("name", ["serve.toml", "serve.yaml"])
def test_example_files_build_the_config(name):
    values = read_config_file(EXAMPLES / name)
    config = server_config(values)
    assert [e.model for e in config.engines] == ["demo", "demo-flux"]
    engine = config.engines[1]  # engine settings go to every model
    assert engine.sources.adapters == Path("demo-adapters") and engine.swap.max_rank == 256
    assert (engine.cache.host_bytes, engine.cache.gpu_bytes) == (4096 * 2**20, 1024 * 2**20)
    assert (config.scheduler.max_queue, config.scheduler.max_batch) == (64, 2)
    assert config.max_body_bytes == 128 * 1024 and config.port == 8888


def test_toml_and_yaml_examples_say_the_same():
    assert read_config_file(EXAMPLES / "serve.toml") == read_config_file(EXAMPLES / "serve.yaml")


def _write(tmp_path, text: str, name: str = "c.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_keys_with_dashes_or_underscores_and_one_model_or_a_list(tmp_path):
    values = read_config_file(_write(tmp_path, 'max_queue = 5\nmodel = "tiny-flux"\nhub-deny = "bad/*"\n'))
    assert values == {"max-queue": 5, "model": ["tiny-flux"], "hub-deny": ["bad/*"]}
    config = server_config(values)
    assert config.scheduler.max_queue == 5 and [e.model for e in config.engines] == ["tiny-flux"]
    assert config.engines[0].sources.hub_deny == ["bad/*"] and config.engines[0].sources.hub_allow == ["*"]


@pytest.mark.parametrize("text,message", [
    ("max-queu = 3", "unknown setting 'max-queu'; did you mean 'max-queue'?"),
    ("colour = 3", "unknown setting 'colour'; the keys are serve's flags"),
    ('port = "abc"', "port must be an integer, not 'abc'"),
    ("max-wait-s = true", "max-wait-s must be a number, not True"),
    ("hub = 1", "hub must be true or false, not 1"),
    ("model = [1]", "model must be a string (or a list of them)"),
    ("max-queue = 3\nmax_queue = 4", "max-queue is given twice"),
    ("port = ", "Invalid value"),
])
def test_file_errors_name_the_key(tmp_path, text, message):
    with pytest.raises(SettingsError, match=re.escape(message)):
        read_config_file(_write(tmp_path, text))


def test_file_formats(tmp_path):
    assert read_config_file(_write(tmp_path, "port: 9\n", "c.yml")) == {"port": 9}
    assert read_config_file(_write(tmp_path, "", "empty.yaml")) == {}
    with pytest.raises(SettingsError, match="a config file is .toml, .yaml or .yml"):
        read_config_file(_write(tmp_path, "port = 9", "c.ini"))
    with pytest.raises(SettingsError, match="expected a table of settings"):
        read_config_file(_write(tmp_path, "- port\n", "list.yaml"))


def test_a_secret_value_is_never_in_an_error(tmp_path):
    with pytest.raises(SettingsError) as raised:
        read_config_file(_write(tmp_path, "api-key = 123456789"))
    assert "api-key must be a string" in str(raised.value) and "123456789" not in str(raised.value)
    with pytest.raises(SettingsError) as raised:
        server_config({"api-key": ["sk-never-shown"], "admin-key": ["adm-never-shown"], "max-queue": 0,
                       "port": -1})
    message = str(raised.value)
    assert "--max-queue: Input should be greater than or equal to 1" in message and "--port:" in message
    assert "never-shown" not in message


def test_config_errors_name_the_flags():
    with pytest.raises(SettingsError, match=re.escape("--host-cache-mb / --gpu-cache-mb: the GPU adapter budget")):
        server_config({"model": ["tiny-sd", "tiny-sdxl"], "host-cache-mb": 10, "gpu-cache-mb": 20})
    with pytest.raises(SettingsError, match="--swap-mode: Input should be 'fused', 'load-and-fuse' or 'hotswap'"):
        server_config({"swap-mode": "diffusers"})


def test_units_and_names_land_in_their_fields():
    config = server_config({"max-body-kb": 8, "host-cache-mb": 1.5, "gpu-cache-mb": 1, "max-adapter-mb": 3,
                            "swap-mode": "hotswap", "hotswap-rank": 64, "retry-after-s": 7, "max-images": 2,
                            "warmup": False, "api-key": ["k1", "k2"], "admin-key": ["a1"], "auth-health": True})
    engine = config.engines[0]
    assert config.max_body_bytes == 8192 and engine.cache.host_bytes == int(1.5 * 2**20)
    assert engine.sources.max_adapter_mb == 3 and (engine.swap.swap_mode, engine.swap.hotswap_rank) == ("hotswap", 64)
    assert (config.retry_after_s, config.max_images, engine.warmup) == (7, 2, False)
    assert (config.api_keys, config.admin_keys, config.auth_health) == (["k1", "k2"], ["a1"], True)
    assert "k1" not in repr(config)


def test_ray_settings_apply_with_ray_only():
    values = {"model": ["a", "b"], "replicas": 3, "max-adapters": 5, "ray": True, "port": 1}
    assert config_tree(values) == {"port": 1, "engines": [{"model": "a"}, {"model": "b"}]}
    assert config_tree(values, ray=True)["engines"] == [{"replicas": 3, "max_adapters": 5, "model": "a"},
                                                        {"replicas": 3, "max_adapters": 5, "model": "b"}]


def test_engine_config_for_one_image():
    config = engine_config({"model": "tiny-sdxl", "compile": False, "max-gpu-memory-gb": 4.0}, warmup=False)
    assert (config.model, config.compilation.compile, config.memory.max_gpu_memory_gb, config.warmup) == (
        "tiny-sdxl", False, 4.0, False)
    assert engine_config({}).model == "tiny-sd"


def test_printed_settings_leave_keys_out_and_read_back(tmp_path):
    values = {"port": 9, "adapters": Path("x"), "api-key": ["sk-1", "sk-2"], "admin-key": [], "model": ["m"]}
    text = printable(values)
    assert "sk-1" not in text and "sk-2" not in text
    assert text.startswith("# api-key: 2 not printed\n") and "admin-key" not in text
    assert read_config_file(_write(tmp_path, text, "printed.yaml")) == {"port": 9, "adapters": Path("x"),
                                                                        "model": ["m"]}


def test_engine_config_errors_name_the_flags():
    with pytest.raises(SettingsError, match="^--compile-mode: Input should be"):
        engine_config({"compile-mode": "fastest"})


def test_the_settings_page_is_current_and_names_every_serve_flag():
    """docs/settings.md is written from the settings (tools/docs/settings_reference.py): a flag added
    or changed without writing the page again fails here."""
    import typer

    from loraswap.cli import app
    from loraswap.cli.reference import settings_markdown

    page = (Path(__file__).resolve().parents[2] / "docs" / "settings.md").read_text()
    assert page == settings_markdown(), "run: PYTHONPATH=src python tools/docs/settings_reference.py"
    serve = typer.main.get_command(app).commands["serve"]
    flags = {o for p in serve.params for o in p.opts + p.secondary_opts if o.startswith("--")} - {"--help"}
    assert flags and all(f"`{flag}`" in page for flag in flags), sorted(f for f in flags if f"`{f}`" not in page)
