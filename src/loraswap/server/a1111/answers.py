"""A1111's answers, field for field as stable-diffusion-webui gives them: txt2img and img2img's
`{"images", "parameters", "info"}` (`info` a JSON text of `Processed.js()`'s fields, with what
ran: seeds, steps, CFG scale, the sampler, the model, and each image's infotext), and the
`GET /sdapi/v1/sd-models` rows.
"""

import json
import time
from collections.abc import Sequence

from loraswap.engine.engine import GenerateResult
from loraswap.engine.request import GenerateRequest
from loraswap.media.metadata import SAMPLER_NAMES, AdapterUse, ImageRecord
from loraswap.server.a1111.requests import A1111Txt2Img


def sampler_name(scheduler_class: str | None) -> str | None:
    """A1111's name of a diffusers scheduler (`EulerDiscreteScheduler`: `Euler`); else its class."""
    return SAMPLER_NAMES.get(scheduler_class, scheduler_class) if scheduler_class else None


def model_samplers(info: dict | None, models: Sequence[str]) -> set[str] | None:
    """A1111's names of the samplers of `models` (hosted models), from what `/ready` tells of
    each (`info`, the backend's `ready_info()`: the engine's capabilities, a Ray replica's
    too); None when one of them is not known (the models still loading, a replica that does
    not say)."""
    capabilities = (info or {}).get("capabilities", {})
    schedulers = [capabilities.get(model, {}).get("sampler") for model in models]
    if not schedulers or None in schedulers:
        return None
    return {sampler_name(scheduler) for scheduler in schedulers}


def images_answer(body: A1111Txt2Img, images: list[str], gens: Sequence[GenerateRequest],
                  results: Sequence[GenerateResult], records: Sequence[ImageRecord]) -> dict:
    """The answer of txt2img and img2img: the images (base64 PNG; none when the body says
    `send_images: false`), the request as sent, and `info` as a JSON text."""
    return {"images": images, "parameters": body.echo(),
            "info": json.dumps(_info(body, gens, results, records))}


def _info(body: A1111Txt2Img, gens: Sequence[GenerateRequest], results: Sequence[GenerateResult],
          records: Sequence[ImageRecord]) -> dict:
    """`Processed.js()`: the prompts as sent (tags and all, as A1111 shows them), the seeds
    drawn, and the steps, CFG scale, sampler and model that ran (`GenerateResult.ran`)."""
    first, ran = results[0], results[0].ran
    count = len(results)
    negative = body.negative_prompt or ""
    return {
        "prompt": body.prompt, "all_prompts": [body.prompt] * count,
        "negative_prompt": negative, "all_negative_prompts": [negative] * count,
        "seed": first.seed, "all_seeds": [r.seed for r in results],
        "subseed": -1, "all_subseeds": [-1] * count, "subseed_strength": 0,
        "width": first.image.width, "height": first.image.height,
        "sampler_name": sampler_name(ran.sampler) if ran else None,
        "cfg_scale": ran.guidance if ran else gens[0].guidance, "steps": ran.steps if ran else gens[0].steps,
        "batch_size": body.batch_size, "restore_faces": False, "face_restoration_model": None,
        "sd_model_name": ran.model if ran else None, "sd_model_hash": None, "sd_vae_name": None,
        "sd_vae_hash": None, "seed_resize_from_w": -1, "seed_resize_from_h": -1,
        "denoising_strength": ran.strength if ran else gens[0].strength,
        "extra_generation_params": {}, "index_of_first_image": 0,
        "infotexts": [record.infotext() for record in records], "styles": [],
        "job_timestamp": time.strftime("%Y%m%d%H%M%S"), "clip_skip": 1,
        "is_using_inpainting_conditioning": False,
    }


def fallback_record(gen: GenerateRequest, result: GenerateResult) -> ImageRecord:
    """The record of an image whose backend does not report what ran: the request's values."""
    return ImageRecord(prompt=gen.prompt, negative_prompt=gen.negative_prompt, steps=gen.steps,
                       guidance=gen.guidance, seed=result.seed, width=result.image.width,
                       height=result.image.height, model=None, strength=gen.strength,
                       adapters=tuple(AdapterUse(ref.adapter_id, ref.scale) for ref in gen.loras))


def sd_models(models: Sequence[str]) -> list[dict]:
    """`GET /sdapi/v1/sd-models`: one row per hosted model, its name as title (what
    `override_settings.sd_model_checkpoint` takes); no file hash, as none is one file here."""
    return [{"title": name, "model_name": name, "hash": None, "sha256": None, "filename": name, "config": None}
            for name in models]


def progress_answer(progress, image: str | None) -> dict:
    """`GET /sdapi/v1/progress` as A1111 answers it, for `progress` (a `progress_board.Progress`,
    or None when nothing of the caller's is in flight): the fraction done, the seconds left
    estimated from the pace so far, the sampling step, and `image` (base64 PNG) when the request
    asked for previews."""
    if progress is None:
        return {"progress": 0.0, "eta_relative": 0.0, "state": _state(0, 0, 0), "current_image": None,
                "textinfo": None}
    fraction = progress.fraction
    eta = progress.elapsed / fraction - progress.elapsed if fraction > 0 else 0.0
    return {"progress": fraction, "eta_relative": eta, "state": _state(1, progress.step, progress.total or 0),
            "current_image": image, "textinfo": None}


def _state(jobs: int, step: int, steps: int) -> dict:
    return {"skipped": False, "interrupted": False, "stopping_generation": False, "job": "", "job_count": jobs,
            "job_timestamp": time.strftime("%Y%m%d%H%M%S"), "job_no": 0, "sampling_step": step,
            "sampling_steps": steps}
