"""What step caching does to `demo-flux`'s pictures, without and with each trained adapter.

    PYTHONPATH=src:tests .venv/bin/python tools/demo/demo_flux_step_cache.py [--json OUT] [--setting S]...

For each setting of `SETTINGS`, the 36 fixed prompts of `tests/support/demo_flux_scores.py`
(seeds 1000-1035, 28 steps, guidance 3.5) are drawn without an adapter and with each of
`demo_flux.DEMO_ADAPTERS`, in batches of `--batch` prompts sharing one adapter; the batches of
all five run in one seeded random order, so each request's adapter is swapped in (fused) over
another's and anything a request's cache left behind would change the next one's picture.
Against the same batches with the cache off: the steps skipped, the reader's accuracy per
attribute, each adapter's effect (`adapter_effect`) and the pixel difference. The setting
named is the one that skips the most steps while every accuracy stays within 2 points of the
cache off, or one picture's reading where that is more (36 pictures: 2.8 points), and every
adapter's effect within 10 % of its effect with the cache off. For comparison, the settings
within 2 points strictly are named too: in each condition, and over all 180 pictures.

Then:
- MagCache's ratios calibrated with each adapter applied (as the engine calibrates the base
  at start-up), the steps each calibration skips against the base's, and the pictures of a
  MagCache setting drawn with each adapter's own calibration;
- one First-Block setting drawn per request (batches of 1) against batched: a batch shares
  one decision to skip;
- the cache off and the named setting drawn again, interleaved, after all that: bitwise the
  first pictures (no state kept between requests).
"""

import argparse
import datetime
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from diffusers.hooks.mag_cache import nearest_interp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from support import shapes  # noqa: E402
from support.demo_flux_scores import PROMPTS, accuracy, adapter_effect, correct, pixel_difference, prompt  # noqa: E402

from loraswap.adapters.reference import as_refs
from loraswap.engine.config.engine import EngineConfig  # noqa: E402
from loraswap.engine.engine import Engine  # noqa: E402
from loraswap.engine.request import GenerateRequest
from loraswap.engine.step_cache import PROMPT, parse_step_cache  # noqa: E402
from loraswap.models.families import demo_flux  # noqa: E402

OFF = "off"
SETTINGS = ("first-block:threshold=0.05", "first-block:threshold=0.08", "first-block:threshold=0.12",
            "first-block:threshold=0.2", "taylorseer:interval=2,order=1", "taylorseer:interval=3,order=1",
            "taylorseer:interval=4,order=1", "taylorseer:interval=3,order=2", "magcache:threshold=0.06",
            "magcache:threshold=0.1", "magcache:threshold=0.2", "magcache:threshold=0.3")
CONDITIONS = ("base", *demo_flux.DEMO_ADAPTERS)
FIRST_SEED = 1000
STEPS = 28  # demo-flux's default, as FLUX.1-dev is run
ACCURACY_POINTS = 2.0  # the bound on any accuracy's change against the cache off, in points
EFFECT_SHARE = 0.10  # the bound on any adapter's effect's change, as a share of its effect with the cache off
# the base calibrated on other prompts too: how much the ratios move with the prompt alone
OTHER_PROMPTS = (prompt(PROMPTS[7]), prompt(PROMPTS[20]), prompt(PROMPTS[33]))
# the settings the follow-ups use when measured (else each method's best): the First-Block setting
# that skips most within bounds of the whole set, and a MagCache setting whose schedule adapters move
BATCH_OF_ONE, OWN_CALIBRATION = "first-block:threshold=0.12", "magcache:threshold=0.3"


@dataclass
class Drawn:
    image: np.ndarray
    steps_skipped: int


Pictures = dict[tuple[str, int], Drawn]  # (condition, prompt index) -> the picture drawn


def loras(condition: str) -> list[tuple[str, float]]:
    return [] if condition == "base" else [(condition, 1.0)]


