"""Train `demo-flux` and its adapters on pictures drawn in code (`demo_flux_pictures.py`).

    python tools/demo/train_demo_flux.py [--stage vae|transformer|distil|adapters] [--device cuda] [--seed 0]

Stages, each writing into `--out` (by default `src/loraswap/models/demo_flux_weights/`);
`--stage` is the first one run, from what the stages before it wrote there:
1. `vae`: the 16-channel VAE (reconstruction and a touch of KL, on every adapter's pictures
   too), then its latents' shift and scale, as FLUX.1's VAE has them;
2. `transformer`: flow matching (FLUX.1's objective: the velocity noise - picture at a
   logit-normal time, shifted as the scheduler shifts it for 64 tokens), the prompt left
   empty one time in ten; the text encoders frozen at their seeded weights;
3. `distil`: classifier-free guidance distilled into the guidance embedding, as FLUX.1-dev
   is: the trained model (frozen) guided at a random scale in [1, 5] is the target of a
   copy told that scale, so one pass a step draws what two passes with guidance drew;
4. `adapters`: `demo_flux_adapters.py`, from the distilled model, each on its own pictures.
Weights are written in float16; the pictures, the noise and the first weights follow from
`--seed`. The shipped weights were made on 2026-12-07 by three runs, each one device call of
`tools/demo/demo_flux_gpu_run.sh` (torch 2.11, CUDA 13), each stage from the weights the one
before wrote:

    python tools/demo/train_demo_flux.py --stage vae      # H200; the call's limit stopped it after the transformer
    python tools/demo/train_demo_flux.py --stage distil   # H200: the guidance distilled, then the four adapters
    python tools/demo/train_demo_flux.py --stage adapters --adapter pastel  # H100: the LoKr again, full factors

Times: drawing the 64,000 pictures 33 s (15 processes); the VAE 79 s (3,000 steps of 32); the
transformer 282 s (8,000 steps of 256, about 35 ms a step); the distillation 91 s (2,000
steps); the adapters 21-44 s each (600 steps of 256), the LoKr 118 s (1,000 steps, H100).
About nine minutes of GPU in all.
"""

import argparse
import copy
import json
import logging
import math
import multiprocessing
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from demo_flux_pictures import EFFECTS, examples
from diffusers import FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from safetensors.torch import load_file
from train_demo import _save as save  # float16 safetensors, as the demo's
from train_demo import _step as step  # one clipped AdamW step at a given rate

from loraswap.models.families import demo_flux

log = logging.getLogger("train_demo_flux")
LATENT = demo_flux.SIZE // 8  # latent pixels a side
STAGES = ("vae", "transformer", "distil", "adapters")
CHUNK = 500  # pictures drawn per task


# ---------------------------------------------------------------- the pictures
def _draw_chunk(task: tuple[int, int, str | None]) -> tuple[np.ndarray, list[str]]:
    seed, count, effect = task
    return examples(seed, count, effect)


def draw_sets(seed: int, count: int, effect_count: int, workers: int) -> dict:
    """effect (None: the plain pictures) -> (N x H x W x 3 uint8, prompts), drawn in parallel."""
    tasks = []
    for index, effect in enumerate(EFFECTS):
        total = count if effect is None else effect_count
        tasks += [(seed * 1000 + index * 100 + chunk, min(CHUNK, total - chunk * CHUNK), effect)
                  for chunk in range(math.ceil(total / CHUNK))]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        drawn = pool.map(_draw_chunk, tasks)
    sets = {}
    for (_, _, effect), (pictures, prompts) in zip(tasks, drawn):
        old = sets.get(effect, (np.zeros((0, demo_flux.SIZE, demo_flux.SIZE, 3), np.uint8), []))
        sets[effect] = (np.concatenate([old[0], pictures]), old[1] + prompts)
    return sets


def to_pixels(pictures: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(pictures).to(device).permute(0, 3, 1, 2).float() / 127.5 - 1


# ---------------------------------------------------------------- helpers
def lr_at(step: int, steps: int, peak: float, warm_up: int = 200) -> float:
    """Linear warm-up, then cosine to a tenth."""
    if step < warm_up:
        return peak * (step + 1) / warm_up
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm_up) / max(1, steps - warm_up))))


class Ema:
    """An exponential moving average of a module's weights (what is saved)."""

    def __init__(self, module: torch.nn.Module, decay: float):
        self.decay, self.module = decay, module
        self.shadow = [p.detach().clone() for p in module.parameters()]

    def update(self) -> None:
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.module.parameters()], 1 - self.decay)

    def copy_to(self, module: torch.nn.Module) -> None:
        for p, s in zip(module.parameters(), self.shadow):
            p.data.copy_(s)


