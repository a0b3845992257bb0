"""Context parallelism on CUDA with one GPU: two ranks share it, tiny-flux, adapters swapped in
place between calls (none, a LoRA, a blend, a LoKr, none again), against one process with the
same settings.

It checks what one GPU can: the split path on CUDA with its attention backends (Ulysses with
PyTorch's SDPA, ring with cuDNN's, which returns the log-sum-exp; the CPU has none), compiled
and not, with no graph compiled across swaps, and the base model restored bit for bit after
them. Not speed: both ranks run on the same GPU.

NCCL refuses two ranks on one GPU, so the ranks use gloo, whose all-gather of CUDA tensors
crashes (SIGSEGV in wait_tensor, torch 2.11): this script gathers on the host instead. The
all-to-all (Ulysses) runs on the CUDA tensors as served.

    PYTHONPATH=src python tools/gpu_checks/context_parallel_gpu_check.py --out cp-gpu-check.json
"""

import argparse
import json
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file

LORAS = [[], [("a", 1.0)], [("a", 0.5), ("b", 0.7)], [("k", 1.0)], []]
CASES = [
    dict(name="ulysses2-fp32", parallel={"ulysses_degree": 2}, dtype="float32", attention=None, compile=False),
    dict(name="ulysses2-bf16-compiled", parallel={"ulysses_degree": 2}, dtype="bfloat16", attention=None,
         compile=True),
    dict(name="ring2-bf16-cudnn", parallel={"ring_degree": 2}, dtype="bfloat16", attention="_native_cudnn",
         compile=False),
    dict(name="ring2-bf16-cudnn-compiled", parallel={"ring_degree": 2}, dtype="bfloat16",
         attention="_native_cudnn", compile=True),
]


def write_adapters(folder: Path) -> None:
    from loraswap.adapters.random import make_random_adapter
    from loraswap.models import lora_components

    components = lora_components("tiny-flux")[1]
    for name, seed, kind in (("a", 1, "lora"), ("b", 2, "lora"), ("k", 4, "lokr")):
        state_dict, metadata = make_random_adapter(components, 4, "all", "kohya", dtype=torch.float32, seed=seed,
                                                   kind=kind)
        save_file(state_dict, str(folder / f"{name}.safetensors"), metadata=metadata)


def engine_for(folder: Path, case: dict, split: bool):
    from loraswap.engine.config import EngineConfig
    from loraswap.engine.engine import Engine

    return Engine(EngineConfig(model="tiny-flux", adapters=folder, device="cuda", dtype=case["dtype"],
                               compile=case["compile"], warmup=False, attention=case["attention"],
                               **(case["parallel"] if split else {})))


def images(engine) -> tuple[list[torch.Tensor], list[int]]:
    """The calls' images, and the graphs compiled after each call (a swap must add none)."""
    out, graphs = [], []
    for loras in LORAS:
        engine.set_adapters(loras)
        call = dict(prompt="a red circle", num_inference_steps=2, output_type="pt", height=64, width=64)
        made = engine.pipeline(**engine.pipeline_arguments(call), generator=torch.Generator().manual_seed(3))
        out.append(made.images.float().cpu())
        graphs.append(engine.recompiles)
    return out, graphs


def gather_on_the_host() -> None:
    import torch.distributed._functional_collectives as funcol

    gather = funcol.all_gather_tensor

    def staged(tensor, *args, **kwargs):
        if tensor.is_cuda:
            return gather(tensor.cpu(), *args, **kwargs).to(tensor.device)
        return gather(tensor, *args, **kwargs)

    funcol.all_gather_tensor = staged


def rank(rank: int, world: int, port: int, folder: Path, case: dict, out: Path) -> None:
    try:
        gather_on_the_host()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        made, graphs = images(engine_for(folder, case, split=True))
        if rank == 0:
            torch.save({"images": made, "graphs": graphs}, out)
        dist.destroy_process_group()
    except Exception:
        if rank == 0:
            torch.save({"error": traceback.format_exc()[-3000:]}, out)
        raise


def differences(images: list[torch.Tensor], against: list[torch.Tensor]) -> dict:
    return {"max": [float(f"{(a - b).abs().max():.3g}") for a, b in zip(images, against)],
            "mean": [float(f"{(a - b).abs().mean():.3g}") for a, b in zip(images, against)]}


def run_case(case: dict, work: Path, float32: list[torch.Tensor]) -> dict:
    """`work`: the adapters' folder, and where the ranks leave their images."""
    from loraswap.engine.parallel.processes import free_port

    single, single_graphs = images(engine_for(work, case, split=False))
    world = case["parallel"].get("ulysses_degree", 1) * case["parallel"].get("ring_degree", 1)
    out, started = work / f"{case['name']}.pt", time.perf_counter()
    try:
        mp.start_processes(rank, args=(world, free_port(), work, case, out), nprocs=world, start_method="spawn")
    except Exception as e:  # noqa: BLE001 - reported, the other cases run
        return {"case": case, "error": torch.load(out).get("error", str(e)) if out.exists() else str(e)}
    split = torch.load(out)
    return {"case": case, "split_vs_one_process": differences(split["images"], single),
            "split_base_after_swaps_equals_before": torch.equal(split["images"][0], split["images"][-1]),
            "adapter_effect_max": float((single[1] - single[0]).abs().max()),
            "one_process_vs_float32": differences(single, float32),
            "split_vs_float32": differences(split["images"], float32),
            "graphs_after_each_call": {"one_process": single_graphs, "split": split["graphs"]},
            "split_s": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("cp-gpu-check.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_adapters(work)
        float32, _ = images(engine_for(work, CASES[0], split=False))  # the reference for bf16's own error
        results = []
        for case in CASES:
            results.append(run_case(case, work, float32))
            print(json.dumps(results[-1]), flush=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
