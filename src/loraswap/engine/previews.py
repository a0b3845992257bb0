"""Pictures of an image while it is denoised, made from a step's latents.

Two kinds, as the client asks:
- a sketch (the default): a linear map from the latents' channels to RGB, fitted once per model
  (`LatentPreviews.linear_map`, on the first sketch asked for) by least squares over latents its
  own VAE encoded and decoded; one small matmul per picture, at the latents' resolution (an eighth of the image a
  side on today's models), scaled up to the image's size when it is encoded;
- full: the VAE decodes the step's latents as the pipeline decodes its last step: the picture the
  request would get, were it stopped there; each costs what that decode costs.

Latents come in the pipeline's layout; `vae_latents` turns them into what its VAE decodes, with
the pipeline's own code where it has it: spatial latents (SD, SDXL, SD3, Z-Image) are scaled and
shifted back; FLUX.1's and Qwen-Image's sequences of 2x2 patches are unpacked by the pipeline's
`_unpack_latents`; FLUX.2's by `_unpack_latents_with_ids`, then its batch norm undone and its
patches unfolded (`_unpatchify_latents`).

Nothing here runs for a request that asks for no previews; what runs for one that does reads the
latents and changes nothing, so its image is bitwise the one made without.
"""

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from PIL import Image

logger = logging.getLogger(__name__)

FIT_IMAGES = 8  # synthetic pictures the linear map is fitted on
FIT_LATENT_SIDE = 8  # their side in latents (64 px on an 8x VAE)
# the schedulers whose step is the Euler step `StepLatents` inverts to estimate the final latents
EULER_SCHEDULERS = ("EulerDiscreteScheduler", "FlowMatchEulerDiscreteScheduler")


@dataclass
class Preview:
    """One picture of an image being made: 8-bit RGB (3, height, width) on the host, perhaps
    still being copied from the GPU until `ready` (so the worker never waits for the copy), and
    the size of the image it shows (width, height; None: not known), which `image` scales it to."""

    pixels: torch.Tensor
    ready: "torch.cuda.Event | None" = None
    image_size: tuple[int, int] | None = None

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of the picture `image` makes: the image's, else the pixels'."""
        return self.image_size or (self.pixels.shape[2], self.pixels.shape[1])

    def image(self) -> Image.Image:
        """As a PIL image of the image's size; waits for the copy (off the event loop, then)."""
        if self.ready is not None:
            self.ready.synchronize()
        image = Image.fromarray(self.pixels.permute(1, 2, 0).contiguous().numpy())
        if image.size == self.size:
            return image
        return image.resize(self.size, Image.Resampling.BILINEAR)


