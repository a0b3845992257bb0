"""What the split flags (--ulysses-degree, --ring-degree, --cfg-parallel) refuse before any
process starts, and Qwen-Image's padded text giving the image of the unpadded one."""

import pytest
import torch
from pydantic import ValidationError

from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.config.parallelism import Parallelism
from loraswap.engine.parallel.cfg import GUIDED, GuidanceSplit, check_guided
from loraswap.engine.parallel.split import check_parallelizable, check_sequence, check_split, pad_text_to_split
from loraswap.errors import BadRequest
from loraswap.models import build_preset, family_of


def _denoiser_and_family(preset: str):
    pipeline = build_preset(preset)
    return getattr(pipeline, "transformer", None) or pipeline.unet, family_of(pipeline)


def test_the_flags_count_processes_and_split_sizes():
    assert EngineConfig(model="tiny-wan", ulysses_degree=2, cfg_parallel=True).parallel.parallelism.world == 4
    parallelism = Parallelism(ulysses=2, cfg=2)
    check_sequence(6, parallelism)  # each half splits its sequence in two
    with pytest.raises(BadRequest, match="7 image tokens, which do not split over 2 ranks"):
        check_sequence(7, parallelism)
    with pytest.raises(ValidationError, match="--ring-degree needs an attention backend"):
        EngineConfig(model="tiny-flux", ring_degree=2)


def test_families_and_degrees_the_split_does_not_take_are_refused():
    unet, sd = _denoiser_and_family("tiny-sd")
    with pytest.raises(ValueError, match="is not split over processes: .* take the flux, .*qwen-image-edit families"):
        check_parallelizable(unet, Parallelism(ulysses=2), "tiny-sd", family=sd)
    qwen, qwen_family = _denoiser_and_family("tiny-qwen-image")  # 2 heads
    with pytest.raises(ValueError, match="3 does not divide"):
        check_parallelizable(qwen, Parallelism(ulysses=3), "tiny-qwen-image", family=qwen_family)
    with pytest.raises(ValueError, match="ring attention does not take: use --ulysses-degree"):
        check_parallelizable(qwen, Parallelism(ring=2), "tiny-qwen-image", "_native_cudnn", qwen_family)
    with pytest.raises(ValueError, match="masked tokens, which --attention flash does not take"):
        check_parallelizable(qwen, Parallelism(ulysses=2), "tiny-qwen-image", "flash", qwen_family)
    flux_family = _denoiser_and_family("tiny-flux")[1]
    with pytest.raises(ValueError, match="no negative pass to split: --cfg-parallel takes the wan, qwen-image"):
        check_guided(flux_family, "tiny-flux")
    check_guided(qwen_family, "tiny-qwen-image")


def _second_half(family: str) -> GuidanceSplit:
    split = GuidanceSplit.__new__(GuidanceSplit)  # its prompts' rule alone: no ranks
    split.half, split.blank = 1, GUIDED[family]
    return split


def test_the_second_half_of_the_guidance_passes_makes_the_negative_pass_first():
    call = {"prompt": ["a cat", "a dog"], "negative_prompt": ["blurry", "dark"], "num_inference_steps": 2}
    swapped = {**call, "prompt": ["blurry", "dark"], "negative_prompt": ["a cat", "a dog"]}
    assert _second_half("wan").arguments(call) == _second_half("qwen-image").arguments(call) == swapped
    # no negative prompt: Wan guides with a blank one, Qwen-Image does not guide (nor may the half)
    alone = {"prompt": "a cat", "guidance_scale": 5.0}
    assert _second_half("wan").arguments(alone) == {**alone, "prompt": "", "negative_prompt": "a cat"}
    assert _second_half("qwen-image").arguments(alone) == alone


def test_padded_text_gives_the_prediction_of_the_unpadded():
    """Masked padding tokens change nothing the image attends to: the prediction of a 7-token
    text padded to 8 equals the unpadded one."""
    transformer = _denoiser_and_family("tiny-qwen-image")[0].eval()
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, transformer.config.in_channels, generator=generator)  # 4 x 4 tokens
    text = torch.randn(1, 7, transformer.config.joint_attention_dim, generator=generator)
    call = dict(hidden_states=latents, encoder_hidden_states=text, timestep=torch.tensor([0.5]),
                img_shapes=[(1, 4, 4)], return_dict=False)
    with torch.no_grad():
        unpadded = transformer(**call)[0]
        pad_text_to_split(transformer, 4)
        padded = transformer(**call)[0]
    torch.testing.assert_close(padded, unpadded, rtol=0, atol=1e-5)
    assert padded.abs().max() > 0.1