def make_engine() -> Engine:
    return Engine(EngineConfig(model="demo-flux", adapters=demo_flux.ADAPTERS, compile=False, warmup=False,
                               step_cache_allow=["first-block", "taylorseer", "magcache"]))


def batches(cases: list[int], size: int, conditions=CONDITIONS) -> list[tuple[str, list[int]]]:
    return [(c, cases[i:i + size]) for c in conditions for i in range(0, len(cases), size)]


def draw(engine: Engine, plan: list[tuple[str, str, list[int]]]) -> Pictures:
    """Each (setting, condition, prompt indices) of `plan` as one batch, in the plan's order."""
    drawn = {}
    for setting, condition, indices in plan:
        requests = [GenerateRequest(prompt=prompt(PROMPTS[i]), seed=FIRST_SEED + i, loras=loras(condition),
                                    step_cache=setting) for i in indices]
        with engine.lender.lease_now(as_refs(loras(condition))) as lease:
            results = engine.generate_batch(requests, lease)
        for i, result in zip(indices, results):
            drawn[condition, i] = Drawn(np.asarray(result.image), result.steps_skipped or 0)
    return drawn


def shuffled(setting: str, groups: list[tuple[str, list[int]]], rng: random.Random) -> list[tuple[str, str, list[int]]]:
    plan = [(setting, condition, indices) for condition, indices in groups]
    rng.shuffle(plan)
    return plan


# ---------------------------------------------------------------- scores
def read_all(drawn: Pictures, cases: list[int]) -> dict[str, list[shapes.Reading]]:
    conditions = sorted({c for c, _ in drawn}, key=CONDITIONS.index)
    return {c: [shapes.read(drawn[c, i].image) for i in cases] for c in conditions}


def score(drawn: Pictures, cases: list[int], off: Pictures | None = None, off_read: dict | None = None) -> dict:
    """Per condition: steps skipped (mean), accuracy per attribute, the adapter's effect, and
    against `off` (read as `off_read`) the pixel difference and the readings changed (per
    attribute, the pictures read right with the cache off and wrong with it, or the reverse)."""
    words = [PROMPTS[i] for i in cases]
    readings = read_all(drawn, cases)
    if off is not None and off_read is None:
        off_read = read_all(off, cases)
    result = {}
    for c, read in readings.items():
        entry = {"steps_skipped": float(np.mean([drawn[c, i].steps_skipped for i in cases])),
                 "accuracy": accuracy(read, words)}
        if c != "base" and "base" in readings:
            entry["effect"] = adapter_effect(c, read, readings["base"], words)
        if off is not None:
            entry["pixel_difference"] = pixel_difference([drawn[c, i].image for i in cases],
                                                         [off[c, i].image for i in cases])
            before = correct(off_read[c], words)
            entry["readings_changed"] = {k: int(np.sum(np.array(v) != np.array(before[k])))
                                         for k, v in correct(read, words).items()}
        result[c] = entry
    return result


