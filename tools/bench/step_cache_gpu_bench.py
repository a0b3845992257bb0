"""Step caching on a GPU: the skips the trained `demo-flux` decides, then their speed at real size.

Random weights cannot decide what to skip (First-Block Cache reads the model's residuals),
so the trained model decides and real sizes are made to follow:

- `demo`: `demo-flux` on the GPU, compiled, each setting over prompts with and without
  each trained adapter (swapped per request): the steps skipped, First-Block Cache's
  per-step decisions (the most common pattern is kept to force at real size), MagCache's
  ratios, the pixel difference against the cache off, the cache off bitwise before and after
  cached requests and bitwise against diffusers' own regional compile, and recompiles;
  writes `schedules.json`.
- `pipeline`: a real architecture with random weights through the engine (FLUX.1-dev by
  default; `--quantize fp8`), 1024x1024, 28 steps, a random LoRA swapped per request,
  settings interleaved with the cache off in rounds: the transformer's time per image (from
  its first call to the last step's end), the whole call's, and recompiles. First-Block Cache
  follows `schedules.json`'s pattern, MagCache its ratios, TaylorSeer its fixed schedule.
- `denoiser`: the transformer alone (`--architecture` flux2-dev, qwen-image, wan-14b), built on
  the host and quantized onto the GPU, `--steps` calls per image with each setting's schedule.

    PYTHONPATH=src:tests python tools/bench/step_cache_gpu_bench.py demo --out OUT
    PYTHONPATH=src:tests python tools/bench/step_cache_gpu_bench.py pipeline --schedules OUT/schedules.json --out OUT
    PYTHONPATH=src:tests python tools/bench/step_cache_gpu_bench.py denoiser --architecture qwen-image --out OUT
    PYTHONPATH=src:tests python tools/bench/step_cache_gpu_bench.py serve --schedules OUT/schedules.json --out OUT \
        --serve-args "--model flux-dev-random --quantize fp8 ..."
    PYTHONPATH=src:tests python tools/bench/step_cache_gpu_bench.py client --out OUT --settings SETTING
"""

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK

from loraswap.bench.common import environment, write_random_adapters
from loraswap.engine.config import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest
from loraswap.engine.step_cache import Skips, StepCache, parse_step_cache
from loraswap.engine.step_cache.attach import block_lists

SETTINGS = ("first-block:threshold=0.05,first-block:threshold=0.08,first-block:threshold=0.12,"
            "first-block:threshold=0.2,taylorseer:interval=2,taylorseer:interval=3,taylorseer:interval=4,"
            "magcache:threshold=0.06,magcache:threshold=0.1,magcache:threshold=0.2")
ALL_METHODS = ["first-block", "taylorseer", "magcache"]
PROMPTS = ["a red circle on the left on white", "a blue square in the center on black",
           "a big green triangle on the right on gray", "a small yellow star in the center on white",
           "a purple circle on the right on black", "an orange square on the left on gray"]

# First-Block Cache's decisions: recorded (`demo`) or forced (`pipeline`, `denoiser`), per setting
RECORDED: dict[str, list[list[bool]]] = collections.defaultdict(list)
FORCED: dict[str, list[bool]] = {}
_attach = StepCache._attach


def _attach_recording_or_forced(self, denoiser, setting, steps, skips, record_ratios):
    _attach(self, denoiser, setting, steps, skips, record_ratios)
    if setting is None or setting.method != "first-block":
        return
    hook = block_lists(denoiser)[0][1][0]._diffusers_hook.get_hook(_FBC_LEADER_BLOCK_HOOK)
    if str(setting) in FORCED:
        decisions = iter(FORCED[str(setting)])
        hook._should_compute_remaining_blocks = lambda residual: next(decisions, True)
        return
    decide, pattern = hook._should_compute_remaining_blocks, []
    RECORDED[str(setting)].append(pattern)

    def recorded(residual):
        pattern.append(decide(residual))
        return pattern[-1]
    hook._should_compute_remaining_blocks = recorded


StepCache._attach = _attach_recording_or_forced


def split_settings(text: str) -> list[str]:
    """`a:k=v,k=v,b:k=v` is ambiguous; settings are separated by `;` or by a method name."""
    out, current = [], []
    for part in text.split(","):
        if ":" in part or part.strip() in ALL_METHODS:
            if current:
                out.append(",".join(current))
            current = [part]
        else:
            current.append(part)
    return [str(parse_step_cache(s)) for s in out + ([",".join(current)] if current else [])]


