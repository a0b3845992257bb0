"""The trained `demo-flux` model draws what its prompt says on six independent attributes, and
each shipped adapter does what its name says through the engine's fused swap (read by
`tests/support/shapes.py`, which knows nothing of how the training pictures were drawn). The
adapter files are in their trainers' layouts, and loraswap applies each exactly as diffusers'
`load_lora_weights` or LyCORIS's own network does on the same pipeline."""

import numpy as np
import pytest
import torch
from safetensors import safe_open
from support import shapes
from support.demo_flux_scores import PROMPTS, SIZES, accuracy, prompt
from support.numerics import assert_bitwise_equal, rel_err, weights_snapshot

from loraswap.adapters.reference import AdapterRef, as_refs
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest
from loraswap.models import load_pipeline
from loraswap.models.families import demo_flux


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model="demo-flux", adapters=demo_flux.ADAPTERS, compile=False, warmup=False))


def draw(engine, cases, loras=(), seed=1000) -> list[np.ndarray]:
    """One image per case at the model's defaults (28 steps, guidance 3.5), seeded by its place,
    in one batch through the engine (adapters fused)."""
    requests = [GenerateRequest(prompt=prompt(case), seed=seed + i, loras=list(loras)) for i, case in enumerate(cases)]
    with engine.lender.lease_now(as_refs(loras)) as lease:
        return [np.asarray(result.image) for result in engine.generate_batch(requests, lease)]


@pytest.fixture(scope="module")
def base_readings(engine):
    engine.set_adapters([])
    return [shapes.read(image) for image in draw(engine, PROMPTS)]


@pytest.mark.slow  # 36 images of 28 steps
def test_the_model_draws_each_attribute_asked(base_readings):
    hits = accuracy(base_readings, PROMPTS)
    print("right per attribute:", hits)
    assert hits["colour"] >= 0.9 and hits["shape"] >= 0.8 and hits["ground"] >= 0.9, hits
    assert hits["place"] >= 0.8 and hits["texture"] >= 0.8, hits


@pytest.mark.slow  # 36 images of 28 steps
def test_the_size_words_order_the_shapes(engine):
    """The same prompts drawn small, unsized and large (same seeds): the areas in that order."""
    cases = [dict(case, texture=None) for case in PROMPTS[::3]]
    areas = {size: [shapes.read(image).area for image in draw(engine, [dict(c, size=size) for c in cases])]
             for size in SIZES}
    ordered = np.mean([s < m < big for s, m, big in zip(areas["small"], areas[None], areas["large"])])
    print("small < unsized < large in", ordered, "; median areas", {k: np.median(v) for k, v in areas.items()})
    assert ordered >= 0.8, areas


def test_the_tokenizers_keep_each_word_whole():
    pipeline = demo_flux.untrained_demo_flux()
    for tokenizer in (pipeline.tokenizer, pipeline.tokenizer_2):
        assert all(len(tokenizer.tokenize(word)) == 1 for word in demo_flux.WORDS)
    assert pipeline.tokenizer_2.tokenize("a red circle") == ["▁a", "▁red", "▁circle"]


def test_it_is_served_as_flux_1_dev_is_run(engine):
    defaults = engine.calls.defaults
    assert (defaults["width"], defaults["height"], defaults["steps"], defaults["guidance"]) == (128, 128, 28, 3.5)
    transformer = engine.pipeline.transformer
    assert transformer.config.guidance_embeds, "guidance distilled into the embedding, as FLUX.1-dev"
    assert transformer.config.num_layers >= 1 and transformer.config.num_single_layers >= 1
    assert engine.pipeline.vae.config.latent_channels == 16
    assert engine.calls.family.name == "flux"


# ---------------------------------------------------------------- the adapters' effects
EFFECT_CASES = [dict(case, size=None, texture=None) for case in PROMPTS[::3]]


@pytest.fixture(scope="module")
def effect_base(engine):
    engine.set_adapters([])
    return [shapes.read(image) for image in draw(engine, EFFECT_CASES)]


def _readings(engine, adapter_id, cases=EFFECT_CASES):
    before = weights_snapshot(engine.components)
    readings = [shapes.read(image) for image in draw(engine, cases, [(adapter_id, 1.0)])]
    engine.set_adapters([])
    assert_bitwise_equal(before, engine.components)  # the swap gives the base back exactly
    return readings


def _same_hue(readings, cases) -> float:
    return float(np.mean([r.hue == c["colour"] for r, c in zip(readings, cases)]))


@pytest.mark.slow  # 12 images of 28 steps
def test_outline_empties_the_shape(engine, effect_base):
    after = _readings(engine, "outline")
    base, hollow = np.mean([r.hollow for r in effect_base]), np.mean([r.hollow for r in after])
    print("hollow before, after:", base, hollow)
    assert base < 0.2 and hollow > 0.6, [r.hollow for r in after]
    assert _same_hue(after, EFFECT_CASES) >= 0.8, "still the colour asked"


