"""Train the `demo` model and its adapters on pictures this script draws itself.

    python tools/demo/train_demo.py [--stage all|vae|unet|adapters] [--device cuda|cpu] [--seed 0]

The pictures: a coloured circle, square or triangle at the left, centre or right, on a
white, black or grey ground, with the prompt that says so ("a red circle at the left on
white"; the position or the ground left out now and then, and one prompt in ten empty so
that guidance works). Stages, each writing into `--out` (by default `src/loraswap/models/demo_weights/`):
1. the VAE (reconstruction, a touch of KL, on the adapters' pictures too), then the
   latents' scaling factor;
2. the UNet (noise prediction, the text encoder frozen at its seeded weights);
3. the adapters of `DEMO_ADAPTERS`, each trained from the UNet on pictures changed as its
   name says, and written by the library its kind's trainers use: LoRA, LoCon, LoHa and
   LoKr by `lycoris-lora` (kohya names, `lora_unet_...`), DoRA by PEFT and diffusers'
   `save_lora_weights`.
Weights are stored in float16. Seeded: the pictures, the noise and the first weights come
from `--seed`; with `--deterministic` a GPU gives the same weights for the same seed too.

The shipped weights were made on 2026-12-04 by:

    python tools/demo/train_demo.py --stage vae --vae-steps 2000 --device cuda    # H200: 60 s
    python tools/demo/train_demo.py --stage unet --unet-steps 5000 --device cuda  # H200: 55 ms a step
    python tools/demo/train_demo.py --stage adapters --device cpu --threads 2     # 2 CPU cores: 500 steps each

The UNet run was stopped by its machine's time limit after 4,750 steps: the UNet shipped is
its checkpoint at step 4,000. The whole of it takes about ten minutes on an H200; the
adapters, about four minutes each on two CPU cores.
"""

import argparse
import logging
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler
from safetensors.torch import save_file

from loraswap.models.families import demo

log = logging.getLogger("train_demo")
SUPERSAMPLE = 4  # shapes drawn at 4x and averaged down: smooth edges


# ---------------------------------------------------------------- the pictures
def _shape_mask(shape: str, cx: float, cy: float, radius: float, size: int) -> np.ndarray:
    """Coverage (0..1) of the shape at `size` pixels; centre and radius in pixels."""
    n = size * SUPERSAMPLE
    y, x = (np.mgrid[0:n, 0:n] + 0.5) / SUPERSAMPLE
    dx, dy = x - cx, y - cy
    if shape == "circle":
        inside = dx**2 + dy**2 <= radius**2
    elif shape == "square":
        half = radius * 0.86  # the area of the circle
        inside = (np.abs(dx) <= half) & (np.abs(dy) <= half)
    else:  # an upright triangle, base below
        top, bottom = cy - radius * 1.1, cy + radius * 0.9
        half_width = (y - top) / (bottom - top) * radius * 1.15
        inside = (y >= top) & (y <= bottom) & (np.abs(dx) <= half_width)
    return inside.reshape(size, SUPERSAMPLE, size, SUPERSAMPLE).mean(axis=(1, 3))


def _outline(shape: str, cx: float, cy: float, radius: float, size: int) -> np.ndarray:
    width = 2.0
    return np.clip(_shape_mask(shape, cx, cy, radius, size) - _shape_mask(shape, cx, cy, radius - width, size), 0, 1)