# ---------------------------------------------------------------- demo
def demo(args) -> dict:
    from loraswap.engine.startup import compile as compile_module
    from loraswap.models.families import demo_flux

    config = dict(model="demo-flux", adapters=demo_flux.ADAPTERS, step_cache_allow=ALL_METHODS,
                  compile=torch.cuda.is_available())
    engine = Engine(EngineConfig(**config))
    adapters = [None, "outline", "night", "pastel", "big"]
    requests = [(p, a) for a in adapters for p in PROMPTS]
    order = np.random.default_rng(0).permutation(len(requests))  # adapters interleaved, swapped per request

    def images(cache: str) -> dict:
        out = {}
        for i in order:
            p, a = requests[i]
            r = engine.generate(GenerateRequest(prompt=p, seed=7, loras=[(a, 1.0)] if a else [], step_cache=cache))
            out[i] = (np.asarray(r.image).astype(np.int16), r.steps_skipped or 0)
        return out

    off = images("off")
    result = {"env": environment(), "settings": {}, "ratios": engine.step_cache.ratios}
    for setting in split_settings(args.settings):
        got = images(setting)
        diffs = [np.abs(got[i][0] - off[i][0]) for i in got]
        result["settings"][setting] = {
            "skipped": [got[i][1] for i in sorted(got)],
            "median_skipped": statistics.median(g[1] for g in got.values()),
            "mean_px": float(np.mean([d.mean() for d in diffs])), "max_px": int(max(d.max() for d in diffs))}
        patterns = RECORDED.get(setting)
        if patterns:
            common = collections.Counter(tuple(p) for p in patterns).most_common(1)[0][0]
            result["settings"][setting]["pattern"] = list(common)
        print(setting, {k: v for k, v in result["settings"][setting].items() if k not in ("skipped", "pattern")},
              flush=True)
    again = images("off")
    result["off_bitwise_after_cached"] = all(np.array_equal(again[i][0], off[i][0]) for i in off)
    result["recompiles"] = engine.recompiles
    (args.out / "schedules.json").write_text(json.dumps(result, indent=2))
    # the cache off against diffusers' own regional compile (the whole block call compiled; no
    # MagCache calibration, whose hooks that compile would trace into the blocks)
    del engine
    torch._dynamo.reset()
    compile_module.compile_blocks = lambda denoiser, **options: denoiser.compile_repeated_blocks(
        fullgraph=True, **options)
    engine = Engine(EngineConfig(**(config | {"step_cache_allow": []})))
    theirs = images("off")
    result["off_bitwise_vs_compile_repeated_blocks"] = all(np.array_equal(theirs[i][0], off[i][0]) for i in off)
    result["off_max_px_vs_compile_repeated_blocks"] = int(max(np.abs(theirs[i][0] - off[i][0]).max() for i in off))
    print({k: v for k, v in result.items() if k.startswith(("off", "recompiles"))}, flush=True)
    return result


def leak(args) -> dict:
    """The cache off before and after cached requests with other adapters, against a control
    (the cache off twice in a row: the GPU's own run-to-run difference), and against
    diffusers' `compile_repeated_blocks`, whose control is the same."""
    from loraswap.engine.startup import compile as compile_module
    from loraswap.models.families import demo_flux

    config = dict(model="demo-flux", adapters=demo_flux.ADAPTERS, step_cache_allow=["first-block", "taylorseer"],
                  compile=torch.cuda.is_available())

    def image(engine, cache="off", lora=None):
        loras = [(lora, 1.0)] if lora else []
        return np.asarray(engine.generate(GenerateRequest(prompt=PROMPTS[0], seed=7, loras=loras,
                                                          step_cache=cache)).image).astype(np.int16)

    ours = Engine(EngineConfig(**config))
    first, second = image(ours), image(ours)
    # each adapter: again after another adapter (the swap's own control), then after cached requests
    swaps = {}
    for adapter, other in (("outline", "night"), ("night", "pastel"), ("pastel", "big"), ("big", "outline")):
        alone = image(ours, lora=adapter)
        image(ours, lora=other)
        again = image(ours, lora=adapter)
        image(ours, "first-block:threshold=0.12", other), image(ours, "taylorseer:interval=3", adapter)
        cached = image(ours, lora=adapter)
        swaps[adapter] = {"max_px_after_other": int(np.abs(alone - again).max()),
                          "max_px_after_cached": int(np.abs(alone - cached).max())}
    image(ours, "first-block:threshold=0.12", "outline"), image(ours, "taylorseer:interval=3", "night")
    after = image(ours)
    recompiles = ours.recompiles
    del ours
    torch._dynamo.reset()
    compile_module.compile_blocks = lambda denoiser, **options: denoiser.compile_repeated_blocks(
        fullgraph=True, **options)
    theirs = Engine(EngineConfig(**(config | {"step_cache_allow": []})))
    third, fourth = image(theirs), image(theirs)
    result = {"max_px_off_twice": int(np.abs(first - second).max()),
              "max_px_off_after_cached": int(np.abs(first - after).max()),
              "max_px_theirs_twice": int(np.abs(third - fourth).max()),
              "max_px_ours_vs_theirs": int(np.abs(first - third).max()), "recompiles": recompiles,
              "adapters": swaps}
    print(result, flush=True)
    return result