class LatentPreviews:
    """One model's pictures of its latents: the linear map (fitted at the engine's warm-up, or
    on the first sketch asked for without one), and its VAE for full pictures."""

    def __init__(self, pipeline):
        self.pipeline = pipeline
        self._map: tuple[torch.Tensor, torch.Tensor] | None = None  # (weight: RGB x channels, bias)
        self._unfit = False  # the fit failed (logged): no sketches
        self.constants = DeviceConstants()  # the VAE's mean and std, FLUX.2's latent ids: copied to the GPU once

    def hook(self, on_latents: Callable, kwargs: dict, image: Image.Image | None) -> Callable:
        """The latents hook of a call with arguments `kwargs` (and input `image`) for the
        pipeline's step callback, `(done, total, latents, scheduler)`: calls
        `on_latents(done, total, StepLatents)`. It keeps the step's latents for the next step's
        pictures (a reference: nothing is computed unless a picture is made)."""
        size = (kwargs.get("width") or (image.width if image else None),
                kwargs.get("height") or (image.height if image else None))
        before: list[torch.Tensor | None] = [None]

        def step_latents_ready(done: int, total: int, latents: torch.Tensor, scheduler) -> None:
            euler = type(scheduler).__name__ in EULER_SCHEDULERS  # another step: its estimate is not this one
            step = StepLatents(self, latents, size, before[0], sigmas_of(scheduler) if euler else None)
            before[0] = latents
            on_latents(done, total, step)

        return step_latents_ready

    def pictures(self, latents: torch.Tensor, full: bool, size: tuple[int | None, int | None]) -> list[Preview]:
        """A picture of each of `latents` (a batch in the pipeline's layout); none when the
        linear map could not be fitted to this model's VAE."""
        if not full and self.linear_map() is None:
            return []
        with torch.inference_mode(), torch.compiler.set_stance("force_eager"):  # a compiled VAE: never recompiled
            vae_in = vae_latents(self.pipeline, latents, size, self.constants)
            rgb = decode(self.pipeline.vae, vae_in) if full else self._sketch(vae_in)
            pixels = (rgb.float() * 255).round().to(torch.uint8)
            host = pixels.to("cpu", non_blocking=True)  # pinned: the worker does not wait for it
            ready = None
            if pixels.is_cuda:
                ready = torch.cuda.Event()
                ready.record()
        known = size if all(size) else None
        return [Preview(host[i], ready, known) for i in range(host.shape[0])]

    def linear_map(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The map, fitted against the model's VAE the first time it is asked for (a fraction of
        a second: a few small pictures encoded and decoded); None for a VAE it cannot fit."""
        if self._map is None and not self._unfit:
            try:
                fitted = fit_linear_map(self.pipeline.vae, self.pipeline.vae_scale_factor)
                if not all(torch.isfinite(part).all() for part in fitted):
                    raise ValueError("the fitted map is not finite")
                self._map = fitted
            except Exception:
                self._unfit = True
                logger.warning("%s: no preview sketches: its VAE could not be fitted", type(self.pipeline).__name__,
                               exc_info=True)
        return self._map

    def _sketch(self, vae_in: torch.Tensor) -> torch.Tensor:
        if vae_in.dim() == 5:  # (batch, channels, frames, h, w): an image is one frame
            vae_in = vae_in[:, :, 0]
        weight, bias = self._map
        rgb = torch.einsum("bchw,kc->bkhw", vae_in.float(), weight) + bias.view(1, 3, 1, 1)
        return rgb.clamp(0, 1)


class StepLatents:
    """One step's latents of a pipeline call, and the pictures that can be made of them.

    A picture shows the step's estimate of the final latents, as A1111's and ComfyUI's previews
    do, not the noisy latents themselves (noise that would hide the picture until the last
    steps): for an Euler step (SD's Euler, the flow-matching models' FlowMatchEuler) from `before`
    at sigma s0 to `latents` at s1, the denoiser's prediction was
    x0 = before - s0 * (latents - before) / (s1 - s0); at the last step (s1 = 0) that is the
    final latents. Without the step before or the sigmas: the latents as they are."""

    def __init__(self, previews: LatentPreviews, latents: torch.Tensor, size: tuple[int | None, int | None],
                 before: torch.Tensor | None = None, sigmas: tuple | None = None):
        self.previews, self.latents, self.size = previews, latents, size
        self.before, self.sigmas = before, sigmas

    def pictures(self, indices: list[int], full: bool) -> list[Preview]:
        """Pictures of the batch's images `indices` (in the call's order)."""
        every = indices == list(range(self.latents.shape[0]))
        chosen = self.latents if every else self.latents[indices]
        if self.before is not None and self.sigmas is not None and self.before.shape == self.latents.shape:
            before = self.before if every else self.before[indices]
            s0, s1 = self.sigmas
            chosen = (before - s0 * (chosen - before) / (s1 - s0)).to(chosen.dtype)
        return self.previews.pictures(chosen, full, self.size)


def sigmas_of(scheduler) -> tuple | None:
    """(sigma before, sigma after) the step the scheduler has just made, as numbers where its
    sigmas are on the host, else as tensors on their device (never read back: no wait for the
    GPU); None for a scheduler without sigmas, or an empty step."""
    sigmas, index = getattr(scheduler, "sigmas", None), getattr(scheduler, "step_index", None)
    if not isinstance(sigmas, torch.Tensor) or index is None or not 1 <= index < len(sigmas):
        return None
    pair = sigmas[index - 1], sigmas[index]
    if pair[0].device.type == "cpu":
        pair = (pair[0].item(), pair[1].item())
        if pair[0] == pair[1]:
            return None
    return pair


# ---------------------------------------------------------------- the pipeline's layout
class DeviceConstants:
    """Tensors made on the host once and kept on the device they are used on, by name, device,
    dtype and size: a copy from the host is a wait for the GPU, at every picture otherwise.
    Written on the worker's thread only."""

    def __init__(self):
        self._kept: dict[tuple, torch.Tensor] = {}

    def get(self, key: tuple, like: torch.Tensor, make: Callable[[], torch.Tensor], same_dtype: bool = True):
        """`make()` on `like`'s device (and in its dtype, unless `same_dtype` is False)."""
        full_key = (*key, like.device, like.dtype if same_dtype else None)
        if full_key not in self._kept:
            made = make()
            self._kept[full_key] = made.to(like.device, like.dtype if same_dtype else made.dtype)
        return self._kept[full_key]