# ---------------------------------------------------------------- the VAE
def train_vae(pipeline, sets: dict, device, out: Path, steps: int, seed: int) -> None:
    started = time.perf_counter()
    vae = pipeline.vae.to(device).train()
    pictures = np.concatenate([s[0] for s in sets.values()])  # it decodes for the adapters as well
    optimizer = torch.optim.AdamW(vae.parameters(), lr=1e-3, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    for i in range(steps):
        pixels = to_pixels(pictures[rng.integers(len(pictures), size=32)], device)
        posterior = vae.encode(pixels).latent_dist
        rebuilt = vae.decode(posterior.sample()).sample
        loss = F.mse_loss(rebuilt, pixels) + 0.1 * F.l1_loss(rebuilt, pixels) + 1e-6 * posterior.kl().mean()
        step(optimizer, loss, lr_at(i, steps, 1e-3))
        if i % 250 == 0 or i == steps - 1:
            log.info("vae %d/%d loss %.5f", i, steps, loss.item())
    vae.eval().requires_grad_(False)
    with torch.no_grad():  # FLUX.1's latents: (z - shift) * scale, of mean 0 and variance 1
        latents = torch.cat([vae.encode(to_pixels(pictures[i:i + 256], device)).latent_dist.mean
                             for i in range(0, min(4096, len(pictures)), 256)])
    factors = {"shift_factor": latents.mean().item(), "scaling_factor": 1.0 / latents.std().item()}
    vae.register_to_config(**factors)
    (out / "vae_factors.json").write_text(json.dumps(factors, indent=1) + "\n")
    save(vae, out, "vae")
    log.info("vae in %.0f s: %s", time.perf_counter() - started, factors)


# ---------------------------------------------------------------- flow matching
class FlowData:
    """A set of pictures as FLUX.1 latents (packed into 64 tokens) and their prompts'
    embeddings, on the device, with FLUX.1's noising."""

    def __init__(self, pipeline, pictures: np.ndarray, prompts: list[str], device, generator: torch.Generator):
        self.device, self.generator = device, generator
        vae = pipeline.vae
        with torch.no_grad():
            means = torch.cat([vae.encode(to_pixels(pictures[i:i + 256], device)).latent_dist.mean
                               for i in range(0, len(pictures), 256)])
        latents = (means - vae.config.shift_factor) * vae.config.scaling_factor
        self.latents = FluxPipeline._pack_latents(latents, len(latents), 16, LATENT, LATENT)
        unique = sorted(set(prompts) | {""})
        index = {p: i for i, p in enumerate(unique)}
        self.prompt_index = torch.tensor([index[p] for p in prompts], device=device)
        self.empty = index[""]
        with torch.no_grad():
            embeds, pooled, self.text_ids = pipeline.encode_prompt(
                unique, prompt_2=None, device=device, max_sequence_length=demo_flux.TEXT_TOKENS)
        self.embeds, self.pooled = embeds.float(), pooled.float()
        self.image_ids = FluxPipeline._prepare_latent_image_ids(1, LATENT // 2, LATENT // 2, device, torch.float32)
        mu = calculate_shift(self.latents.shape[1], *(demo_flux.SCHEDULER[k] for k in (
            "base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")))
        self.shift = math.exp(mu)  # the scheduler's time shift at 64 tokens

    def sample(self, size: int, drop: float = 0.0) -> dict:
        """A batch: noisy latents, time, prompts (a fraction `drop` made empty), velocity."""
        g = self.generator
        chosen = torch.randint(len(self.latents), (size,), generator=g).to(self.device)
        clean = self.latents[chosen]
        t = torch.sigmoid(torch.randn(size, generator=g)).to(self.device)
        sigma = self.shift * t / (1 + (self.shift - 1) * t)
        noise = torch.randn(clean.shape, generator=g).to(self.device)
        prompts = self.prompt_index[chosen]
        if drop:
            dropped = (torch.rand(size, generator=g) < drop).to(self.device)
            prompts = torch.where(dropped, torch.full_like(prompts, self.empty), prompts)
        s = sigma[:, None, None]
        return {"noisy": (1 - s) * clean + s * noise, "sigma": sigma, "prompts": prompts, "velocity": noise - clean}

    def predict(self, transformer, batch: dict, guidance: torch.Tensor, prompts: torch.Tensor | None = None):
        prompts = batch["prompts"] if prompts is None else prompts
        return transformer(hidden_states=batch["noisy"], timestep=batch["sigma"], guidance=guidance,
                           pooled_projections=self.pooled[prompts], encoder_hidden_states=self.embeds[prompts],
                           txt_ids=self.text_ids, img_ids=self.image_ids, return_dict=False)[0]


def train_transformer(pipeline, data: FlowData, out: Path, steps: int, batch: int, lr: float) -> None:
    started = time.perf_counter()
    transformer = pipeline.transformer.train().requires_grad_(True)
    ema = Ema(transformer, 0.999)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=0.01)
    ones = torch.ones(batch, device=data.device)  # guidance 1 until it is distilled
    for i in range(steps):
        b = data.sample(batch, drop=0.1)
        loss = F.mse_loss(data.predict(transformer, b, ones), b["velocity"])
        step(optimizer, loss, lr_at(i, steps, lr))
        ema.update()
        if i % 500 == 0 or i == steps - 1:
            log.info("transformer %d/%d loss %.4f", i, steps, loss.item())
    ema.copy_to(transformer)
    transformer.eval().requires_grad_(False)
    save(transformer, out, "transformer_undistilled")
    log.info("transformer in %.0f s", time.perf_counter() - started)


def distil_guidance(pipeline, data: FlowData, out: Path, steps: int, batch: int, lr: float) -> None:
    """The student, told a guidance g, learns the teacher's guided velocity
    v(empty) + g (v(prompt) - v(empty))."""
    started = time.perf_counter()
    teacher = pipeline.transformer.eval().requires_grad_(False)
    student = copy.deepcopy(teacher).train().requires_grad_(True)
    ema = Ema(student, 0.999)
    optimizer = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.01)
    ones = torch.ones(batch, device=data.device)
    empty = torch.full((batch,), data.empty, device=data.device)
    for i in range(steps):
        b = data.sample(batch, drop=0.1)
        scale = (1 + 4 * torch.rand(batch, generator=data.generator)).to(data.device)
        with torch.no_grad():
            guided, unguided = data.predict(teacher, b, ones), data.predict(teacher, b, ones, empty)
            target = unguided + scale[:, None, None] * (guided - unguided)
        loss = F.mse_loss(data.predict(student, b, scale), target)
        step(optimizer, loss, lr_at(i, steps, lr, warm_up=50))
        ema.update()
        if i % 500 == 0 or i == steps - 1:
            log.info("distil %d/%d loss %.5f", i, steps, loss.item())
    ema.copy_to(student)
    pipeline.transformer = student.eval().requires_grad_(False)
    save(pipeline.transformer, out, "transformer")
    log.info("distilled in %.0f s", time.perf_counter() - started)