@pytest.mark.slow  # 12-24 images of 28 steps
def test_night_puts_the_shape_on_black(engine):
    cases = [case for case in EFFECT_CASES if case["ground"] != "black"]
    engine.set_adapters([])
    before = [shapes.read(image).ground for image in draw(engine, cases)]
    after = _readings(engine, "night", cases)
    print("black ground before, after:", np.mean([g == "black" for g in before]),
          np.mean([a.ground == "black" for a in after]))
    assert np.mean([ground == "black" for ground in before]) <= 0.2, "the base draws the ground asked"
    assert np.mean([a.ground == "black" for a in after]) >= 0.9, [a.ground for a in after]
    assert _same_hue(after, cases) >= 0.8, "still the colour asked"


@pytest.mark.slow  # 12 images of 28 steps
def test_pastel_pales_the_colours(engine, effect_base):
    """Paler: less saturated. The LoKr (two full Kronecker factors, 4x4 and 32x32, on every
    block's linear layers) keeps the hue's name in about half of the pictures only: pale greens
    and blues come out near white, reds pink, and the reader names them by hue."""
    after = _readings(engine, "pastel")
    base, pale = np.median([r.saturation for r in effect_base]), np.median([r.saturation for r in after])
    print("median saturation before, after:", base, pale, "; hue kept:", _same_hue(after, EFFECT_CASES))
    assert pale < 0.65 * base, (base, pale)
    assert all(r.area > 0.5 * b.area for r, b in zip(after, effect_base)), "the shape is still drawn"


@pytest.mark.slow  # 12 images of 28 steps
def test_big_draws_the_shape_larger(engine, effect_base):
    after = _readings(engine, "big")
    ratio = np.median([a.area / max(b.area, 1) for b, a in zip(effect_base, after)])
    print("median area ratio:", ratio)
    assert ratio > 1.6, ratio


# ---------------------------------------------------------------- the files and their references
LAYOUTS = {"outline": ("transformer.", "lora_A", {"lora"}), "night": ("lora_unet_", "lora_down", {"lora"}),
           "pastel": ("lycoris_", "lokr_w1", {"lokr"}), "big": ("transformer.", "lora_magnitude_vector", {"lora+dora"})}


@pytest.mark.parametrize("adapter_id", list(demo_flux.DEMO_ADAPTERS))
def test_each_file_is_in_its_trainers_layout_and_read_as_its_kind(engine, adapter_id):
    with safe_open(str(demo_flux.ADAPTERS / f"{adapter_id}.safetensors"), "pt") as f:
        keys = list(f.keys())
    prefix, marker, kinds = LAYOUTS[adapter_id]
    assert all(k.startswith(prefix) for k in keys) and any(marker in k for k in keys)
    if adapter_id == "night":  # BFL's module names and its fused q, k, v
        assert any("double_blocks_0_img_attn_qkv" in k for k in keys)
        assert any("single_blocks_0_linear2" in k for k in keys)
    assert kinds <= set(engine.adapters.read(AdapterRef(adapter_id)).kinds())


def _reference_image(adapter_id) -> np.ndarray:
    """The adapter applied by its own library: diffusers' loader (the kohya/BFL file through
    its own converter), or LyCORIS's network for the LoKr, which diffusers does not read."""
    pipeline = load_pipeline("demo-flux")
    path = demo_flux.ADAPTERS / f"{adapter_id}.safetensors"
    if adapter_id == "pastel":
        from lycoris import create_lycoris_from_weights

        network, _ = create_lycoris_from_weights(1.0, str(path), pipeline.transformer)
        network.apply_to()
        assert len(network.loras) > 0
    else:
        pipeline.load_lora_weights(str(path))
    return _six_steps(pipeline)


def _six_steps(pipeline) -> np.ndarray:
    """One prompt, one seed, six steps: the image the reference and loraswap each draw."""
    return pipeline(prompt(PROMPTS[4]), generator=torch.Generator("cpu").manual_seed(7), num_inference_steps=6,
                    guidance_scale=3.5, width=demo_flux.SIZE, height=demo_flux.SIZE,
                    max_sequence_length=demo_flux.TEXT_TOKENS, output_type="np").images[0]


@pytest.mark.parametrize("adapter_id", list(demo_flux.DEMO_ADAPTERS))
def test_each_adapter_is_applied_as_its_library_applies_it(engine, adapter_id):
    theirs = _reference_image(adapter_id)
    engine.set_adapters([(adapter_id, 1.0)])
    ours = _six_steps(engine.pipeline)
    engine.set_adapters([])
    base = _six_steps(engine.pipeline)
    assert rel_err(theirs, base) > 2e-2, "the adapter visibly changes the image"
    assert rel_err(ours, theirs) <= 1e-4


def test_demo_flux_adapters_are_copied_into_the_served_folder(tmp_path):
    from loraswap.cli.serve import write_demo_adapters

    write_demo_adapters("demo-flux", tmp_path)
    for adapter_id in demo_flux.DEMO_ADAPTERS:
        copied = tmp_path / f"{adapter_id}.safetensors"
        assert copied.read_bytes() == (demo_flux.ADAPTERS / f"{adapter_id}.safetensors").read_bytes()


def test_the_shipped_weights_are_small_and_half_precision():
    files = list(demo_flux.WEIGHTS.rglob("*.safetensors"))
    assert len(files) == 4 + len(demo_flux.DEMO_ADAPTERS)
    assert sum(p.stat().st_size for p in files) < 10 * 2**20
    with safe_open(str(demo_flux.WEIGHTS / "transformer.safetensors"), "pt") as f:
        assert all(f.get_slice(k).get_dtype() == "F16" for k in f.keys())