def judge(scores: dict, off_scores: dict, pictures: int) -> dict:
    """Each condition's changes against the cache off (accuracy in points, the effect as a share
    of its effect with the cache off), each attribute's change over all the pictures (every
    condition draws `pictures`), the worst of each, and whether they keep the bounds: every
    accuracy within 2 points or one picture's reading, whichever is more (with 36 pictures one
    is 2.8 points), and every effect within 10 %; and, for comparison, within 2 points strictly
    in each condition, and over all the pictures."""
    for condition, entry in scores.items():
        before = off_scores[condition]
        entry["accuracy_change_points"] = {k: 100 * (v - before["accuracy"][k]) for k, v in entry["accuracy"].items()}
        if "effect" in entry:
            entry["effect_change"] = entry["effect"] / before["effect"] - 1
    overall = {k: float(np.mean([e["accuracy_change_points"][k] for e in scores.values()]))
               for k in next(iter(scores.values()))["accuracy"]}
    worst_points = max(abs(p) for e in scores.values() for p in e["accuracy_change_points"].values())
    worst_effect = max((abs(e["effect_change"]) for e in scores.values() if "effect_change" in e), default=0.0)
    skipped = float(np.mean([e["steps_skipped"] for e in scores.values()]))
    kept = skipped > 0 and worst_effect <= EFFECT_SHARE
    return {"steps_skipped": skipped, "worst_accuracy_change_points": worst_points,
            "accuracy_change_points_all_pictures": overall, "worst_effect_change": worst_effect,
            "readings_changed": sum(n for e in scores.values() for n in e["readings_changed"].values()),
            "pixel_difference": {"mean": float(np.mean([e["pixel_difference"]["mean"] for e in scores.values()])),
                                 "max": max(e["pixel_difference"]["max"] for e in scores.values())},
            "within_bounds": kept and worst_points <= max(ACCURACY_POINTS, 100 / pictures) + 1e-9,
            "within_2_points_each_condition": kept and worst_points <= ACCURACY_POINTS + 1e-9,
            "within_2_points_all_pictures": kept and max(map(abs, overall.values())) <= ACCURACY_POINTS + 1e-9,
            "conditions": scores}


def best(settings: dict, method: str | None = None, bounds: str = "within_bounds") -> str | None:
    """The setting (of `method`, or any) that skips steps and keeps the bounds (`judge`; or
    another of its readings), skipping the most."""
    kept = [s for s, r in settings.items() if r[bounds] and (method is None or s.startswith(method))]
    return max(kept, key=lambda s: settings[s]["steps_skipped"], default=None)


def pick(settings: dict, method: str) -> str | None:
    """The method's best setting, else its first measured (None: the method was not measured)."""
    return best(settings, method) or next((s for s in settings if s.startswith(method)), None)


# ---------------------------------------------------------------- MagCache's calibration with adapters
def measure_ratios(engine: Engine, adapters: list[tuple[str, float]], text: str = PROMPT) -> list[float]:
    """MagCache's ratios measured as the engine measures the base's at start-up (one image of
    `text`, seed 0), with `adapters` applied."""
    return engine.measure_magcache_ratios(GenerateRequest(prompt=text, seed=0, loras=adapters))


def magcache_skips(ratios: list[float], setting: str, steps: int = STEPS) -> list[int]:
    """The steps MagCache skips with these ratios: its decision (diffusers' `MagCacheHeadHook`)
    follows from the ratios and the step alone, whatever the picture."""
    options = parse_step_cache(setting)
    scales = nearest_interp(torch.tensor(ratios), steps).tolist() if len(ratios) != steps else ratios
    retention = int(options["retention"] * steps + 0.5)
    product, run, error, skipped = 1.0, 0, 0.0, []
    for step in range(retention, steps):
        product, run = product * scales[step], run + 1
        error += abs(1.0 - product)
        if step > 0 and error <= options["threshold"] and run <= options["max_skip"]:
            skipped.append(step)
        else:
            product, run, error = 1.0, 0, 0.0
    return skipped


def calibration(engine: Engine, settings: list[str], drawn: dict[str, Pictures]) -> dict:
    """Ratios with each adapter and for the base on other prompts; how far each is from the
    base's (largest, and mean over the steps MagCache may skip); the steps each makes skip; and
    whether the steps the base's make skip are as many as the engine skipped."""
    ratios = {c: measure_ratios(engine, loras(c)) for c in CONDITIONS}
    ratios |= {f"base, {text!r}": measure_ratios(engine, [], text) for text in OTHER_PROMPTS}
    base = np.array(ratios["base"])
    after = int(parse_step_cache(settings[0])["retention"] * STEPS + 0.5)
    skipped = {s: {name: magcache_skips(r, s) for name, r in ratios.items()} for s in settings}
    return {"start_up_ratios_equal_base": ratios["base"] == engine.step_cache.ratios, "ratios": ratios,
            "largest_change": {n: float(np.max(np.abs(np.array(r) - base))) for n, r in ratios.items()},
            "mean_change_after_retention": {n: float(np.mean(np.abs(np.array(r) - base)[after:]))
                                            for n, r in ratios.items()},
            "skipped_steps": skipped,
            "engine_skipped_as_simulated": all(d.steps_skipped == len(skipped[s]["base"])
                                               for s in settings for (c, _), d in drawn[s].items() if c == "base")}


