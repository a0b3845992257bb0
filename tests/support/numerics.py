"""Shared test helpers: comparisons and weight snapshots."""

import numpy as np
import torch


def rel_err(actual, expected) -> float:
    """||actual - expected|| / ||expected|| over all elements."""
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def image_array(pipeline, prompt="an elephant in the snow", seed=0, **kwargs) -> np.ndarray:
    """A 64x64, 2-step image as floats, seeded like the server (CPU generator)."""
    kwargs = dict(num_inference_steps=2, width=64, height=64, **kwargs)
    return pipeline(prompt, generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **kwargs).images[0]


def weights_snapshot(components: dict) -> dict[str, torch.Tensor]:
    return {f"{c}.{k}": v.detach().clone() for c, m in components.items() for k, v in m.state_dict().items()}


def assert_bitwise_equal(before: dict, components: dict) -> None:
    after = weights_snapshot(components)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"{len(changed)} tensors changed, e.g. {changed[:3]}"
