import atexit
import os
import shutil
import tempfile
from pathlib import Path

# Hermetic: every default folder under $XDG_CACHE_HOME (loraswap's downloads and state,
# `paths.user_cache`; the Hugging Face and torch caches too, which the offline suite never
# fills) points at a folder of this session, for in-process servers and the servers tests
# start alike.
TEST_CACHE = Path(tempfile.mkdtemp(prefix="loraswap-tests-cache-"))
atexit.register(shutil.rmtree, TEST_CACHE, True)  # also where no session runs: the controller of `-n 2`
os.environ["XDG_CACHE_HOME"] = str(TEST_CACHE)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from support.every_test_ran import (  # noqa: E402, F401  (hooks: a session fails for a test that never ran)
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_xdist_node_collection_finished,
)

from loraswap.adapters.random import make_random_adapter  # noqa: E402
from loraswap.models import lora_components  # noqa: E402
from loraswap.server.videos import state as video_state  # noqa: E402

# two cores: a thread each for the two test processes of `make test` (pytest-xdist), both alone
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.fixture(scope="session", autouse=True)
def _session_cache_folder():
    """The session's cache folder (`TEST_CACHE`), removed when the session ends."""
    yield TEST_CACHE
    shutil.rmtree(TEST_CACHE, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _state_folder_per_server(tmp_path_factory):
    """Every server a test builds without a state folder gets a fresh one of its own: none
    finds another's video jobs, nor the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(video_state, "default_state_dir", lambda: tmp_path_factory.mktemp("state"))
        yield


@pytest.fixture(scope="session")
def adapter_factory(tmp_path_factory):
    """write(name, preset, rank=..., ...) -> path of a random adapter in a shared folder."""
    root = tmp_path_factory.mktemp("adapters")
    components = {}

    def write(name, preset="tiny-sd", rank=4, targets="attn", fmt="diffusers", text_encoder=False, alpha=None,
              seed=0, base_model=None, dtype=torch.float16, folder=root):
        if preset not in components:
            components[preset] = lora_components(preset)[1]
        state_dict, metadata = make_random_adapter(components[preset], rank, targets, fmt, text_encoder=text_encoder,
                                                   alpha=alpha, base_model=base_model, dtype=dtype, seed=seed)
        path = folder / f"{name}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(state_dict, str(path), metadata=metadata)
        return path

    write.root = root
    return write
