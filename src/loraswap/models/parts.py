"""Parts several families share: tiny configs for the presets, real configs for the real
architectures.

Tiny parts keep the real classes and only shrink them; real configs are those of the
published checkpoints (SD 1.5, SDXL, FLUX.1-dev), so a real architecture with random
weights has the real compute.
"""

from diffusers import AutoencoderKL, EulerDiscreteScheduler
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from loraswap.models.tokenizers import CLIP_VOCAB_SIZE, T5_VOCAB_SIZE

# A VAE with four blocks downsamples by 8, as the real ones do, so image sizes and
# latent shapes follow the same rules as on SD 1.5, SDXL and FLUX.1.
TINY_VAE_BLOCKS = dict(
    block_out_channels=(8, 8, 16, 16),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=1,
    norm_num_groups=4,
    in_channels=3,
    out_channels=3,
    sample_size=64,
)


def tiny_clip_config(hidden_size: int = 32, projection_dim: int | None = None) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=CLIP_VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        projection_dim=projection_dim or hidden_size,
        hidden_act="gelu",
    )


def tiny_clip() -> CLIPTextModel:
    return CLIPTextModel(tiny_clip_config())


def tiny_t5(d_model: int = 32) -> T5EncoderModel:
    return T5EncoderModel(T5Config(vocab_size=T5_VOCAB_SIZE, d_model=d_model, d_kv=8, d_ff=37, num_layers=2,
                                   num_heads=4, relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
                                   decoder_start_token_id=0))


def tiny_flux_vae() -> AutoencoderKL:
    """FLUX.1's VAE layout (no quant convs, shift and scale), tiny; 4 latent channels."""
    return AutoencoderKL(latent_channels=4, use_quant_conv=False, use_post_quant_conv=False,
                         shift_factor=0.0609, scaling_factor=1.5035, **TINY_VAE_BLOCKS)


def euler() -> EulerDiscreteScheduler:
    return EulerDiscreteScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, steps_offset=1)


CLIP_L = CLIPTextConfig(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                        num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
                        projection_dim=768, bos_token_id=49406, eos_token_id=49407, pad_token_id=49407)
CLIP_BIGG = CLIPTextConfig(**dict(CLIP_L.to_dict(), hidden_size=1280, intermediate_size=5120,
                                  num_hidden_layers=32, num_attention_heads=20, hidden_act="gelu",
                                  projection_dim=1280))
T5_XXL = T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                  feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, is_encoder_decoder=False)
VAE_SD = dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512),
              layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4,
              up_block_types=("UpDecoderBlock2D",) * 4, sample_size=512)
VAE_FLUX = dict(VAE_SD, latent_channels=16, use_quant_conv=False, use_post_quant_conv=False,
                scaling_factor=0.3611, shift_factor=0.1159, sample_size=1024)