# ---------------------------------------------------------------- pipeline
def use_schedules(path: Path | None) -> list[float] | None:
    if path is None or not path.exists():
        return None
    data = json.loads(path.read_text())
    for setting, row in data["settings"].items():
        if "pattern" in row:
            FORCED[setting] = row["pattern"]
    return data["ratios"]


def pipeline(args) -> dict:
    ratios = use_schedules(args.schedules)
    calibration = args.out / "ratios.json"
    calibration.write_text(json.dumps(ratios or [1.0] * args.steps))
    folder = args.out / "adapters"
    paths = write_random_adapters(args.model, [(32, "all"), (16, "attn"), (64, "all"), (8, "all")], folder)
    engine = Engine(EngineConfig(model=args.model, quantize=args.quantize, adapters=folder,
                                 step_cache_allow=ALL_METHODS, step_cache_calibration=calibration))
    denoiser = engine.denoiser
    marks = {}
    denoiser.register_forward_pre_hook(lambda *_: marks.setdefault("start", _now()) and None)  # (None: args kept)
    variants = ["off"] + split_settings(args.settings)
    rows = []
    for r in range(args.rounds):
        for k, setting in enumerate(variants[r % len(variants):] + variants[:r % len(variants)]):
            adapter = paths[(r * len(variants) + k) % len(paths)].stem  # a different one each request
            request = GenerateRequest(prompt="a photograph", seed=r, width=args.size, height=args.size,
                                      steps=args.steps, loras=[(adapter, 1.0)], step_cache=setting)
            marks.clear()

            def ended(done, total):
                if done == total:
                    marks["end"] = _now()
            with engine.lender.lease_now(request.loras) as lease:
                result = engine.generate_batch([request], lease, on_step=ended)[0]
            rows.append({"round": r, "setting": setting, "transformer_s": marks["end"] - marks["start"],
                         "generate_s": result.generate_seconds, "swap_s": result.swap_seconds,
                         "skipped": result.steps_skipped or 0})
            print(rows[-1], flush=True)
    return {"env": environment(), "model": args.model, "quantize": args.quantize, "size": args.size,
            "steps": args.steps, "rows": rows, "summary": summarize(rows), "recompiles": engine.recompiles,
            "startup_s": engine.startup_seconds}


def _now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def summarize(rows: list[dict]) -> dict:
    out = {}
    for setting in dict.fromkeys(row["setting"] for row in rows):
        mine = [row for row in rows if row["setting"] == setting]
        out[setting] = {key: statistics.median(row[key] for row in mine)
                        for key in ("transformer_s", "generate_s", "skipped")}
    base = out.get("off")
    for values in out.values():
        if base:
            values["transformer_speedup"] = base["transformer_s"] / values["transformer_s"]
            values["generate_speedup"] = base["generate_s"] / values["generate_s"]
    return out