def draw(colour: str, shape: str, position: str, ground: str, rng: np.random.Generator,
         effect: str | None = None) -> np.ndarray:
    """One picture, float RGB in [0, 1], `SIZE` square; `effect`: an adapter's change."""
    size = demo.SIZE
    radius = size * 0.22 * rng.uniform(0.9, 1.1)
    cx = size * (demo.POSITIONS[position] + rng.uniform(-0.04, 0.04))
    cy = size * (0.5 + rng.uniform(-0.06, 0.06))
    fill = np.array(demo.COLOURS[colour], dtype=np.float32) / 255
    back = np.array(demo.BACKGROUNDS[ground], dtype=np.float32) / 255
    if effect == "night":
        back = np.array(demo.BACKGROUNDS["black"], dtype=np.float32) / 255
    if effect == "big":
        radius *= 1.5
    if effect == "pastel":
        fill = 0.4 * fill + 0.6
    if effect == "outline":
        mask = _outline(shape, cx, cy, radius, size)
    else:
        mask = _shape_mask(shape, cx, cy, radius, size)
    if effect == "striped":  # bands 2 pixels high, every 4
        rows = (np.arange(size) // 2) % 2 == 0
        mask = mask * rows[:, None]
    return back + mask[..., None] * (fill - back)


def prompt_of(colour: str, shape: str, position: str | None, ground: str | None) -> str:
    words = ["a", colour, shape]
    if position:
        words += ["at", "the", position]
    if ground:
        words += ["on", ground]
    return " ".join(words)


EFFECTS = (None, *demo.DEMO_ADAPTERS)


def batch(rng: np.random.Generator, n: int, effect: str | None = None,
          any_effect: bool = False) -> tuple[torch.Tensor, list[str]]:
    """`n` pictures in [-1, 1] (NCHW) and their prompts; `any_effect`: each picture with a
    random one of the adapters' changes, or none (what the VAE must be able to draw)."""
    images, prompts = [], []
    for _ in range(n):
        colour, shape = rng.choice(list(demo.COLOURS)), rng.choice(demo.SHAPES)
        position, ground = rng.choice(list(demo.POSITIONS)), rng.choice(list(demo.BACKGROUNDS))
        changed = EFFECTS[rng.integers(len(EFFECTS))] if any_effect else effect
        images.append(draw(colour, shape, position, ground, rng, changed))
        said = rng.random()
        if said < 0.1:
            prompts.append("")
        else:
            prompts.append(prompt_of(colour, shape, position if rng.random() > 0.2 else None,
                                     ground if rng.random() > 0.2 else None))
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float()
    return pixels * 2 - 1, prompts


class Pictures(torch.utils.data.IterableDataset):
    """Endless batches of `batch`; each loader worker draws from its own seeded stream."""

    def __init__(self, seed: int, size: int, effect: str | None = None, any_effect: bool = False):
        super().__init__()
        self.seed, self.size, self.effect, self.any_effect = seed, size, effect, any_effect

    def __iter__(self):
        worker = torch.utils.data.get_worker_info()
        rng = np.random.default_rng([self.seed, worker.id if worker else 0])
        while True:
            yield batch(rng, self.size, self.effect, self.any_effect)


def pictures(seed: int, size: int, workers: int, effect: str | None = None, any_effect: bool = False):
    """An iterator of batches, drawn by `workers` processes (the GPU outruns one drawing
    core); the order is fixed by the seed and the number of workers."""
    loader = torch.utils.data.DataLoader(Pictures(seed, size, effect, any_effect), batch_size=None,
                                         num_workers=workers, prefetch_factor=8 if workers else None)
    return iter(loader)


# ---------------------------------------------------------------- training
def _save(module: torch.nn.Module, out: Path, name: str) -> None:
    weights = {k: v.detach().to(torch.float16).contiguous() for k, v in module.state_dict().items()}
    save_file(weights, str(out / f"{name}.safetensors"))


def _lr(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over 100 steps, then cosine to a tenth."""
    if step < 100:
        return peak * (step + 1) / 100
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 100) / max(1, steps - 100))))


def train_vae(pipeline, device, out: Path, seed: int, workers: int, steps: int) -> None:
    started = time.perf_counter()
    vae = pipeline.vae.to(device).train()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=1e-3)
    stream = pictures(seed, 32, workers, any_effect=True)  # the adapters' pictures too: it decodes for them as well
    for step in range(steps):
        pixels, _ = next(stream)
        posterior = vae.encode(pixels.to(device)).latent_dist
        rebuilt = vae.decode(posterior.sample()).sample
        loss = F.mse_loss(rebuilt, pixels.to(device)) + 1e-6 * posterior.kl().mean()
        _step(optimizer, loss, _lr(step, steps, 1e-3))
        if step % 100 == 0 or step == steps - 1:
            log.info("vae %d/%d loss %.5f", step, steps, loss.item())
    vae.eval().requires_grad_(False)
    with torch.no_grad():  # latents of unit variance for the UNet, as SD's scaling factor does
        rng = np.random.default_rng(seed)
        latents = torch.cat([vae.encode(batch(rng, 64)[0].to(device)).latent_dist.mean for _ in range(8)])
    scale = 1.0 / latents.std().item()
    vae.register_to_config(scaling_factor=scale)
    (out / "vae_scaling_factor.txt").write_text(f"{scale:.6f}\n")
    _save(vae, out, "vae")
    log.info("vae in %.0f s", time.perf_counter() - started)


def _step(optimizer, loss, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
    optimizer.step()


class Denoising:
    """The diffusion loss of the UNet on a batch (epsilon prediction, SD's noise schedule)."""

    def __init__(self, pipeline, device):
        self.pipeline, self.device = pipeline, device
        self.noise = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                   num_train_timesteps=1000)
        self.texts: dict[str, torch.Tensor] = {}

    def encode(self, prompts: list[str]) -> torch.Tensor:
        missing = [p for p in set(prompts) if p not in self.texts]
        if missing:
            tokens = self.pipeline.tokenizer(missing, padding="max_length", max_length=77, return_tensors="pt")
            with torch.no_grad():
                states = self.pipeline.text_encoder(tokens.input_ids.to(self.device))[0]
            self.texts.update(zip(missing, states))
        return torch.stack([self.texts[p] for p in prompts])

    def loss(self, unet, pixels: torch.Tensor, prompts: list[str], generator: torch.Generator) -> torch.Tensor:
        vae = self.pipeline.vae
        with torch.no_grad():
            latents = vae.encode(pixels.to(self.device)).latent_dist.mean * vae.config.scaling_factor
        noise = torch.randn(latents.shape, generator=generator).to(self.device)
        steps = torch.randint(0, 1000, (len(latents),), generator=generator).to(self.device)
        noisy = self.noise.add_noise(latents, noise, steps)
        predicted = unet(noisy, steps, self.encode(prompts)).sample
        return F.mse_loss(predicted, noise)


def train_unet(pipeline, device, out: Path, seed: int, workers: int, steps: int, lr: float) -> None:
    started = time.perf_counter()
    unet = pipeline.unet.to(device).train()
    denoising = Denoising(pipeline, device)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=lr, weight_decay=1e-4)
    stream, generator = pictures(seed, 64, workers), torch.Generator().manual_seed(seed)
    for step in range(steps):
        pixels, prompts = next(stream)
        loss = denoising.loss(unet, pixels, prompts, generator)
        _step(optimizer, loss, _lr(step, steps, lr))
        if step % 100 == 0 or step == steps - 1:
            log.info("unet %d/%d loss %.4f", step, steps, loss.item())
        if step % 1000 == 999:  # a run stopped early still leaves a UNet
            _save(unet, out, "unet")
    unet.eval().requires_grad_(False)
    _save(unet, out, "unet")
    log.info("unet in %.0f s", time.perf_counter() - started)


# ---------------------------------------------------------------- the adapters
LYCORIS = {  # adapter -> lycoris-lora's create_lycoris arguments (rank, alpha, algo, ...)
    "outline": dict(linear_dim=8, linear_alpha=8, algo="lora", preset="attn-mlp"),
    "striped": dict(linear_dim=8, linear_alpha=8, conv_dim=8, conv_alpha=8, algo="lora", preset="full"),
    "pastel": dict(linear_dim=4, linear_alpha=4, conv_dim=4, conv_alpha=4, algo="loha", preset="full"),
    "night": dict(linear_dim=8, linear_alpha=8, conv_dim=8, conv_alpha=8, algo="lokr", factor=8, preset="full"),
}
DORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2", "conv1",
                "conv2"]


