"""Seed 1's way of serving a LoRA, kept as the benchmark baseline (`--swap-mode diffusers`).

What the Hugging Face Inference API image does per request: unfuse and unload the
previous adapter, `load_lora_weights` + `fuse_lora` the new one, on an eager model.
No validation beyond diffusers' own, no cache: the file is read every time.
"""

import time
from collections.abc import Sequence

import torch
from diffusers import DiffusionPipeline

from ..adapters.source import AdapterLocation


class DiffusersLoadFuse:
    def __init__(self, pipeline: DiffusionPipeline):
        self.pipeline = pipeline
        self.applied_ids: tuple[tuple[str, float], ...] = ()

    def apply(self, adapters: Sequence[tuple[AdapterLocation, float]]) -> float:
        start = time.perf_counter()
        pipeline = self.pipeline
        if self.applied_ids:
            pipeline.unfuse_lora()
            pipeline.unload_lora_weights()
            self.applied_ids = ()
        names = [f"lora{i}" for i in range(len(adapters))]
        for name, (location, _) in zip(names, adapters):
            pipeline.load_lora_weights(str(location.weights), adapter_name=name)
        if names:
            pipeline.set_adapters(names, [weight for _, weight in adapters])
            pipeline.fuse_lora(adapter_names=names)
        self.applied_ids = tuple((location.adapter_id, weight) for location, weight in adapters)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start