def own_calibration(engine: Engine, setting: str, found: dict, cases: list[int], size: int, off: Pictures,
                    base: Pictures, off_scores: dict) -> dict:
    """`setting` drawn with each adapter whose calibration skips other steps than the base's,
    calibrated on that adapter (the base's pictures as drawn with the base's calibration)."""
    skipped = found["skipped_steps"][setting]
    differ = [c for c in demo_flux.DEMO_ADAPTERS if skipped[c] != skipped["base"]]
    result = {}
    start_up = engine.step_cache.ratios
    try:
        for adapter in differ:
            engine.step_cache.ratios = found["ratios"][adapter]
            drawn = draw(engine, [(setting, c, i) for c, i in batches(cases, size, [adapter])])
            drawn |= {k: v for k, v in base.items() if k[0] == "base"}
            scores = score(drawn, cases, off)
            result[adapter] = judge({adapter: scores[adapter]}, off_scores, len(cases))["conditions"][adapter]
    finally:
        engine.step_cache.ratios = start_up
    return {"setting": setting, "adapters_whose_schedule_differs": differ, "drawn": result}


# ---------------------------------------------------------------- a batch's shared decision; no state kept
def batch_of_one(engine: Engine, setting: str, cases: list[int], batched: Pictures, off: Pictures,
                 rng: random.Random) -> dict:
    """`setting` and the cache off drawn one request at a time, against the batched pictures."""
    conditions = ("base", "big")
    singles = [(c, [i]) for c in conditions for i in cases]
    alone = draw(engine, shuffled(setting, singles, rng))
    alone_off = draw(engine, shuffled(OFF, singles, rng))
    keys = list(alone)

    def images(pictures):
        return [pictures[k].image for k in keys]

    return {"setting": setting, "conditions": conditions, "prompts": len(cases),
            "steps_skipped": {"per_request": [alone[k].steps_skipped for k in keys],
                              "batched": [batched[k].steps_skipped for k in keys]},
            "pixel_difference": {"per_request_vs_batched": pixel_difference(images(alone), images(batched)),
                                 "off_per_request_vs_off_batched": pixel_difference(images(alone_off), images(off)),
                                 "per_request_vs_its_off": pixel_difference(images(alone), images(alone_off)),
                                 "batched_vs_its_off": pixel_difference(images(batched), images(off))},
            "scores": {"per_request": score(alone, cases, alone_off),
                       "batched": score({k: batched[k] for k in keys}, cases, off)}}


def no_state_kept(engine: Engine, named: str, others: list[str], rng: random.Random) -> dict:
    """Three probes (the cache off and `named`, on the base, and `named` with `night`), each drawn,
    then drawn again after requests of every other method with other adapters, all in one random
    order: is each probe bitwise its first picture?"""
    pair = [0, 19]  # two prompts: a small batch
    probes = [(OFF, "base", pair), (named, "base", pair), (named, "night", pair)]
    first = {str(probe): draw(engine, [probe]) for probe in probes}
    plan = probes + [(setting, adapter, pair) for setting in others for adapter in ("outline", "pastel")]
    rng.shuffle(plan)
    same = {str(probe): True for probe in probes}
    for step in plan:
        again = draw(engine, [step])
        if str(step) in first:
            same[str(step)] &= all(np.array_equal(again[k].image, first[str(step)][k].image) for k in again)
    return {"probes": [f"{s} with {c}" for s, c, _ in probes], "requests_between": others, "batches": len(plan),
            "bitwise_the_first": [same[str(probe)] for probe in probes]}


