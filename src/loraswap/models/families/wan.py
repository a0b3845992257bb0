"""Wan 2.1 / 2.2 text to video: a flow transformer over video latents, a UMT5-XXL text
encoder and Wan's causal 3D VAE.

Wan 2.2 A14B splits the denoising between two transformers of one shape: `transformer`
(high noise) runs while the timestep is at or above `boundary_ratio` * 1000, then
`transformer_2` (low noise). Both take adapters: a file's `transformer_2.` keys go into
the second (diffusers' loader wants those as a file of their own, loaded with
`load_into_transformer_2=True`); a file in ComfyUI or musubi naming goes into the first.
Wan 2.1 has one transformer. Image to video (`WanImageToVideoPipeline`) is not served.
"""

from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

from loraswap.models.family import TINY_DEFAULTS, Architecture, Family
from loraswap.models.tokenizers import T5_VOCAB_SIZE, make_t5_tokenizer

# the prompt length Wan pads to (the pipeline's max_sequence_length)
TEXT_LENGTH = 512
# Wan 2.2 A14B T2V hands over to `transformer_2` at t = 875 of 1000
BOUNDARY_RATIO = 0.875

# head dim 12: rope splits it 4/4/4 over frames, height and width; rope_max_seq_len as the
# real one's, so any size the server accepts fits the rotary tables
TINY_TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                        qk_norm="rms_norm_across_heads", rope_max_seq_len=1024)
# 8x spatial and 4x temporal downsampling, 16 latent channels, as the real VAE
TINY_VAE = dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])

WAN_A14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
WAN_1_3B = dict(WAN_A14B, num_attention_heads=12, ffn_dim=8960, num_layers=30)
VAE_WAN = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
               temperal_downsample=[False, True, True])  # Wan 2.1's VAE, which Wan 2.2 A14B keeps
UMT5_XXL = UMT5Config(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                      feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
                      relative_attention_max_distance=128)


def tiny_umt5() -> UMT5EncoderModel:
    return UMT5EncoderModel(UMT5Config(vocab_size=T5_VOCAB_SIZE, d_model=32, d_kv=8, d_ff=37, num_layers=2,
                                       num_heads=4, relative_attention_num_buckets=8))


def wan_scheduler() -> UniPCMultistepScheduler:
    """The scheduler the Wan diffusers checkpoints ship: UniPC over flow sigmas, shift 3.

    (Wan's own code samples A14B T2V with shift 12; the diffusers repos keep 3.)
    With 4 steps the timesteps are 999, 900, 750, 500: two on each side of the boundary.
    """
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)


def _tiny_wan() -> WanPipeline:
    """Wan 2.2 style, two transformers. The modules are made in a fixed order: the seeded
    weights of each depend on it."""
    transformer = WanTransformer3DModel(**TINY_TRANSFORMER)
    transformer_2 = WanTransformer3DModel(**TINY_TRANSFORMER)
    vae = AutoencoderKLWan(**TINY_VAE)
    text_encoder = tiny_umt5()
    return WanPipeline(transformer=transformer, transformer_2=transformer_2, vae=vae, text_encoder=text_encoder,
                       tokenizer=make_t5_tokenizer(model_max_length=TEXT_LENGTH), scheduler=wan_scheduler(),
                       boundary_ratio=BOUNDARY_RATIO)


def _wan_a14b_extras() -> dict:
    return dict(scheduler=wan_scheduler(), tokenizer=make_t5_tokenizer(model_max_length=TEXT_LENGTH),
                boundary_ratio=BOUNDARY_RATIO)


def _wan_1_3b_extras() -> dict:
    return dict(scheduler=wan_scheduler(), tokenizer=make_t5_tokenizer(model_max_length=TEXT_LENGTH),
                transformer_2=None, boundary_ratio=None)


WAN_A14B_ARCHITECTURE = Architecture(
    components={"transformer": (WanTransformer3DModel, WAN_A14B), "transformer_2": (WanTransformer3DModel, WAN_A14B),
                "text_encoder": (UMT5EncoderModel, UMT5_XXL), "vae": (AutoencoderKLWan, VAE_WAN)},
    extras=_wan_a14b_extras)
WAN_1_3B_ARCHITECTURE = Architecture(
    components={"transformer": (WanTransformer3DModel, WAN_1_3B), "text_encoder": (UMT5EncoderModel, UMT5_XXL),
                "vae": (AutoencoderKLWan, VAE_WAN)},
    extras=_wan_1_3b_extras)

FAMILY = Family(
    name="wan",
    pipeline="WanPipeline",
    presets={"tiny-wan": _tiny_wan},
    architectures={"wan-14b": WAN_A14B_ARCHITECTURE, "wan-1.3b": WAN_1_3B_ARCHITECTURE},
    image_input="none",
    output="video",
    defaults=dict(TINY_DEFAULTS, frames=5),  # Wan takes 4k+1 frames
)
