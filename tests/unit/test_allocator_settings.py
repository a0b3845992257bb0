"""The CUDA allocator settings a server makes at start-up, as torch's own parser takes them,
and only where the operator's environment names none."""

import pytest
import torch

from loraswap.engine import process


@pytest.fixture
def given(monkeypatch):
    settings = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", settings.append)
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    return settings


@pytest.mark.parametrize("cpus, threads", [(1, 1), (2, 2), (3, 2), (6, 4), (7, 4), (16, 8), (None, 1)])
def test_pinning_registers_pages_on_a_power_of_two_threads(given, monkeypatch, cpus, threads):
    """torch refuses a register-thread count that is not a power of two (a server on 6 cores
    would not start); the count is the copy threads' rounded down."""
    monkeypatch.setattr(process.os, "cpu_count", lambda: cpus)
    assert process.pin_by_registering()
    assert given == [f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}"]


@pytest.mark.parametrize("name", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_the_operators_pinning_choice_stands(given, monkeypatch, name):
    monkeypatch.setenv(name, "expandable_segments:True,pinned_use_cuda_host_register:False")
    assert not process.pin_by_registering()
    assert given == []


def test_a_torch_that_refuses_the_setting_leaves_pinning_as_it_was(monkeypatch, caplog):
    def refuse(setting):
        raise ValueError("pinned_num_register_threads must be a power of 2")

    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuse)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert not process.pin_by_registering()
    assert "could not set pinned_use_cuda_host_register" in caplog.text


def test_the_operators_other_settings_are_restated(given, monkeypatch):
    """torch's parser resets the keys a settings string leaves out: the environment's own
    (a split size, say) go first in each call, so none is lost."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    monkeypatch.setattr(process.os, "cpu_count", lambda: 16)
    assert process.pin_by_registering() and process.use_expandable_segments()
    assert given == ["max_split_size_mb:512,pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
                     "max_split_size_mb:512,expandable_segments:True"]
