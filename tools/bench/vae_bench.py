"""How fast the VAE decodes a 1024x1024 image on this GPU, eager and with the usual knobs:
channels-last memory format, cuDNN's algorithm search (`cudnn.benchmark`), torch.compile.
SDXL's and FLUX.1's VAE (random weights, real configs), bf16, batch 1; interleaved rounds,
median per decode, and each variant's largest difference from eager.

    PYTHONPATH=src python tools/bench/vae_bench.py [OUT.json] [ARCHITECTURE ...]
"""

import copy
import json
import statistics
import sys

import torch

from loraswap.bench.common import cuda_ms_per_call
from loraswap.models.architectures import build_architecture_component

VARIANTS = ["eager", "channels_last", "cudnn_benchmark", "channels_last+cudnn_benchmark", "compile",
            "compile+channels_last"]


@torch.inference_mode()
def main(out: str | None, architectures: list[str]) -> None:
    torch.manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for architecture in architectures:
        channels = {"sdxl": 4, "sd15": 4, "flux-dev": 16}[architecture]
        vae = build_architecture_component(architecture, "vae", "cuda")
        latents = torch.randn(1, channels, 128, 128, device="cuda", dtype=torch.bfloat16)
        decoders = {}
        for variant in VARIANTS:
            module = copy.deepcopy(vae)
            if "channels_last" in variant:
                module.to(memory_format=torch.channels_last)
            decode = module.decode
            if "compile" in variant:
                module.decoder.compile()
            benchmark = "cudnn_benchmark" in variant
            decoders[variant] = (decode, benchmark)
        outputs, times = {}, {v: [] for v in VARIANTS}
        for variant, (decode, benchmark) in decoders.items():  # warm-up: compile, cuDNN search
            torch.backends.cudnn.benchmark = benchmark
            outputs[variant] = decode(latents).sample.float()
            decode(latents)
        for _ in range(5):
            for variant, (decode, benchmark) in decoders.items():
                torch.backends.cudnn.benchmark = benchmark
                times[variant].append(cuda_ms_per_call(lambda: decode(latents), 3))
        torch.backends.cudnn.benchmark = False
        eager = outputs["eager"]
        rows = {v: {"ms": round(statistics.median(times[v]), 2),
                    "vs_eager": round(statistics.median(times[v]) / statistics.median(times["eager"]), 3),
                    "max_abs_diff": round((outputs[v] - eager).abs().max().item(), 4)} for v in VARIANTS}
        report["shapes"][architecture] = rows
        for v, row in rows.items():
            print(architecture, v, row, flush=True)
        del vae, decoders, outputs
        torch.cuda.empty_cache()
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None, sys.argv[2:] or ["sdxl", "flux-dev"])
