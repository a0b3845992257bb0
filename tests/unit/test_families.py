"""Every family's tiny preset with an adapter, served by loraswap, against diffusers' own
`load_lora_weights` on the same model, seed and inputs; and the base back bitwise after."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file
from support.numerics import assert_bitwise_equal, rel_err, weights_snapshot

from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest
from loraswap.errors import AdapterIncompatible, BadRequest
from loraswap.models import PRESET_FAMILIES, load_pipeline

# preset -> how its adapters are scaled up (the tiny VAEs damp changes, and the effect check
# needs a visible one) and whether diffusers' loader for the family takes text-encoder keys
CASES = {
    "tiny-sd3": dict(alpha_factor=6.0, text_encoder=True),
    "tiny-flux-kontext": dict(alpha_factor=6.0, text_encoder=True),
    "tiny-flux2": dict(alpha_factor=30.0, text_encoder=False),
    "tiny-qwen-image": dict(alpha_factor=20.0, text_encoder=False),
    "tiny-qwen-image-edit": dict(alpha_factor=20.0, text_encoder=False),
    "tiny-z-image": dict(alpha_factor=6.0, text_encoder=False),
    "tiny-wan": dict(alpha_factor=6.0, text_encoder=False),
}
PROMPT = "a lighthouse on a cliff"


def input_image() -> Image.Image:
    x, y = np.meshgrid(np.arange(64), np.arange(64))
    return Image.fromarray(np.stack([x * 4, y * 4, (x + y) * 2], -1).astype(np.uint8))


def frames_array(frames: list[Image.Image]) -> np.ndarray:
    return np.stack([np.asarray(f, dtype=np.float64) for f in frames])


def pipeline_output(pipeline, family, request: GenerateRequest) -> np.ndarray:
    """What `pipeline` makes for `request`, as floats in [0, 1] (frames, height, width, 3)."""
    kwargs = dict(num_inference_steps=request.steps, width=64, height=64, output_type="np",
                  generator=torch.Generator("cpu").manual_seed(request.seed))
    if request.image is not None:
        kwargs["image"] = request.image
    if family.name == "flux-kontext":  # the asked size, not Kontext's ~1 MP default
        kwargs.update(max_area=64 * 64, _auto_resize=False)
    if family.output == "video":
        return np.asarray(pipeline(prompt=PROMPT, num_frames=request.frames, **kwargs).frames[0])
    return np.asarray(pipeline(prompt=PROMPT, **kwargs).images)


def load_reference_adapter(pipeline, path, folder) -> None:
    """diffusers' own loading of the adapter. Its Wan loader reads only `transformer.` keys and
    skips `transformer_2.` ones without an error: those go in as a file of their own, named
    `transformer.` (its scales too), with `load_into_transformer_2`."""
    pipeline.load_lora_weights(str(path), adapter_name="ref")
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
        second = {k.replace("transformer_2.", "transformer.", 1): f.get_tensor(k) for k in f.keys()
                  if k.startswith("transformer_2.")}
    if second:
        scales = {k.replace("transformer_2.", "transformer.", 1): v
                  for k, v in json.loads(metadata["lora_adapter_metadata"]).items() if k.startswith("transformer_2.")}
        second_path = folder / "transformer_2.safetensors"
        save_file(second, str(second_path), metadata={"format": "pt", "lora_adapter_metadata": json.dumps(scales)})
        pipeline.load_lora_weights(str(second_path), adapter_name="ref_2", load_into_transformer_2=True)
        pipeline.set_adapters(["ref", "ref_2"])  # both experts' adapters on (naming one turns the other off)


def present(presets):
    return [p for p in presets if p in PRESET_FAMILIES]


@pytest.mark.parametrize("preset", [  # (Qwen-Image-Edit, the slowest, in `make test`; Qwen-Image in both)
    pytest.param(p, marks=pytest.mark.slow) if p == "tiny-qwen-image-edit" else p for p in present(CASES)])
def test_family_matches_diffusers_load_lora_weights(preset, adapter_factory, tmp_path):
    case, family = CASES[preset], PRESET_FAMILIES[preset]
    rank = 8
    path = adapter_factory(f"family-{preset}", preset, rank=rank, targets="all", text_encoder=case["text_encoder"],
                           alpha=rank * case["alpha_factor"], seed=31)
    engine = Engine(EngineConfig(model=preset, adapters=path.parent, compile=False, warmup=False))
    original = weights_snapshot(engine.components)
    request = GenerateRequest(prompt=PROMPT, seed=2, steps=4, frames=family.defaults.get("frames"),
                              image=input_image() if family.image_input in ("edit", "required") else None)
    base = engine.generate(request)
    ours = engine.generate(request.with_loras([(path.stem, 1.0)]))
    assert (ours.frames is not None) == (family.output == "video")
    ours_frames = frames_array(ours.frames or [ours.image])

    reference = load_pipeline(preset)
    load_reference_adapter(reference, path, tmp_path)
    theirs = pipeline_output(reference, family, request)
    fused = pipeline_output(engine.calls.pipeline("text"), family, request)  # the adapter is still applied

    assert np.abs(ours_frames - frames_array(base.frames or [base.image])).mean() >= 1.0, \
        "the adapter must visibly change the output"
    assert rel_err(fused, theirs) <= 1e-4
    # what the engine serves is those pixels in 8 bits (fused weights and PEFT's forward
    # round differently, so a pixel near a level's edge may land on the next one)
    assert np.abs(ours_frames - theirs * 255).mean() <= 0.55
    engine.set_adapters([])
    assert_bitwise_equal(original, engine.components)


def test_load_and_fuse_baseline_swaps_both_wan_experts(adapter_factory):
    """The baseline (diffusers' loader) puts `transformer_2.` keys on Wan 2.2's second expert too."""
    path = adapter_factory("family-wan-baseline", "tiny-wan", rank=4, targets="all", alpha=24.0, seed=32)
    request = GenerateRequest(prompt=PROMPT, seed=2, steps=4, frames=5, loras=[(path.stem, 1.0)])
    fused = Engine(EngineConfig(model="tiny-wan", adapters=path.parent, compile=False, warmup=False))
    baseline = Engine(EngineConfig(model="tiny-wan", adapters=path.parent, swap_mode="load-and-fuse", warmup=False))
    ours, theirs = frames_array(fused.generate(request).frames), frames_array(baseline.generate(request).frames)
    base = frames_array(baseline.generate(request.with_loras([])).frames)
    assert np.abs(theirs - base).mean() >= 1.0
    assert np.abs(ours - theirs).max() <= 2 and np.abs(ours - theirs).mean() <= 0.05


def test_video_progress_is_reported_after_each_denoising_step():
    engine = Engine(EngineConfig(model="tiny-wan", compile=False, warmup=False))
    steps = []
    with engine.lender.lease_now([]) as lease:
        engine.generate_batch([GenerateRequest(prompt=PROMPT, seed=1, steps=3, frames=5)], lease,
                              lambda done, total: steps.append((done, total)))
    assert steps == [(1, 3), (2, 3), (3, 3)]


def _down_up(shape, rank: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    down = torch.randn(rank, shape[1], generator=generator) / shape[1] ** 0.5
    up = torch.randn(shape[0], rank, generator=generator) * (0.5 / rank ** 0.5)
    return down, up


def _kohya_pair(prefix: str, shape, rank: int, alpha: float, generator: torch.Generator) -> dict:
    down, up = _down_up(shape, rank, generator)
    return {f"{prefix}.lora_down.weight": down, f"{prefix}.lora_up.weight": up,
            f"{prefix}.alpha": torch.tensor(alpha)}


def _comfy_wan(transformer, rank, alpha, generator) -> dict:
    """Wan's original names under `diffusion_model.` (ComfyUI, lightx2v): one expert's file."""
    names = {"attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
             "attn1.to_out.0": "self_attn.o", "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k",
             "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o", "ffn.net.0.proj": "ffn.0",
             "ffn.net.2": "ffn.2"}
    keys = {}
    for i, block in enumerate(transformer.blocks):
        for ours, theirs in names.items():
            shape = block.get_submodule(ours).weight.shape
            keys |= _kohya_pair(f"diffusion_model.blocks.{i}.{theirs}", shape, rank, alpha, generator)
    return keys


def _kohya_qwen(transformer, rank, alpha, generator) -> dict:
    """kohya / musubi names (`lora_unet_transformer_blocks_0_attn_to_q`) of Qwen-Image's layers."""
    keys = {}
    for i, block in enumerate(transformer.transformer_blocks):
        for name in ("attn.to_q", "attn.to_k", "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj",
                     "txt_mlp.net.2", "img_mod.1"):
            shape = block.get_submodule(name).weight.shape
            keys |= _kohya_pair(f"lora_unet_transformer_blocks_{i}_{name.replace('.', '_')}", shape, rank, alpha,
                                generator)
    return keys


def _original_z_image(transformer, rank, alpha, generator, fused_qkv: bool = False) -> dict:
    """Z-Image's original names under `diffusion_model.`: `attention.out` (diffusers'
    `to_out.0`), `feed_forward.w1`; with `fused_qkv`, a fused `attention.qkv` too."""
    keys = {}
    for i, layer in enumerate(transformer.layers):
        dim = layer.attention.to_q.weight.shape[1]
        if fused_qkv:
            keys |= _kohya_pair(f"diffusion_model.layers.{i}.attention.qkv", (3 * dim, dim), rank, alpha, generator)
        keys |= _kohya_pair(f"diffusion_model.layers.{i}.attention.out", (dim, dim), rank, alpha, generator)
        keys |= _kohya_pair(f"diffusion_model.layers.{i}.feed_forward.w1", layer.feed_forward.w1.weight.shape, rank,
                            alpha, generator)
    return keys


TRAINER_LAYOUTS = {"wan-comfyui": ("tiny-wan", _comfy_wan), "qwen-image-kohya": ("tiny-qwen-image", _kohya_qwen),
                   "z-image-original": ("tiny-z-image", _original_z_image)}


@pytest.mark.parametrize("layout", sorted(TRAINER_LAYOUTS))
def test_trainer_layouts_match_diffusers(layout, tmp_path):
    """Files in the trainers' own naming, placed by loraswap as diffusers' loader of the family
    places them (converted, fused projections split)."""
    preset, write = TRAINER_LAYOUTS[layout]
    family = PRESET_FAMILIES[preset]
    engine = Engine(EngineConfig(model=preset, adapters=tmp_path, compile=False, warmup=False))
    keys = write(engine.pipeline.transformer, 4, 16.0, torch.Generator().manual_seed(40))
    save_file(keys, str(tmp_path / f"{layout}.safetensors"))
    request = GenerateRequest(prompt=PROMPT, seed=2, steps=3, frames=family.defaults.get("frames"))
    base = pipeline_output(engine.pipeline, family, request)
    engine.set_adapters([(layout, 1.0)])
    ours = pipeline_output(engine.pipeline, family, request)

    reference = load_pipeline(preset)
    reference.load_lora_weights(str(tmp_path / f"{layout}.safetensors"))
    theirs = pipeline_output(reference, family, request)
    assert rel_err(theirs, base) >= 1e-2, "the adapter must change the output"
    assert rel_err(ours, theirs) <= 1e-4


def test_a_fused_qkv_diffusers_drops_is_refused_naming_it(tmp_path):
    """diffusers' Z-Image loader drops a kohya-style fused `attention.qkv` with a warning;
    loraswap refuses the file, naming the key, and changes nothing."""
    engine = Engine(EngineConfig(model="tiny-z-image", adapters=tmp_path, compile=False, warmup=False))
    keys = _original_z_image(engine.pipeline.transformer, 4, 16.0, torch.Generator().manual_seed(41), fused_qkv=True)
    save_file(keys, str(tmp_path / "fused.safetensors"))
    original = weights_snapshot(engine.components)
    with pytest.raises(AdapterIncompatible, match=r"attention\.qkv"):
        engine.set_adapters([("fused", 1.0)])
    assert_bitwise_equal(original, engine.components)


def test_a_wan_expert_pair_folder_swaps_both_experts_as_diffusers_loads_them(tmp_path):
    """Wan 2.2 adapters are published as a folder of two files, one per expert
    (`high_noise_model.safetensors`, `low_noise_model.safetensors`, ComfyUI naming): one
    adapter id, the first file on `transformer`, the second on `transformer_2`."""
    engine = Engine(EngineConfig(model="tiny-wan", adapters=tmp_path, compile=False, warmup=False))
    folder = tmp_path / "lightning"
    folder.mkdir()
    for name, seed in (("high_noise_model", 42), ("low_noise_model", 43)):
        keys = _comfy_wan(engine.pipeline.transformer, 4, 16.0, torch.Generator().manual_seed(seed))
        save_file(keys, str(folder / f"{name}.safetensors"))
    assert "lightning" in engine.adapters.source.list_ids()
    family, request = PRESET_FAMILIES["tiny-wan"], GenerateRequest(prompt=PROMPT, seed=2, steps=4, frames=5)
    original = weights_snapshot(engine.components)
    engine.set_adapters([("lightning", 1.0)])
    changed = {key.split(".")[0] for key, value in weights_snapshot(engine.components).items()
               if not torch.equal(value, original[key])}
    assert changed == {"transformer", "transformer_2"}
    ours = pipeline_output(engine.pipeline, family, request)

    reference = load_pipeline("tiny-wan")
    reference.load_lora_weights(str(folder / "high_noise_model.safetensors"), adapter_name="lightning")
    reference.load_lora_weights(str(folder / "low_noise_model.safetensors"), adapter_name="lightning",
                                load_into_transformer_2=True)
    assert rel_err(ours, pipeline_output(reference, family, request)) <= 1e-4
    baseline = Engine(EngineConfig(model="tiny-wan", adapters=tmp_path, swap_mode="load-and-fuse", warmup=False))
    baseline.set_adapters([("lightning", 1.0)])
    assert rel_err(ours, pipeline_output(baseline.pipeline, family, request)) <= 1e-4


def test_an_expert_pair_on_a_model_with_one_transformer_is_refused(tmp_path):
    folder = tmp_path / "pair"
    folder.mkdir()
    engine = Engine(EngineConfig(model="tiny-wan", compile=False, warmup=False))
    for name in ("high_noise_model", "low_noise_model"):
        keys = _comfy_wan(engine.pipeline.transformer, 4, 4.0, torch.Generator().manual_seed(44))
        save_file(keys, str(folder / f"{name}.safetensors"))
    one_transformer = Engine(EngineConfig(model="tiny-flux", adapters=tmp_path, compile=False, warmup=False))
    with pytest.raises(AdapterIncompatible, match="pair of expert files"):
        one_transformer.set_adapters([("pair", 1.0)])


def test_video_progress_reaches_a_job_through_the_gpu_worker():
    from loraswap.engine.config.scheduling import SchedulerConfig
    from loraswap.engine.worker import GpuWorker

    engine = Engine(EngineConfig(model="tiny-wan", compile=False, warmup=False))
    worker = GpuWorker(engine, SchedulerConfig())
    worker.start()
    steps = []
    try:
        future = worker.submit(GenerateRequest(prompt=PROMPT, seed=1, steps=2, frames=5),
                               lambda done, total: steps.append((done, total)))
        assert len(future.result(timeout=120).frames) == 5

        def broken(done, total):
            raise RuntimeError("a hook that fails")

        failing = worker.submit(GenerateRequest(prompt=PROMPT, seed=1, steps=1, frames=5), broken)
        assert len(failing.result(timeout=120).frames) == 5, "a failing progress hook does not fail the video"
    finally:
        worker.stop()
    assert steps == [(1, 2), (2, 2)]


def test_the_models_default_frames_are_held_to_the_servers_limit():
    engine = Engine(EngineConfig(model="tiny-wan", compile=False, warmup=False))
    with pytest.raises(BadRequest, match="makes 5 frames by default, over the limit of 3"):
        engine.generate(GenerateRequest(prompt=PROMPT, max_frames=3))
    assert len(engine.generate(GenerateRequest(prompt=PROMPT, steps=1, frames=1, max_frames=3)).frames) == 1