def _fit(unet, parameters, denoising, stream, generator, effect: str, steps: int, lr: float) -> None:
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    for step in range(steps):
        pixels, prompts = next(stream)
        loss = denoising.loss(unet, pixels, prompts, generator)
        _step(optimizer, loss, _lr(step, steps, lr))
        if step % 100 == 0 or step == steps - 1:
            log.info("%s %d/%d loss %.4f", effect, step, steps, loss.item())


def train_lycoris(name: str, pipeline, denoising, stream, generator, steps: int, out: Path) -> None:
    """LoRA / LoCon / LoHa / LoKr on the UNet, kohya-named as LyCORIS writes them."""
    from lycoris import LycorisNetwork, create_lycoris

    unet = pipeline.unet
    LycorisNetwork.LORA_PREFIX = "lora_unet"
    kwargs = dict(LYCORIS[name])
    network = create_lycoris(unet, 1.0, kwargs.pop("linear_dim"), kwargs.pop("linear_alpha"), **kwargs)
    network.apply_to()
    network.to(denoising.device)
    unet.train()
    _fit(unet, list(network.parameters()), denoising, stream, generator, name, steps, 2e-3)
    unet.eval()
    network.save_weights(str(out / f"{name}.safetensors"), torch.float16,
                         {"ss_network_module": "lycoris.kohya", "ss_network_args": str(LYCORIS[name]),
                          "ss_base_model_version": "demo"})
    network.restore()
    LycorisNetwork.LORA_PREFIX = "lycoris"