# ---------------------------------------------------------------- the tables
def _yes(value: bool) -> str:
    return "yes" if value else "no"


def table(results: dict) -> str:
    """The settings against the cache off, then the named setting per condition."""
    lines = ["| setting | steps skipped of 28 | worst accuracy change in one condition | worst attribute over all "
             "pictures | readings changed | worst adapter effect change | pixel difference mean / max | "
             "within bounds | strictly 2 points: each condition, all pictures |", "|---" * 9 + "|"]
    for setting, r in results["settings"].items():
        overall = max(r["accuracy_change_points_all_pictures"].values(), key=abs)
        lines.append(f"| `{setting}` | {r['steps_skipped']:.1f} | {r['worst_accuracy_change_points']:.1f} pts | "
                     f"{overall:+.1f} pts | {r['readings_changed']} | {100 * r['worst_effect_change']:.1f} % | "
                     f"{r['pixel_difference']['mean']:.2f} / {r['pixel_difference']['max']} | "
                     f"{_yes(r['within_bounds'])} | {_yes(r['within_2_points_each_condition'])}, "
                     f"{_yes(r['within_2_points_all_pictures'])} |")
    named = results["named"]
    if named is None:
        return "\n".join(lines + ["", "no setting that skips a step keeps the bounds"])
    lines += ["", f"`{named}`, per condition (accuracy with the cache off -> on; effect off -> on):", "",
              "| | skipped | colour | shape | place | ground | texture | effect | pixel mean / max |",
              "|---|---|---|---|---|---|---|---|---|"]
    for condition, entry in results["settings"][named]["conditions"].items():
        off = results["off"][condition]
        hits = " | ".join(f"{100 * off['accuracy'][k]:.0f} -> {100 * v:.0f}" for k, v in entry["accuracy"].items())
        effect = f"{off['effect']:.2f} -> {entry['effect']:.2f}" if "effect" in entry else "-"
        pixels = entry["pixel_difference"]
        lines.append(f"| {condition} | {entry['steps_skipped']:.1f} | {hits} | {effect} | "
                     f"{pixels['mean']:.2f} / {pixels['max']} |")
    return "\n".join(lines)


def calibration_table(found: dict) -> str:
    """The steps each calibration makes MagCache skip."""
    settings = found["skipped_steps"]
    lines = ["| calibrated on | ratio change: largest, mean after retention | "
             + " | ".join(f"`{s}` skips" for s in settings) + " |", "|---|---|" + "---|" * len(settings)]
    for name, change in found["largest_change"].items():
        skips = " | ".join(",".join(map(str, by_name[name])) for by_name in settings.values())
        lines.append(f"| {name} | {change:.3f}, {found['mean_change_after_retention'][name]:.3f} | {skips} |")
    return "\n".join(lines)


def own_calibration_table(results: dict) -> str:
    """An adapter's pictures with the base's calibration against its own."""
    own = results["own_calibration"]
    lines = [f"`{own['setting']}` with the base's calibration -> the adapter's own:", "",
             "| adapter | steps skipped | pixel difference mean / max | effect change |", "|---|---|---|---|"]
    for adapter, entry in own["drawn"].items():
        base = results["settings"][own["setting"]]["conditions"][adapter]
        lines.append(f"| {adapter} | {base['steps_skipped']:.1f} -> {entry['steps_skipped']:.1f} | "
                     f"{base['pixel_difference']['mean']:.3f} / {base['pixel_difference']['max']} -> "
                     f"{entry['pixel_difference']['mean']:.3f} / {entry['pixel_difference']['max']} | "
                     f"{100 * base['effect_change']:.1f} % -> {100 * entry['effect_change']:.1f} % |")
    return "\n".join(lines)