def vae_latents(pipeline, latents: torch.Tensor, size: tuple[int | None, int | None],
                constants: DeviceConstants | None = None) -> torch.Tensor:
    """`latents` as the pipeline hands them to its VAE's `decode` (its own code before the
    decode, op for op). `size`: the image's (width, height), to unpack a sequence of patches;
    `constants`: where the tensors it needs are kept on the device between calls."""
    config, vae_scale = pipeline.vae.config, pipeline.vae_scale_factor
    constants = constants or DeviceConstants()
    if hasattr(pipeline, "_unpack_latents_with_ids"):  # FLUX.2: patch tokens, batch-normed
        return _flux2_vae_latents(pipeline, latents, size, constants)
    if latents.dim() == 3:  # FLUX.1, Kontext, Qwen-Image: 2x2 patches packed as tokens
        rows, columns = token_grid(latents.shape[1], size, vae_scale * 2)
        latents = pipeline._unpack_latents(latents, rows * vae_scale * 2, columns * vae_scale * 2, vae_scale)
    if latents.dim() == 5:  # Qwen-Image's VAE: per-channel mean and std
        latents = latents.to(pipeline.vae.dtype)
        mean = constants.get(("mean5",), latents, lambda: torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1))
        std = constants.get(("std5",), latents,
                            lambda: 1.0 / torch.tensor(config.latents_std).view(1, -1, 1, 1, 1))
        return latents / std + mean
    if getattr(config, "latents_mean", None) is not None and getattr(config, "latents_std", None) is not None:
        mean = constants.get(("mean",), latents, lambda: torch.tensor(config.latents_mean).view(1, -1, 1, 1))
        std = constants.get(("std",), latents, lambda: torch.tensor(config.latents_std).view(1, -1, 1, 1))
        return latents * std / config.scaling_factor + mean  # SDXL with a mean and std
    shift = getattr(config, "shift_factor", None)
    latents = latents / config.scaling_factor
    return latents + shift if shift is not None else latents


def _flux2_vae_latents(pipeline, latents: torch.Tensor, size: tuple[int | None, int | None],
                       constants: DeviceConstants) -> torch.Tensor:
    """FLUX.2's patch tokens unpacked by their ids, the VAE's batch norm undone, the patches unfolded."""
    rows, columns = token_grid(latents.shape[1], size, pipeline.vae_scale_factor * 2)
    ids = constants.get(("ids", latents.shape[0], rows, columns), latents,
                        lambda: pipeline._prepare_latent_ids(torch.empty(latents.shape[0], 0, rows, columns)),
                        same_dtype=False)
    patches = pipeline._unpack_latents_with_ids(latents, ids)
    bn, eps = pipeline.vae.bn, pipeline.vae.config.batch_norm_eps
    mean = constants.get(("bn mean",), patches, lambda: bn.running_mean.view(1, -1, 1, 1))
    std = constants.get(("bn std",), patches, lambda: torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps))
    return pipeline._unpatchify_latents(patches * std + mean)


