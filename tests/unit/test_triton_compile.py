"""The warm-ups' parallel compile (`engine/kernels/triton_compile.py`): a first pass that only
compiles, inside Triton's AsyncCompileMode, the very variants the second pass launches.
Nothing runs on a GPU here: the kernels are recorders."""

import sys

import pytest
import torch

from loraswap.engine.kernels import float8 as float8_kernels
from loraswap.engine.kernels import float8_warm_up, triton_compile
from loraswap.engine.kernels import fused as kernels

SHAPES = [(3072, 64), (3072, 3072), (12288, 3072), (3072, 15360)]  # FLUX.1-dev's, a few


def variant(args: tuple, options: dict) -> tuple:
    """What Triton specializes a launch on: its constants, which integers are multiples of 16
    or 1, and the tensors' dtypes."""
    integers = tuple(16 if x % 16 == 0 else 1 if x == 1 else 0 for x in args if isinstance(x, int))
    return tuple(sorted(options.items())), integers, tuple(x.dtype for x in args if isinstance(x, torch.Tensor))


class Recorder:
    """A Triton kernel that runs nothing: the variants launched, and those compiled only
    (Triton's `warmup`), with whether an AsyncCompileMode was active for each compile."""

    def __init__(self, fail: bool = False):
        self.launched, self.compiled, self.in_async_mode, self.fail = set(), set(), set(), fail

    def __getitem__(self, grid):
        return lambda *args, **options: self.launched.add(variant(args, options))

    def warmup(self, *args, grid, **options):
        from triton.runtime._async_compile import active_mode

        if self.fail:
            raise RuntimeError("ptxas failed")
        self.compiled.add(variant(args, options))
        self.in_async_mode.add(active_mode.get() is not None)


@pytest.fixture
def recorders(monkeypatch) -> tuple[Recorder, Recorder]:
    """The float8 kernels (per tensor, per row) as recorders, with the GPU's tiles."""
    pytest.importorskip("triton.runtime._async_compile")
    kernels = Recorder(), Recorder()
    monkeypatch.setattr(float8_kernels, "float8_kernels", lambda: kernels)
    monkeypatch.setattr(float8_kernels, "interpreting", lambda: False)
    return kernels


def launches_launch() -> bool:
    """Whether a launch through `launch` now runs its kernel (rather than only compiling it)."""
    probe = Recorder()
    triton_compile.launch(probe, (1,), 3, BLOCK=16)
    return bool(probe.launched) and not probe.compiled


def float8_warm_up_writes(per_tensor: bool):
    """The float8 warm-up's writes, made with CPU tensors (the recorders run nothing)."""
    return lambda: float8_warm_up.warm_up_float8_writes(torch.device("cpu"), per_tensor, SHAPES, torch.bfloat16)


@pytest.mark.parametrize("per_tensor", [False, True], ids=["per row", "per tensor"])
def test_on_cuda_the_warm_up_compiles_in_async_mode_exactly_the_variants_it_then_launches(recorders, per_tensor):
    kernel = recorders[1 if not per_tensor else 0]
    triton_compile.compiled_in_parallel(torch.device("cuda"), float8_warm_up_writes(per_tensor), threads=4)
    assert kernel.launched, "the warm-up launched nothing"
    assert kernel.compiled == kernel.launched
    assert kernel.in_async_mode == {True}
    assert launches_launch(), "launches launch again after the warm-up"


def test_on_cuda_the_plain_kernels_warm_up_compiles_the_variants_it_then_launches(monkeypatch):
    """LoRA, LoHa and DoRA: each kernel's launches go through `launch` too."""
    pytest.importorskip("triton.runtime._async_compile")
    recorded = {name: Recorder() for name in ("lora_kernel", "loha_kernel", "dora_kernel")}
    for name, recorder in recorded.items():
        monkeypatch.setattr(kernels, name, lambda recorder=recorder: recorder)
    writes = lambda: kernels.warm_up_writes(torch.device("cpu"), torch.bfloat16, [3072, 3080])  # noqa: E731
    triton_compile.compiled_in_parallel(torch.device("cuda"), writes, threads=4)
    for name, recorder in recorded.items():
        assert recorder.launched and recorder.compiled == recorder.launched, name
        assert recorder.in_async_mode == {True}, name


def test_off_cuda_or_on_one_thread_the_warm_up_only_launches(recorders):
    for device, threads in ((torch.device("cpu"), 4), (torch.device("cuda"), 1)):
        triton_compile.compiled_in_parallel(device, float8_warm_up_writes(False), threads=threads)
    assert recorders[1].launched and not recorders[1].compiled


def test_a_variant_that_fails_to_compile_fails_the_warm_up_before_anything_launches(recorders, monkeypatch):
    failing = Recorder(fail=True)
    monkeypatch.setattr(float8_kernels, "float8_kernels", lambda: (failing, failing))
    with pytest.raises(RuntimeError, match="ptxas failed"):
        triton_compile.compiled_in_parallel(torch.device("cuda"), float8_warm_up_writes(False), threads=4)
    assert not failing.launched
    assert launches_launch()


def test_without_async_compile_mode_the_warm_up_runs_once_and_launches(recorders, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton.runtime._async_compile", None)  # as a Triton before 3.4: no such module
    triton_compile.compiled_in_parallel(torch.device("cuda"), float8_warm_up_writes(False), threads=4)
    assert recorders[1].launched and not recorders[1].compiled