# ---------------------------------------------------------------- the stages
def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=STAGES, default="vae", help="the first stage run; the later ones follow")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=demo_flux.WEIGHTS)
    parser.add_argument("--pictures", type=int, default=40000, help="plain pictures drawn")
    parser.add_argument("--effect-pictures", type=int, default=6000, help="pictures drawn per adapter")
    parser.add_argument("--workers", type=int, default=max(1, multiprocessing.cpu_count() - 1))
    parser.add_argument("--vae-steps", type=int, default=3000)
    parser.add_argument("--transformer-steps", type=int, default=8000)
    parser.add_argument("--distil-steps", type=int, default=2000)
    parser.add_argument("--adapter-steps", type=int, default=None,
                        help="steps per adapter (default: 600, the LoKr 1,000)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=5e-4, help="peak learning rate of the transformer")
    parser.add_argument("--adapter", action="append", choices=tuple(demo_flux.DEMO_ADAPTERS),
                        help="adapters stage: train only these (repeatable)")
    return parser.parse_args()


def load_stage_inputs(pipeline, stage: str, out: Path, device):
    """What a stage begins from: the weights the stages before it wrote."""
    names = {"vae": (), "transformer": ("vae",), "distil": ("vae",), "adapters": ("vae", "transformer")}[stage]
    if names:
        demo_flux.load_trained(pipeline, ("text_encoder", "text_encoder_2", *names), out)
    if stage == "distil":
        weights = load_file(str(out / "transformer_undistilled.safetensors"))
        pipeline.transformer.load_state_dict({k: v.float() for k, v in weights.items()})
    for module in (pipeline.vae, pipeline.transformer):
        module.to(device).eval().requires_grad_(False)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    sets = draw_sets(args.seed, args.pictures, args.effect_pictures, args.workers)  # before CUDA: the pool forks
    log.info("drew %d pictures in %.0f s", sum(len(s[1]) for s in sets.values()), time.perf_counter() - started)
    torch.manual_seed(args.seed)
    pipeline = demo_flux.untrained_demo_flux()
    pipeline.text_encoder.to(args.device).eval().requires_grad_(False)
    pipeline.text_encoder_2.to(args.device).eval().requires_grad_(False)
    runs = set(STAGES[STAGES.index(args.stage):])
    if args.stage == "vae":
        save(pipeline.text_encoder, args.out, "text_encoder")
        save(pipeline.text_encoder_2, args.out, "text_encoder_2")
    else:
        load_stage_inputs(pipeline, args.stage, args.out, args.device)
    generator = torch.Generator().manual_seed(args.seed)
    if "vae" in runs:
        train_vae(pipeline, sets, args.device, args.out, args.vae_steps, args.seed)
    pipeline.transformer.to(args.device)
    if "distil" in runs:
        data = FlowData(pipeline, *sets[None], args.device, generator)
    if "transformer" in runs:
        train_transformer(pipeline, data, args.out, args.transformer_steps, args.batch, args.lr)
    if "distil" in runs:
        distil_guidance(pipeline, data, args.out, args.distil_steps, args.batch, args.lr / 2)
    if "adapters" in runs:
        from demo_flux_adapters import train_adapters

        train_adapters(pipeline, sets, FlowData, args, generator)
    log.info("all in %.0f s", time.perf_counter() - started)


if __name__ == "__main__":
    main()
