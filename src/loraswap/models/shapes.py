"""The real SD 1.5, SDXL and FLUX.1-dev architectures, built from their configs.

No weights are downloaded: `build_shape` puts the modules on the meta device (for
key layouts and shapes, e.g. `adapters make-random`) or fills them with random
weights on a real device (for benchmarks: same compute, same memory).
"""

import contextlib

import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768,
              bos_token_id=49406, eos_token_id=49407, pad_token_id=49407)
CLIP_BIGG = dict(CLIP_L, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
                 hidden_act="gelu", projection_dim=1280)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, is_encoder_decoder=False)

UNET_SD15 = dict(sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
                 block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768, attention_head_dim=8,
                 down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                 up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3)
UNET_SDXL = dict(sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
                 block_out_channels=(320, 640, 1280), cross_attention_dim=2048, attention_head_dim=(5, 10, 20),
                 transformer_layers_per_block=(1, 2, 10), use_linear_projection=True,
                 addition_embed_type="text_time", addition_time_embed_dim=256,
                 projection_class_embeddings_input_dim=2816,
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"))
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
VAE_SD = dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512),
              layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4,
              up_block_types=("UpDecoderBlock2D",) * 4, sample_size=512)
VAE_FLUX = dict(VAE_SD, latent_channels=16, use_quant_conv=False, use_post_quant_conv=False,
                scaling_factor=0.3611, shift_factor=0.1159, sample_size=1024)

# shape name -> component name -> (class, config kwargs)
SHAPES = {
    "sd15": {
        "unet": (UNet2DConditionModel, UNET_SD15),
        "text_encoder": (CLIPTextModel, CLIP_L),
        "vae": (AutoencoderKL, VAE_SD),
    },
    "sdxl": {
        "unet": (UNet2DConditionModel, UNET_SDXL),
        "text_encoder": (CLIPTextModel, CLIP_L),
        "text_encoder_2": (CLIPTextModelWithProjection, CLIP_BIGG),
        "vae": (AutoencoderKL, dict(VAE_SD, scaling_factor=0.13025, sample_size=1024)),
    },
    "flux-dev": {
        "transformer": (FluxTransformer2DModel, FLUX_DEV),
        "text_encoder": (CLIPTextModel, CLIP_L),
        "text_encoder_2": (T5EncoderModel, T5_XXL),
        "vae": (AutoencoderKL, VAE_FLUX),
    },
}


def build_shape_component(shape: str, component: str, device: str | torch.device = "meta",
                          dtype: torch.dtype = torch.bfloat16, init_device: str | torch.device | None = None
                          ) -> torch.nn.Module:
    """One component of a real architecture: on `meta` (no memory), or random on a device.

    With `init_device` (a GPU, say, for a component wanted in host RAM) the random values
    are drawn there, one tensor at a time, and copied to `device`: a GPU draws FLUX's
    transformer orders of magnitude faster than the CPU does.
    """
    device, init_device = torch.device(device), torch.device(init_device or device)
    if init_device != device and device.type != "meta":
        module = build_shape_component(shape, component, "meta", dtype)
        if not any(True for _ in module.buffers()):  # a buffer's values would be lost on meta
            return materialize_random(module, device, init_device)
    cls, config = SHAPES[shape][component]
    with torch.device(device):
        if cls in (CLIPTextModel, CLIPTextModelWithProjection):
            module = cls(CLIPTextConfig(**config))
        elif cls is T5EncoderModel:
            module = cls(T5Config(**config))
        else:
            module = cls(**config)
    return module.to(dtype).eval().requires_grad_(False)


@torch.no_grad()
def materialize_random(module: torch.nn.Module, device: torch.device, init_device: torch.device) -> torch.nn.Module:
    """`module` (on meta, no buffers) with random values on `device`, drawn on `init_device`.

    The values follow PyTorch's defaults for linear and convolution layers (uniform in
    +-1/sqrt(fan_in)); 1-d weights (norm scales) are ones, biases zeros. Tied parameters
    stay tied.
    """
    made: dict[int, torch.nn.Parameter] = {}  # meta parameter -> its real one (ties kept)
    for name, parameter in list(module.named_parameters(remove_duplicate=False)):
        if id(parameter) not in made:
            if parameter.dim() >= 2:
                bound = parameter[0].numel() ** -0.5  # fan_in
                value = torch.empty(parameter.shape, dtype=parameter.dtype, device=init_device).uniform_(-bound, bound)
            else:
                fill = 0.0 if name.endswith("bias") else 1.0
                value = torch.full(parameter.shape, fill, dtype=parameter.dtype, device=init_device)
            made[id(parameter)] = torch.nn.Parameter(value.to(device), requires_grad=False)
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner), leaf, made[id(parameter)])
    return module.eval().requires_grad_(False)


RANDOM_SUFFIX = "-random"
SCHEDULERS = {
    "sd15": ("EulerDiscreteScheduler", dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                            steps_offset=1)),
    "sdxl": ("EulerDiscreteScheduler", dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                            steps_offset=1, timestep_spacing="leading")),
    "flux-dev": ("FlowMatchEulerDiscreteScheduler", dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                         max_shift=1.15, base_image_seq_len=256,
                                                         max_image_seq_len=4096)),
}


@contextlib.contextmanager
def default_dtype_set_to(dtype: torch.dtype):
    """torch's process-wide default dtype set to `dtype` for the block, and put back after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_shape_pipeline(shape: str, device: str | torch.device, dtype: torch.dtype,
                         init_device: str | torch.device | None = None):
    """The full pipeline of a real architecture with random weights (`<shape>-random` models).

    Same compute and memory as the real model; tokenizers are made in code, so prompts
    tokenize without a download (their ids differ from the real vocabularies'). A pipeline
    wanted on the CPU (to be quantized onto a GPU, say) draws its values on `init_device`.
    """
    import diffusers

    from . import SHAPE_PIPELINES
    from .tokenizers import make_clip_tokenizer, make_t5_tokenizer

    with default_dtype_set_to(dtype):  # initialise straight in the serving dtype
        components = {name: build_shape_component(shape, name, device=device, dtype=dtype, init_device=init_device)
                      for name in SHAPES[shape]}
    scheduler_cls, scheduler_config = SCHEDULERS[shape]
    components["scheduler"] = getattr(diffusers, scheduler_cls)(**scheduler_config)
    components["tokenizer"] = make_clip_tokenizer()
    if shape == "sdxl":
        components["tokenizer_2"] = make_clip_tokenizer()
    if shape == "flux-dev":
        components["tokenizer_2"] = make_t5_tokenizer(model_max_length=512)
    pipeline_cls = getattr(diffusers, SHAPE_PIPELINES[shape])
    if shape == "sd15":
        components.update(safety_checker=None, feature_extractor=None, image_encoder=None,
                          requires_safety_checker=False)
    if shape == "sdxl":
        components.update(image_encoder=None, feature_extractor=None)
    if shape == "flux-dev":
        components.update(image_encoder=None, feature_extractor=None)
    pipeline = pipeline_cls(**components)
    pipeline.set_progress_bar_config(disable=True)
    pipeline.register_to_config(_name_or_path=shape + RANDOM_SUFFIX)
    return pipeline
