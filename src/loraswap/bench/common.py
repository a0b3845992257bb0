"""Benchmark plumbing: timing, summaries, the table, JSON and the plot."""

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """Seconds `fn` took, the device synchronised before and after."""
    sync()
    started = time.perf_counter()
    result = fn()
    sync()
    return time.perf_counter() - started, result


def cuda_ms_per_call(fn: Callable[[], object], repeats: int) -> float:
    """Milliseconds per call of `fn`, `repeats` calls back to back between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def gpu_kernel_times(run: Callable[[], object], units: int) -> dict[str, tuple[float, float]]:
    """Kernel name -> (GPU milliseconds, launches) per unit of work, from one torch.profiler
    run of `run`, which does `units` of it (steps, swaps)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]  # CUDA where it is
    with torch.profiler.profile(activities=activities) as prof:
        run()
        sync()
    times: dict[str, tuple[float, float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            ms, launches = times.get(event.name, (0.0, 0.0))
            times[event.name] = (ms + event.time_range.elapsed_us() / 1e3 / units, launches + 1 / units)
    return times


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]  # noqa: E731
    return {"n": len(values), "p50": statistics.median(values), "min": ordered[0], "max": ordered[-1],
            "p90": pick(0.9), "p99": pick(0.99)}


def environment() -> dict:
    import diffusers
    import peft

    info = {"torch": torch.__version__, "diffusers": diffusers.__version__, "peft": peft.__version__,
            "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def on_device_column(env: dict) -> str:
    """The column of swaps from adapters already on the device: named GPU only where there is one."""
    return "swap GPU ms" if "gpu" in env else "swap ms"


def write_results(out_dir: Path, name: str, results: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(results, indent=1, default=str))
    return path


def print_table(title: str, header: list[str], rows: list[list]) -> str:
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    lines = [title, "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(str(x).ljust(w) for x, w in zip(row, widths)) + " |" for row in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def plot_bars(path: Path, title: str, labels: list[str], values: list[float], ylabel: str) -> bool:
    """A bar chart; False when matplotlib is not installed (the JSON holds the numbers)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(labels, values, color="#4477aa")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
    plt.xticks(rotation=20, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_random_adapters(model: str, specs, folder: Path, fmt: str = "diffusers", seed: int = 0) -> list[Path]:
    """Real-size random adapters for the denoiser of `model`, one per (rank, targets) spec;
    files already there are reused."""
    from loraswap.adapters.random import make_random_adapter
    from loraswap.models import lora_components

    _, components = lora_components(model)
    denoiser = {k: v for k, v in components.items() if not k.startswith("text_encoder")}
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (rank, targets) in enumerate(specs):
        path = folder / f"{model}-r{rank}-{targets}-{fmt}-{seed + i}.safetensors"
        if not path.exists():
            state_dict, metadata = make_random_adapter(denoiser, rank, targets, fmt, dtype=torch.bfloat16,
                                                       seed=seed + i)
            save_file(state_dict, str(path), metadata=metadata)
        paths.append(path)
    return paths