# ---------------------------------------------------------------- the run
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", action="append", help="a setting to measure (default: SETTINGS)")
    parser.add_argument("--batch", type=int, default=18, help="prompts per batch")
    parser.add_argument("--every", type=int, default=1, help="every n-th prompt only (a quick look)")
    parser.add_argument("--order-seed", type=int, default=0, help="seeds the order the batches run in")
    parser.add_argument("--json", type=Path, help="write the results here too")
    return parser.parse_args()


def measure_settings(engine: Engine, settings: list[str], groups, cases, rng, results: dict) -> dict[str, Pictures]:
    """Every setting drawn in its own random order and judged against the cache off."""
    off = draw(engine, shuffled(OFF, groups, rng))
    results["off"], off_read = score(off, cases), read_all(off, cases)
    drawn = {OFF: off}
    for setting in settings:
        started = time.perf_counter()
        drawn[setting] = draw(engine, shuffled(setting, groups, rng))
        scores = score(drawn[setting], cases, off, off_read)
        judged = results["settings"][setting] = judge(scores, results["off"], len(cases))
        judged["seconds"] = time.perf_counter() - started
        print(f"{setting}: {judged['steps_skipped']:.1f} skipped, within bounds {judged['within_bounds']} "
              f"(strictly 2 points: each condition {judged['within_2_points_each_condition']}, all pictures "
              f"{judged['within_2_points_all_pictures']}), {judged['seconds']:.0f} s", flush=True)
    return drawn


def follow_ups(engine: Engine, drawn: dict[str, Pictures], cases, args, rng, results: dict) -> None:
    """Calibration with adapters, per request against batched, and no state kept."""
    settings = results["settings"]
    picked = {method: pick(settings, method) for method in ("first-block", "taylorseer", "magcache")}
    picked |= {s.split(":")[0]: s for s in (BATCH_OF_ONE, OWN_CALIBRATION) if s in settings}
    if picked["magcache"]:
        found = results["calibration"] = calibration(engine, [s for s in settings if s.startswith("magcache")],
                                                     drawn)
        results["own_calibration"] = own_calibration(engine, picked["magcache"], found, cases, args.batch,
                                                     drawn[OFF], drawn[picked["magcache"]], results["off"])
    if picked["first-block"]:
        results["batch_of_one"] = batch_of_one(engine, picked["first-block"], cases[::6], drawn[picked["first-block"]],
                                               drawn[OFF], rng)
    named = results["named"] or next(iter(settings))
    others = [s for s in picked.values() if s is not None and s != named]
    results["no_state_kept"] = no_state_kept(engine, named, others, rng)


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    engine = make_engine()
    cases = list(range(len(PROMPTS)))[::args.every]
    groups = batches(cases, args.batch)
    rng = random.Random(args.order_seed)
    results = {"command": "PYTHONPATH=src:tests .venv/bin/python " + " ".join(sys.argv),
               "date": datetime.date.today().isoformat(), "threads": torch.get_num_threads(), "cores": os.cpu_count(),
               "prompts": len(cases), "batch": args.batch, "steps": STEPS, "settings": {}}
    drawn = measure_settings(engine, args.setting or list(SETTINGS), groups, cases, rng, results)
    results["named"] = best(results["settings"])
    results["named_within_2_points_each_condition"] = best(results["settings"], bounds="within_2_points_each_condition")
    results["named_within_2_points_all_pictures"] = best(results["settings"], bounds="within_2_points_all_pictures")
    follow_ups(engine, drawn, cases, args, rng, results)
    results["seconds"], results["cpu_seconds"] = time.perf_counter() - started, time.process_time()
    print(table(results))
    if "calibration" in results:
        print("\nMagCache's calibration with each adapter:\n\n" + calibration_table(results["calibration"]))
        print("\n" + own_calibration_table(results))
    print(json.dumps({k: results[k] for k in ("named", "named_within_2_points_each_condition",
                                              "named_within_2_points_all_pictures", "own_calibration",
                                              "batch_of_one", "no_state_kept", "seconds", "cpu_seconds")
                      if k in results}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