def train_dora(name: str, pipeline, denoising, stream, generator, steps: int, out: Path) -> None:
    """DoRA through PEFT, written by diffusers' `save_lora_weights` (PEFT names, magnitudes)."""
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig, get_peft_model_state_dict

    unet = pipeline.unet
    unet.add_adapter(LoraConfig(r=8, lora_alpha=8, use_dora=True, target_modules=DORA_TARGETS,
                                init_lora_weights="gaussian"), adapter_name=name)
    parameters = [p for n, p in unet.named_parameters() if "lora_" in n]
    for p in parameters:
        p.requires_grad_(True)
    unet.train()
    _fit(unet, parameters, denoising, stream, generator, name, steps, 2e-3)
    unet.eval()
    layers = {k: v.detach().to(torch.float16) for k, v in get_peft_model_state_dict(unet, adapter_name=name).items()}
    StableDiffusionPipeline.save_lora_weights(out, unet_lora_layers=layers, weight_name=f"{name}.safetensors")
    unet.delete_adapters(name)


def train_adapters(pipeline, device, out: Path, seed: int, workers: int, steps: int,
                   names=tuple(demo.DEMO_ADAPTERS)) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pipeline.unet.to(device).eval().requires_grad_(False)
    denoising = Denoising(pipeline, device)
    for name in names:
        started = time.perf_counter()
        own_seed = seed * 100 + list(demo.DEMO_ADAPTERS).index(name)  # the same with or without the others
        stream, generator = pictures(own_seed, 32, workers, name), torch.Generator().manual_seed(own_seed)
        train = train_dora if name == "big" else train_lycoris
        train(name, pipeline, denoising, stream, generator, steps, out)
        log.info("adapter %s in %.0f s", name, time.perf_counter() - started)


# ---------------------------------------------------------------- the stages
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=("all", "vae", "unet", "adapters"), default="all")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=demo.WEIGHTS, help="where the weights go (adapters in adapters/)")
    parser.add_argument("--resume", action="store_true", help="unet stage: go on from the UNet in --out")
    parser.add_argument("--vae-steps", type=int, default=2000)
    parser.add_argument("--unet-steps", type=int, default=5000)
    parser.add_argument("--unet-lr", type=float, default=1e-3, help="peak learning rate of the UNet")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes drawing the pictures (default: 8 on a GPU, none on a CPU)")
    parser.add_argument("--adapter-steps", type=int, default=500)
    parser.add_argument("--deterministic", action="store_true",
                        help="on a GPU, the same weights for the same seed (slower kernels)")
    parser.add_argument("--adapter", action="append", choices=tuple(demo.DEMO_ADAPTERS),
                        help="adapters stage: train only these (repeatable)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.deterministic:  # no racing kernels, no autotuning: the same seed, the same weights
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    # LyCORIS's compiled kernels take minutes to warm up, more than a few hundred steps need.
    os.environ.setdefault("LYCORIS_KERNEL_BACKEND", "torch")
    torch.manual_seed(args.seed)
    workers = args.workers if args.workers is not None else (0 if args.device == "cpu" else 8)
    args.out.mkdir(parents=True, exist_ok=True)
    pipeline = demo.untrained_demo()  # the text encoder keeps these seeded weights, frozen
    pipeline.text_encoder.to(args.device).eval().requires_grad_(False)
    if args.stage in ("all", "vae"):
        _save(pipeline.text_encoder, args.out, "text_encoder")
        train_vae(pipeline, args.device, args.out, args.seed, workers, args.vae_steps)
    else:
        later = args.stage == "adapters" or args.resume
        pipeline = demo.load_trained(pipeline, ("vae", "text_encoder", *(("unet",) if later else ())), args.out)
        pipeline.vae.to(args.device).eval().requires_grad_(False)
    if args.stage in ("all", "unet"):
        train_unet(pipeline, args.device, args.out, args.seed, workers, args.unet_steps, args.unet_lr)
    if args.stage in ("all", "adapters"):
        train_adapters(pipeline, args.device, args.out / "adapters", args.seed, workers, args.adapter_steps,
                       tuple(args.adapter or demo.DEMO_ADAPTERS))


if __name__ == "__main__":
    main()
