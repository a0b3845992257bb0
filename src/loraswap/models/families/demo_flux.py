"""`demo-flux`: a small FLUX.1 trained to draw coloured shapes, with trained adapters.

The real FLUX.1 pipeline classes (`FluxPipeline`, a `FluxTransformer2DModel` with double-
and single-stream blocks, a 16-channel `AutoencoderKL` that downsamples by 8 as FLUX.1's
does, a CLIP and a T5 text encoder, `FlowMatchEulerDiscreteScheduler` with FLUX.1-dev's
shift) at a size a laptop's CPU runs: 128x128 pixels, 16x16 latents, 64 image tokens.
`tools/demo/train_demo_flux.py` trains it with flow matching on pictures it draws itself, then
distils classifier-free guidance into FLUX.1's guidance embedding, as FLUX.1-dev is: one
pass a step, the guidance a number the model reads (3.5, 28 steps, as FLUX.1-dev is run).

Its words are `demo`'s (a prompt written for `demo` draws the same here) and three more, so
a picture is scored on six independent attributes: colour, shape, place, ground, size
(`small`, `large`, neither) and texture (`striped` or plain). `DEMO_ADAPTERS` each change the
picture as their name says, one of each FLUX.1 file layout and kind people share. The text
encoders keep their seeded weights (frozen while training); the tokenizers are made here.
"""

import json
from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from safetensors.torch import load_file
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from loraswap.models.families import demo
from loraswap.models.family import Family
from loraswap.models.tokenizers import word_clip_tokenizer, word_clip_vocabulary, word_t5_tokenizer

WEIGHTS = Path(__file__).resolve().parents[1] / "demo_flux_weights"
ADAPTERS = WEIGHTS / "adapters"

COLOURS, BACKGROUNDS, SHAPES, POSITIONS = demo.COLOURS, demo.BACKGROUNDS, demo.SHAPES, demo.POSITIONS
SIZES = {"small": 0.6, "large": 1.4}  # the shape's radius against an unsized one's
TEXTURES = ("striped",)  # horizontal bands; plain when unsaid
WORDS = (*demo.WORDS, *SIZES, *TEXTURES)

# id -> (kind and layout, what it does)
DEMO_ADAPTERS = {
    "outline": ("LoRA (diffusers names, by PEFT)", "draws the shape's outline only, its inside left empty"),
    "night": ("LoRA (kohya/BFL names)", "puts the shape on a black ground, whatever ground was asked"),
    "pastel": ("LoKr (LyCORIS)", "paints in pale, washed-out colours"),
    "big": ("DoRA (diffusers names, by PEFT)", "draws the shape half as large again"),
}

SIZE = 128  # pixels; the VAE downsamples by 8 and the transformer packs 2x2: 8x8 = 64 tokens
TEXT_TOKENS = 32  # T5 tokens a prompt is padded to (FLUX.1-dev: 512; the longest prompt here is 11)
CLIP = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=77, projection_dim=64, hidden_act="quick_gelu")
T5 = dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
          feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
          is_encoder_decoder=False)
VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(32, 32, 64, 64),
           layers_per_block=1, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
           norm_num_groups=16, use_quant_conv=False, use_post_quant_conv=False, sample_size=SIZE)
TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=32,
                   num_attention_heads=4, joint_attention_dim=T5["d_model"], pooled_projection_dim=CLIP["hidden_size"],
                   guidance_embeds=True, axes_dims_rope=(8, 12, 12))
# FLUX.1-dev's scheduler: the shift grows with the image's tokens
SCHEDULER = dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                 max_image_seq_len=4096)


def clip_config() -> CLIPTextConfig:
    vocab, _ = word_clip_vocabulary(WORDS)
    return CLIPTextConfig(vocab_size=len(vocab), bos_token_id=vocab["<|startoftext|>"],
                          eos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab["<|endoftext|>"], **CLIP)


def untrained_demo_flux() -> FluxPipeline:
    """The demo-flux architecture with fresh weights (the caller seeds; the text encoders,
    made first, keep theirs: training freezes them)."""
    text_encoder = CLIPTextModel(clip_config())
    tokenizer_2 = word_t5_tokenizer(WORDS, model_max_length=TEXT_TOKENS)
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), **T5))
    return FluxPipeline(transformer=FluxTransformer2DModel(**TRANSFORMER), vae=AutoencoderKL(**VAE),
                        text_encoder=text_encoder, tokenizer=word_clip_tokenizer(WORDS),
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
                        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER))


COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2")


def load_trained(pipeline: FluxPipeline, names=COMPONENTS, folder: Path = WEIGHTS) -> FluxPipeline:
    """The weights of `names` in `folder` (by default the shipped ones) into the architecture."""
    for name in names:
        weights = load_file(str(folder / f"{name}.safetensors"))  # stored in float16: a few MB
        getattr(pipeline, name).load_state_dict({k: v.to(torch.float32) for k, v in weights.items()})
    if "vae" in names:  # the latents' statistics, measured after the VAE was trained
        factors = json.loads((folder / "vae_factors.json").read_text())
        pipeline.vae.register_to_config(shift_factor=factors["shift_factor"], scaling_factor=factors["scaling_factor"])
    return pipeline


def _demo_flux() -> FluxPipeline:
    return load_trained(untrained_demo_flux())


def _text_tokens(kwargs: dict) -> dict:
    """The T5 length the model was trained with (FLUX.1 does not mask padding, so the length
    is part of what the model saw)."""
    return {**kwargs, "max_sequence_length": TEXT_TOKENS}


FAMILY = Family(
    name="flux",  # a FLUX.1: FLUX.1 adapters and hints go to it
    pipeline="FluxPipeline",
    presets={"demo-flux": _demo_flux},
    image_pipelines={"img2img": "FluxImg2ImgPipeline", "inpaint": "FluxInpaintPipeline"},
    image_input="variants",
    defaults={"width": SIZE, "height": SIZE, "steps": 28, "guidance": 3.5},
    adjust_call=_text_tokens,
)
