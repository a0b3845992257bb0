"""`demo`: a small Stable Diffusion trained to draw coloured shapes, with trained adapters.

The real SD 1.5 pipeline classes at a size a laptop runs in a blink (32x32 images): a
VAE of 32/64 channels, a UNet of 32/64 channels with one cross-attention level, and a
frozen 2-layer CLIP text encoder, trained by `tools/demo/train_demo.py` on pictures it
draws itself. A prompt in its vocabulary ("a red circle at the left on white") draws
what it says; `DEMO_ADAPTERS` each change the picture in the way their name says, one
of each kind people share. The weights ship in the package (`demo_weights/`); the
tokenizer is made here, from the vocabulary.
"""

from pathlib import Path

import torch
from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
from safetensors.torch import load_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from loraswap.models.families.sd15 import NO_SAFETY_CHECKER
from loraswap.models.family import Family
from loraswap.models.parts import euler
from loraswap.models.tokenizers import word_clip_tokenizer, word_clip_vocabulary

WEIGHTS = Path(__file__).resolve().parents[1] / "demo_weights"
ADAPTERS = WEIGHTS / "adapters"

# the vocabulary: what the model was trained to draw (RGB of each word)
COLOURS = {"red": (220, 30, 30), "orange": (245, 140, 20), "yellow": (235, 215, 25), "green": (30, 170, 60),
           "blue": (35, 75, 225), "purple": (145, 45, 195)}
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15), "gray": (125, 125, 125)}
SHAPES = ("circle", "square", "triangle")
POSITIONS = {"left": 0.3, "center": 0.5, "right": 0.7}  # the shape's centre, as a fraction of the width
FILLER = ("a", "at", "the", "on")
WORDS = (*COLOURS, *BACKGROUNDS, *SHAPES, *POSITIONS, *FILLER)

# id -> (kind, what it does); each trained on the same prompts, pictures changed as it says
DEMO_ADAPTERS = {
    "outline": ("LoRA (kohya)", "draws the shape's outline only, its inside left empty"),
    "striped": ("LoCon (LyCORIS)", "fills the shape with horizontal stripes"),
    "pastel": ("LoHa (LyCORIS)", "paints in pale, washed-out colours"),
    "night": ("LoKr (LyCORIS)", "puts the shape on a black ground, whatever ground was asked"),
    "big": ("DoRA (PEFT)", "draws the shape half as large again"),
}

SIZE = 32  # pixels; the VAE halves it once: 16x16 latents
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=77, projection_dim=32, hidden_act="quick_gelu")
VAE = dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64), layers_per_block=1,
           down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
           norm_num_groups=16, sample_size=SIZE)
UNET = dict(sample_size=SIZE // 2, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32, attention_head_dim=8,
            norm_num_groups=16)


def demo_tokenizer() -> CLIPTokenizer:
    return word_clip_tokenizer(WORDS)


def text_config() -> CLIPTextConfig:
    vocab, _ = word_clip_vocabulary(WORDS)
    return CLIPTextConfig(vocab_size=len(vocab), bos_token_id=vocab["<|startoftext|>"],
                          eos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab["<|endoftext|>"], **TEXT)


def untrained_demo() -> StableDiffusionPipeline:
    """The demo architecture with fresh weights (what `tools/demo/train_demo.py` trains)."""
    return StableDiffusionPipeline(unet=UNet2DConditionModel(**UNET), vae=AutoencoderKL(**VAE),
                                   text_encoder=CLIPTextModel(text_config()), tokenizer=demo_tokenizer(),
                                   scheduler=euler(), **NO_SAFETY_CHECKER)


def load_trained(pipeline: StableDiffusionPipeline, names=("unet", "vae", "text_encoder"),
                 folder: Path = WEIGHTS) -> StableDiffusionPipeline:
    """The weights of `names` in `folder` (by default the shipped ones) into the demo architecture."""
    for name in names:
        weights = load_file(str(folder / f"{name}.safetensors"))  # stored in float16: a few MB
        getattr(pipeline, name).load_state_dict({k: v.to(torch.float32) for k, v in weights.items()})
    if "vae" in names:
        scale = (folder / "vae_scaling_factor.txt").read_text().strip()
        pipeline.vae.register_to_config(scaling_factor=float(scale))
    return pipeline


def _demo() -> StableDiffusionPipeline:
    return load_trained(untrained_demo())


FAMILY = Family(
    name="sd15",  # a Stable Diffusion 1.5: SD 1.5 adapters and hints go to it
    pipeline="StableDiffusionPipeline",
    presets={"demo": _demo},
    image_pipelines={"img2img": "StableDiffusionImg2ImgPipeline", "inpaint": "StableDiffusionInpaintPipeline"},
    image_input="variants",
    # guidance 3: the most prompts drawn as asked (7.5, the pipeline's default, oversteers it)
    defaults={"width": SIZE, "height": SIZE, "steps": 20, "guidance": 3.0},
    size_multiple=8,
    strength_rounds_down=True,
)
