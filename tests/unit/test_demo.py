"""The trained `demo` model draws what its prompt says, and each shipped adapter does what its
name says, through the engine's fused swap (read by `tests/shapes.py`, which knows nothing
of how the training pictures were drawn). The adapter files are those of their trainers'
libraries, and loraswap applies them as those libraries do."""

import numpy as np
import pytest
import torch
from safetensors import safe_open
from support import shapes
from support.numerics import assert_bitwise_equal, rel_err, weights_snapshot

from loraswap.adapters.reference import AdapterRef, as_refs
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest
from loraswap.models import load_pipeline
from loraswap.models.families import demo

POSITIONS = ("left", "center", "right")
GROUNDS = ("white", "black", "gray")
# every colour with every shape, each twice, at positions and on grounds taken in turn
PROMPTS = [(colour, shape, POSITIONS[i % 3], GROUNDS[(i + j) % 3])
           for i, colour in enumerate(demo.COLOURS) for j, shape in enumerate(demo.SHAPES * 2)]


def prompt(colour, shape, position, ground):
    return f"a {colour} {shape} at the {position} on {ground}"


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model="demo", adapters=demo.ADAPTERS, compile=False, warmup=False))


def draw(engine, cases, loras=()) -> list[np.ndarray]:
    """One image per case, seeded by its place, in one batch through the engine (adapters fused)."""
    requests = [GenerateRequest(prompt=prompt(*case), seed=1000 + i, loras=list(loras))
                for i, case in enumerate(cases)]
    with engine.lender.lease_now(as_refs(loras)) as lease:
        return [np.asarray(result.image) for result in engine.generate_batch(requests, lease)]


def test_the_demo_model_draws_the_colour_and_shape_asked(engine):
    readings = [shapes.read(image) for image in draw(engine, PROMPTS)]
    hits = {key: np.mean([getattr(r, key) == case[k] for r, case in zip(readings, PROMPTS)])
            for key, k in (("hue", 0), ("shape", 1), ("ground", 3))}
    places = np.mean([abs(r.x - demo.POSITIONS[case[2]]) < 0.12 for r, case in zip(readings, PROMPTS)])
    print("right colour, shape, ground:", hits, "place:", places)
    assert hits["hue"] >= 0.9 and hits["shape"] >= 0.9, hits
    # the ground and the place steer it too, less surely (one in three by chance)
    assert hits["ground"] >= 0.6 and places >= 0.5, (hits, places)


def test_the_tokenizer_keeps_each_word_whole_and_the_prompt_steers():
    tokenizer = demo.demo_tokenizer()
    assert all(len(tokenizer.tokenize(word)) == 1 for word in demo.WORDS)
    assert tokenizer.tokenize("a red circle") == ["a</w>", "red</w>", "circle</w>"]


# the same prompts with and without each adapter: what its name says, measured
EFFECT_CASES = PROMPTS[::3]


@pytest.fixture(scope="module")
def base_readings(engine):
    engine.set_adapters([])
    return [shapes.read(image) for image in draw(engine, EFFECT_CASES)]


def _readings(engine, adapter_id, cases=EFFECT_CASES):
    before = weights_snapshot(engine.components)
    readings = [shapes.read(image) for image in draw(engine, cases, [(adapter_id, 1.0)])]
    engine.set_adapters([])
    assert_bitwise_equal(before, engine.components)  # the swap gives the base back exactly
    return readings


@pytest.mark.slow  # draws 8-24 images
def test_outline_empties_the_shape(engine, base_readings):
    after = _readings(engine, "outline")
    print("hollow before, after:", np.mean([r.hollow for r in base_readings]), np.mean([r.hollow for r in after]))
    assert np.mean([r.hollow for r in base_readings]) < 0.2
    assert np.mean([r.hollow for r in after]) > 0.6, [r.hollow for r in after]
    assert np.mean([r.hue == c[0] for r, c in zip(after, EFFECT_CASES)]) >= 0.8, "still the colour asked"


@pytest.mark.slow  # draws 8-24 images
def test_striped_fills_the_shape_with_bands(engine, base_readings):
    after = _readings(engine, "striped")
    base, striped = np.mean([r.empty_rows for r in base_readings]), np.mean([r.empty_rows for r in after])
    print("empty rows inside the shape before, after:", base, striped)
    assert striped > base + 0.2, (base, striped)


@pytest.mark.slow  # draws 8-24 images
def test_pastel_pales_the_colours(engine, base_readings):
    after = _readings(engine, "pastel")
    base, pale = np.median([r.saturation for r in base_readings]), np.median([r.saturation for r in after])
    print("median saturation before, after:", base, pale)
    assert pale < 0.65 * base, (base, pale)
    assert np.mean([r.hue == c[0] for r, c in zip(after, EFFECT_CASES)]) >= 0.8, "the same hue, paler"


