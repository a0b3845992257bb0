"""Every shell and Python example of README.md and docs/http-api.md runs as written against the
server `make serve` starts (`support.docs` says how a page is run: in a folder of its own, on
free ports written for `localhost:8888`, curl with `--fail-with-body`, every picture decoded),
and `examples/serve.toml` serves every adapter it lists."""

import re

import httpx
import pytest
from support.docs import HERMETIC, ROOT, decodes, make_serve_args, run_page
from support.servers import ServerProcess

from loraswap.adapters.reference import AdapterRef


@pytest.mark.slow
def test_the_readme_examples_run_as_written(tmp_path, monkeypatch):
    pictures = run_page(ROOT / "README.md", tmp_path, monkeypatch, make_serve_args())
    made = {"circle.png", "outline.png", "square.jpg", "square.png", "edit.json", "txt2img.json"}
    assert made <= set(pictures), pictures


@pytest.mark.slow
def test_the_http_api_examples_run_as_written(tmp_path, monkeypatch):
    pictures = run_page(ROOT / "docs" / "http-api.md", tmp_path, monkeypatch, make_serve_args())
    assert {"circle.jpg", "circle.png", "green.png", "edit.json", "green-circle.png", "blue-circle.png", "fox.mp4",
            "fox.webp", "red-circle.png", "by-url.png", "square-by-url.png", "tagged.png", "txt2img.png",
            "a1111-circle.png", "a1111-blue.png"} <= set(pictures), pictures


def test_the_readme_names_the_kinds_the_adapter_list_shows():
    """The README's kinds of the demo adapters are those `GET /adapters` lists once each is read."""
    from loraswap.engine.config.engine import EngineConfig
    from loraswap.engine.engine import Engine
    from loraswap.models.families import demo

    engine = Engine(EngineConfig(model="demo", adapters=demo.ADAPTERS, compile=False, warmup=False))
    for adapter in demo.DEMO_ADAPTERS:
        engine.adapters.read(AdapterRef(adapter))
    kinds = {row["id"]: row["kinds"] for row in engine.adapters.rows()}
    assert kinds == {"outline": ["lora"], "striped": ["locon", "lora"], "pastel": ["loha"], "night": ["lokr"],
                     "big": ["locon+dora", "lora+dora"]}
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "`lora` (outline), `locon` and `lora` (striped" in readme
    assert "`loha`, `lokr`, `locon+dora` and `lora+dora` (big)" in readme


@pytest.mark.slow
def test_the_example_config_serves_every_adapter_it_lists(tmp_path, monkeypatch):
    """`loraswap serve --config examples/serve.toml` started where `make serve` ran (its
    demo-adapters/ full of the demo's adapters): every adapter it lists makes an image."""
    from loraswap.cli.serve import write_demo_adapters

    monkeypatch.chdir(tmp_path)
    write_demo_adapters("demo", tmp_path / "demo-adapters")  # what `make serve` left
    server = ServerProcess(["--config", str(ROOT / "examples" / "serve.toml"), *HERMETIC], tmp_path / "server.log")
    try:
        server.wait_ready()
        listed = [row["id"] for row in httpx.get(server.url + "/adapters").json()["adapters"]]
        answers = {adapter: httpx.post(server.url, headers={"lora": adapter}, json={"inputs": "a red circle"},
                                       timeout=60) for adapter in listed}
        models = httpx.get(server.url + "/ready").json()["models"]
    finally:
        server.stop()
    assert models == ["demo", "demo-flux"]
    assert sorted(listed) == ["big", "night", "outline", "pastel", "striped"]
    assert {adapter: r.status_code for adapter, r in answers.items()} == dict.fromkeys(listed, 200)
    for response in answers.values():
        decodes(response.content, "an adapter's image")


def test_the_api_keys_section_names_every_route_that_takes_a_key():
    """docs/http-api.md's "API keys" names each route that needs an API key, and each that
    needs an admin key, as the routers declare them (Ray's `/replicas` aside)."""
    from loraswap.server.auth import require_admin_key, require_api_key
    from loraswap.server.routes import ROUTERS

    routes = {require_api_key: [], require_admin_key: []}
    for router in ROUTERS:
        for dependency in (d.dependency for d in router.dependencies if d.dependency in routes):
            for route in router.routes:
                path = re.sub(r"\{\w+(:path)?\}", "{id}", route.path)
                routes[dependency] += [f"`{method} {path}`" for method in sorted(route.methods)]
    section = (ROOT / "docs" / "http-api.md").read_text().split("## API keys")[1]
    bullet = {flag: " ".join(section.split(f"- `{flag} KEY`")[1].split("\n- ")[0].split())
              for flag in ("--api-key", "--admin-key")}
    assert len(routes[require_api_key]) == 18 and len(routes[require_admin_key]) == 3, routes
    assert [r for r in routes[require_api_key] if r not in bullet["--api-key"]] == []
    assert [r for r in routes[require_admin_key] if r not in bullet["--admin-key"]] == []
