"""The adapters a real server serves, and the server (`support.servers`), plain and on Ray."""

import pytest
from support.servers import ServerProcess, ray_env


@pytest.fixture(scope="session")
def served_adapters(adapter_factory):
    """Adapters for tiny-sd: two good ones, one for another base model."""
    root = adapter_factory.root / "served"
    adapter_factory("style", "tiny-sd", rank=8, targets="all", text_encoder=True, alpha=16.0, seed=21, folder=root)
    adapter_factory("styles/second", "tiny-sd", rank=4, targets="attn", alpha=8.0, seed=22, folder=root)
    adapter_factory("sdxl-only", "tiny-sd", rank=4, base_model="stabilityai/stable-diffusion-xl-base-1.0",
                    seed=23, folder=root)
    return root


@pytest.fixture(scope="module", params=["plain", pytest.param("ray", marks=pytest.mark.ray)])
def server(request, served_adapters, tmp_path_factory):
    """The same server flags, served by one process (`plain`) and by Ray Serve with 2 replicas (`ray`)."""
    ray = request.param == "ray"
    process = ServerProcess(["--model", "tiny-sd", "--adapters", str(served_adapters), "--max-width", "512",
                             "--max-height", "512", "--max-steps", "50", "--max-blend", "2", "--max-body-kb", "4",
                             "--max-prompt-chars", "200", *(["--ray", "--replicas", "2"] if ray else [])],
                            tmp_path_factory.mktemp("logs") / f"server-{request.param}.log",
                            env=ray_env() if ray else None)
    process.wait_ready()
    yield process
    process.stop()
