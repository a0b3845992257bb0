"""The benchmarks' transformer inputs (`bench.swap_setup.denoiser_inputs`) are what each
family's diffusers pipeline passes its transformer: the same arguments, shapes and dtypes,
captured from the pipeline's own call."""

import pytest
import torch

from loraswap.bench.swap_setup import denoiser_inputs
from loraswap.models import denoiser_name
from loraswap.models.presets import build_preset

IGNORED = ("joint_attention_kwargs", "attention_kwargs")  # (None or {}: the model's default either way)


class Captured(Exception):
    pass


def pipeline_call(pipeline, denoiser, **options) -> dict:
    """The keyword arguments of the pipeline's first denoiser call (which is not run)."""
    seen: dict = {}

    def capture(module, args, kwargs):
        assert not args
        seen.update(kwargs)
        raise Captured

    hook = denoiser.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with pytest.raises(Captured):
            pipeline(prompt="a cat on a mat", num_inference_steps=1, width=64, height=64, output_type="latent",
                     **options)
    finally:
        hook.remove()
    return seen


def described(value):
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    return value


@pytest.mark.parametrize("preset, options", [("tiny-flux", {}), ("tiny-flux2", {}), ("tiny-qwen-image", {}),
                                             ("tiny-wan", {"num_frames": 5})])
def test_the_benchmarks_denoiser_inputs_are_the_pipelines(preset, options):
    pipeline = build_preset(preset)
    denoiser = getattr(pipeline, denoiser_name(pipeline))
    passed = pipeline_call(pipeline, denoiser, **options)
    text = passed.get("encoder_hidden_states")
    ours = denoiser_inputs(denoiser, 64, 64, "cpu", torch.float32, frames=options.get("num_frames", 33),
                           text_tokens=None if text is None or "qwen" not in preset else text.shape[1])
    expected = {k: described(v) for k, v in passed.items() if k not in IGNORED and v is not None}
    assert {k: described(v) for k, v in ours.items() if v is not None} == expected
    with torch.no_grad():
        out = denoiser(**ours)[0]
    assert out.shape == ours["hidden_states"].shape