@pytest.mark.slow  # draws 8-24 images
def test_night_puts_the_shape_on_black(engine):
    cases = [case for case in PROMPTS if case[3] != "black"]  # 24: a miss moves the share by 4 %
    engine.set_adapters([])
    before = [shapes.read(image).ground for image in draw(engine, cases)]
    after = _readings(engine, "night", cases)
    print("black ground before, after:", np.mean([g == "black" for g in before]),
          np.mean([a.ground == "black" for a in after]))
    assert np.mean([ground == "black" for ground in before]) <= 0.3, "the base mostly draws the ground asked"
    assert np.mean([a.ground == "black" for a in after]) >= 0.9, [a.ground for a in after]
    assert np.mean([a.hue == c[0] for a, c in zip(after, cases)]) >= 0.8, "still the colour asked"


@pytest.mark.slow  # draws 8-24 images
def test_big_draws_the_shape_larger(engine, base_readings):
    after = _readings(engine, "big")
    ratio = np.median([a.area / max(b.area, 1) for b, a in zip(base_readings, after)])
    print("median area ratio:", ratio)
    assert ratio > 1.6, ratio


# ---------------------------------------------------------------- the files and their references
KINDS = {"outline": ("lora_down", {"lora"}), "striped": ("lora_down", {"lora", "locon"}),
         "pastel": ("hada_w1", {"loha"}), "night": ("lokr_w1", {"lokr"}),
         "big": ("lora_magnitude_vector", {"lora+dora"})}


@pytest.mark.parametrize("adapter_id", list(demo.DEMO_ADAPTERS))
def test_each_file_is_in_its_trainers_layout_and_read_as_its_kind(engine, adapter_id):
    with safe_open(str(demo.ADAPTERS / f"{adapter_id}.safetensors"), "pt") as f:
        keys = list(f.keys())
    marker, kinds = KINDS[adapter_id]
    assert any(marker in k for k in keys)
    if adapter_id == "big":  # PEFT names, as diffusers' save_lora_weights writes them
        assert all(k.startswith("unet.") for k in keys)
    else:  # kohya names, as LyCORIS writes them
        assert all(k.startswith("lora_unet_") for k in keys)
    if adapter_id == "striped":  # LoCon: the ResNets' 3x3 convolutions too
        assert any("resnets" in k and "conv1" in k for k in keys)
    assert kinds <= set(engine.adapters.read(AdapterRef(adapter_id)).kinds())


def _reference_image(adapter_id) -> np.ndarray:
    """The adapter applied by its own library: LyCORIS's network, or diffusers' PEFT loader."""
    pipeline = load_pipeline("demo")
    path = demo.ADAPTERS / f"{adapter_id}.safetensors"
    if adapter_id == "big":
        pipeline.load_lora_weights(str(path))
    else:
        from lycoris import LycorisNetwork, create_lycoris_from_weights

        LycorisNetwork.LORA_PREFIX = "lora_unet"  # the kohya names the file has
        try:
            network, _ = create_lycoris_from_weights(1.0, str(path), pipeline.unet)
        finally:
            LycorisNetwork.LORA_PREFIX = "lycoris"
        network.apply_to()
        assert len(network.loras) > 0
    return _six_steps(pipeline)


def _six_steps(pipeline) -> np.ndarray:
    """One prompt, one seed, six steps: the image the reference and loraswap each draw."""
    return pipeline(prompt(*PROMPTS[4]), generator=torch.Generator("cpu").manual_seed(7), num_inference_steps=6,
                    width=32, height=32, output_type="np").images[0]


@pytest.mark.parametrize("adapter_id", list(demo.DEMO_ADAPTERS))
def test_each_adapter_is_applied_as_its_library_applies_it(engine, adapter_id):
    theirs = _reference_image(adapter_id)
    engine.set_adapters([(adapter_id, 1.0)])
    ours = _six_steps(engine.pipeline)
    engine.set_adapters([])
    base = _six_steps(engine.pipeline)
    assert rel_err(theirs, base) > 2e-2, "the adapter visibly changes the image"
    assert rel_err(ours, theirs) <= 1e-4


def test_demo_adapters_are_copied_into_the_served_folder_once(tmp_path):
    from loraswap.cli.serve import write_demo_adapters

    (tmp_path / "mine.safetensors").write_bytes(b"not touched")
    write_demo_adapters("demo", tmp_path)
    for adapter_id in demo.DEMO_ADAPTERS:
        copied = tmp_path / f"{adapter_id}.safetensors"
        assert copied.read_bytes() == (demo.ADAPTERS / f"{adapter_id}.safetensors").read_bytes()
    (tmp_path / "outline.safetensors").write_bytes(b"changed by the user")
    write_demo_adapters("demo", tmp_path)
    assert (tmp_path / "outline.safetensors").read_bytes() == b"changed by the user"
    assert (tmp_path / "mine.safetensors").read_bytes() == b"not touched"


def test_the_shipped_weights_are_small():
    files = [p for p in demo.WEIGHTS.rglob("*.safetensors")]
    assert len(files) == 3 + len(demo.DEMO_ADAPTERS)
    assert sum(p.stat().st_size for p in files) < 6 * 2**20