def token_grid(tokens: int, size: tuple[int | None, int | None], pixels_per_token: int) -> tuple[int, int]:
    """(rows, columns) of a sequence of `tokens` patches: the image's size in patches when it
    matches, else the split closest to its shape (square when the size is not known)."""
    width, height = size
    if width and height:
        rows, columns = height // pixels_per_token, width // pixels_per_token
        if rows * columns == tokens:
            return rows, columns
    aspect = width / height if width and height else 1.0
    pairs = [(r, tokens // r) for r in range(1, math.isqrt(tokens) + 1) if tokens % r == 0]
    pairs += [(c, r) for r, c in pairs]
    return min(pairs, key=lambda rc: abs(math.log(rc[1] / rc[0] / aspect)))


@contextlib.contextmanager
def upcast(vae) -> Iterator[None]:
    """The VAE in float32 for the block where its config says float16 overflows (SDXL's
    `force_upcast`), as the pipeline decodes its last step; back in float16 after."""
    needed = vae.dtype == torch.float16 and getattr(vae.config, "force_upcast", False)
    if needed:
        vae.to(dtype=torch.float32)
    try:
        yield
    finally:
        if needed:
            vae.to(dtype=torch.float16)


def decode(vae, vae_in: torch.Tensor) -> torch.Tensor:
    """The VAE's picture of `vae_in`, in [0, 1] (batch, 3, height, width), as the pipeline's
    image processor makes it (upcast where the pipeline upcasts)."""
    with upcast(vae):
        image = vae.decode(vae_in.to(vae.dtype), return_dict=False)[0]
    if image.dim() == 5:
        image = image[:, :, 0]
    return (image * 0.5 + 0.5).clamp(0, 1)


# ---------------------------------------------------------------- the fit
def fit_linear_map(vae, scale: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight: 3 x channels, bias: 3), least squares from the VAE's latents to its own
    decode of them, averaged over the pixels each latent covers. The latents are the VAE's
    encoding of synthetic pictures (plain grounds with coloured shapes), so that they are like
    the ones its model makes. `scale`: how many pixels a latent spans, a side."""
    video = "z_dim" in vae.config  # Qwen-Image's and Wan's VAEs take (batch, channels, frames, h, w)
    pictures = synthetic_pictures(FIT_IMAGES, FIT_LATENT_SIDE * scale)
    with torch.inference_mode(), torch.compiler.set_stance("force_eager"), upcast(vae):
        parameter = next(vae.parameters())
        x = (pictures * 2 - 1).to(parameter.device, parameter.dtype)
        latents = vae.encode(x.unsqueeze(2) if video else x).latent_dist.mode()
        decoded = decode(vae, latents).float().cpu()
        latents = (latents[:, :, 0] if video else latents).float().cpu()
    covered = decoded.shape[-1] // latents.shape[-1]
    target = F.avg_pool2d(decoded, covered).permute(0, 2, 3, 1).reshape(-1, 3)
    rows = latents.permute(0, 2, 3, 1).reshape(-1, latents.shape[1])
    solution = torch.linalg.lstsq(torch.cat([rows, torch.ones(len(rows), 1)], dim=1), target).solution
    return solution[:-1].T.contiguous().to(parameter.device), solution[-1].contiguous().to(parameter.device)


def synthetic_pictures(count: int, side: int, seed: int = 0) -> torch.Tensor:
    """`count` pictures (count, 3, side, side) in [0, 1]: a plain ground of a random colour with
    a circle and a square of others, placed and sized at random (seeded: the same every start)."""
    generator = torch.Generator().manual_seed(seed)
    y, x = torch.meshgrid(torch.linspace(0, 1, side), torch.linspace(0, 1, side), indexing="ij")
    pictures = torch.empty(count, 3, side, side)
    for i in range(count):
        picture = torch.rand(3, 1, 1, generator=generator).expand(3, side, side)
        for round_shape in (True, False):
            colour = torch.rand(3, 1, 1, generator=generator)
            cx, cy, r = torch.rand(3, generator=generator).tolist()
            r = 0.1 + 0.25 * r
            if round_shape:
                inside = (x - cx) ** 2 + (y - cy) ** 2 < r * r
            else:
                inside = ((x - cx).abs() < r) & ((y - cy).abs() < r)
            picture = torch.where(inside, colour, picture)
        pictures[i] = picture
    return pictures