def test_more_ranks_than_gpus_are_refused_before_any_process_starts(monkeypatch):
    """NCCL would refuse two ranks on one GPU only at the first collective, once every rank
    had loaded the model: the server refuses at start-up, naming the counts."""
    import multiprocessing

    from loraswap.engine.parallel.processes import RankProcesses, check_gpu_count

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(multiprocessing, "get_context", lambda *_: pytest.fail("a process was started"))
    guided = EngineConfig(model="tiny-wan", device="cuda", ulysses_degree=2, cfg_parallel=True)
    with pytest.raises(ValueError, match=r"4 processes .* need 4 GPUs, one each; 2 visible "
                                         r"\(CUDA_VISIBLE_DEVICES=0,1\)"):
        RankProcesses(guided)
    check_gpu_count(EngineConfig(model="tiny-flux", device="cuda", ulysses_degree=2))  # one GPU each
    check_gpu_count(guided.model_copy(update={"device": "cpu"}))  # CPU ranks share the CPU


EDITS = [("tiny-flux-kontext", (80, 48), True), ("tiny-flux-kontext", (200, 211), False),
         ("tiny-flux2", (72, 68), True), ("tiny-flux2", (76, 66), False)]


@pytest.mark.parametrize(("preset", "size", "asked"), EDITS)
def test_edit_tokens_are_the_sequence_the_pipeline_feeds_the_transformer(preset, size, asked):
    """FLUX.1 Kontext and FLUX.2 attend to their input images beside the output, in one
    sequence a split must divide: the count the size check uses is diffusers' own, with the
    input at its own size (a size asked) or Kontext's preferred resolution (none), and
    FLUX.2's output at the image's size when none is asked."""
    from PIL import Image

    from loraswap.models.families.flux_kontext import asked_size

    pipeline, family = build_preset(preset), family_of(build_preset(preset))
    seen = []  # the sequence the transformer is called with

    def record(module, args, kwargs):
        seen.append(kwargs["hidden_states"].shape[1])

    pipeline.transformer.register_forward_pre_hook(record, with_kwargs=True)
    call = dict(prompt="x", image=Image.new("RGB", size, (200, 30, 30)), num_inference_steps=1, output_type="pt",
                generator=torch.Generator().manual_seed(0))
    if asked:
        call = dict(call, width=32, height=32)
        call = asked_size(call) if preset == "tiny-flux-kontext" else call
    pipeline(**call)
    patch = pipeline.vae_scale_factor * 2
    assert seen[0] == family.edit_tokens(call, patch) > (32 // patch) ** 2


def test_flux2_reference_images_over_a_megapixel_are_scaled_as_its_pipeline_does():
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
    from PIL import Image

    from loraswap.models.families.flux2 import edit_tokens

    image = Image.new("RGB", (1500, 1001))
    width, height = Flux2ImageProcessor._resize_to_target_area(image, 1024 * 1024).size
    assert edit_tokens({"image": [image], "width": 64, "height": 64}, 16) == 16 + (width // 16) * (height // 16)


def test_a_split_refuses_an_edit_whose_output_and_input_do_not_divide():
    """The ranked engine's check before its ranks run anything: an edit's whole sequence, a
    plain call's output."""
    from PIL import Image

    pipeline = build_preset("tiny-flux-kontext")
    family, parallelism = family_of(pipeline), Parallelism(ulysses=2)
    odd = dict(width=64, height=64, image=Image.new("RGB", (80, 48)), _auto_resize=False)  # 16 + 15 tokens
    with pytest.raises(BadRequest, match="this size and input image make 31 tokens, which do not split over 2"):
        check_split(pipeline, family, parallelism, odd)
    check_split(pipeline, family, parallelism, dict(odd, image=Image.new("RGB", (80, 64))))  # 16 + 20
    with pytest.raises(BadRequest, match="this size makes 15 image tokens"):
        check_split(pipeline, family, parallelism, dict(width=80, height=48))


class _Unrebuildable(Exception):
    status = 422

    def __init__(self, what: str, why: str):  # pickle rebuilds it with one argument: it cannot
        super().__init__(f"{what}: {why}")


def test_an_error_that_cannot_cross_to_another_rank_is_sent_as_its_type_message_and_status():
    """A rank's error goes to the others in `Ranks.agree`; one pickle cannot rebuild would
    make that rank skip the collective and leave the others in it."""
    import pickle

    from loraswap.engine.parallel.ranks import sendable
    from loraswap.errors import AdapterInvalid

    error = AdapterInvalid("a", "truncated", "Download it again")
    assert sendable(error) is error
    sent = pickle.loads(pickle.dumps(sendable(_Unrebuildable("adapter a", "odd"))))
    assert str(sent) == "_Unrebuildable: adapter a: odd" and sent.status == 422