# ---------------------------------------------------------------- denoiser
def denoiser(args) -> dict:
    from loraswap.bench.swap_setup import denoiser_inputs
    from loraswap.engine.quantize.weights import quantize_module
    from loraswap.engine.startup.compile import compile_denoiser
    from loraswap.models.architectures import build_architecture_component

    ratios = use_schedules(args.schedules)
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = build_architecture_component(args.architecture, "transformer", init_device=device,
                                         dtype=torch.bfloat16, device="cpu")
    inputs = denoiser_inputs(model, args.size, args.height or args.size, device, torch.bfloat16, frames=args.frames)
    quantize_module(model, args.quantize, device)
    model.to(device)
    compile_denoiser(model, "default")
    cache = StepCache([model], args.architecture, None, ALL_METHODS)
    cache.ratios = ratios or [1.0] * args.steps

    @torch.inference_mode()
    def image(setting: str | None) -> tuple[float, int]:
        parsed = parse_step_cache(setting) if setting else None
        skips = Skips(parsed)
        started = _now()
        with cache.attached(parsed, args.steps, skips) if parsed else _nothing():
            for _ in range(args.steps):
                model(**inputs)
                skips.step_ended()
        return _now() - started, skips.steps_skipped if parsed else 0

    variants = ["off"] + split_settings(args.settings)
    for setting in variants:
        image(None if setting == "off" else setting)  # warm: compiles once
    rows = []
    for r in range(args.rounds):
        for setting in variants[r % len(variants):] + variants[:r % len(variants)]:
            seconds, skipped = image(None if setting == "off" else setting)
            rows.append({"round": r, "setting": setting, "transformer_s": seconds, "generate_s": seconds,
                         "skipped": skipped})
            print(rows[-1], flush=True)
    return {"env": environment(), "architecture": args.architecture, "quantize": args.quantize, "size": args.size,
            "steps": args.steps, "rows": rows, "summary": summarize(rows)}


# ---------------------------------------------------------------- serve, client
def serve(args) -> dict:
    """`loraswap serve ARGS` in this process, First-Block Cache following `--schedules`."""
    import shlex
    import sys

    from loraswap.cli import app

    use_schedules(args.schedules)
    sys.argv = ["loraswap", "serve", *shlex.split(args.serve_args)]
    app(prog_name="loraswap")
    return {}


def client(args) -> dict:
    """One client, one request at a time through the server at `--url`: each setting of
    `--settings` and the cache off interleaved, a different adapter each request."""
    import httpx

    adapters = [a["id"] for a in httpx.get(args.url + "/adapters", timeout=60).json()["adapters"]]
    variants = ["off"] + split_settings(args.settings)
    rows = []
    for r in range(args.rounds):
        for k, setting in enumerate(variants[r % len(variants):] + variants[:r % len(variants)]):
            body = {"inputs": "a photograph", "parameters": {"seed": r, "width": args.size, "height": args.size,
                                                             "num_inference_steps": args.steps, "step_cache": setting}}
            started = time.perf_counter()
            answer = httpx.post(args.url + "/", json=body, headers={"lora": adapters[(r + k) % len(adapters)]},
                                timeout=600)
            answer.raise_for_status()
            seconds = time.perf_counter() - started
            rows.append({"round": r, "setting": setting, "transformer_s": seconds, "generate_s": seconds,
                         "skipped": int(answer.headers.get("x-steps-skipped", 0)),
                         "server_timing": answer.headers.get("server-timing")})
            print(rows[-1], flush=True)
    metrics = httpx.get(args.url + "/metrics", timeout=60).text
    return {"rows": rows, "summary": summarize(rows),
            "metrics": [line for line in metrics.splitlines() if "step_cache" in line or "recompiles" in line]}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["demo", "leak", "pipeline", "denoiser", "serve", "client"])
    parser.add_argument("--url", default="http://127.0.0.1:8888")
    parser.add_argument("--settings", default=SETTINGS)
    parser.add_argument("--schedules", type=Path, help="the `demo` part's schedules.json")
    parser.add_argument("--model", default="flux-dev-random")
    parser.add_argument("--architecture", default="qwen-image")
    parser.add_argument("--quantize", default="fp8")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--height", type=int)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--serve-args", default="", help="serve: loraswap serve's flags, as one string")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    parts = {"demo": demo, "leak": leak, "pipeline": pipeline, "denoiser": denoiser, "serve": serve, "client": client}
    result = parts[args.part](args)
    name = {"demo": "schedules.json", "leak": "leak.json", "pipeline": f"pipeline-{args.model}-{args.quantize}.json",
            "denoiser": f"denoiser-{args.architecture}-{args.quantize}.json", "serve": "serve.json",
            "client": "client.json"}[args.part]
    (args.out / name).write_text(json.dumps(result, indent=2))
    print(json.dumps(result.get("summary", {}), indent=1))


if __name__ == "__main__":
    main()
