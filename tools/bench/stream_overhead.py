"""What streaming costs an image: the demo model served on CPU by `loraswap serve`, in a process
of its own on loopback (the client's work is not the server's); each variant's request timed by
the client (until the image is in hand) and by the server (the worker's swap and generation:
`x-compute-time`, or the `image` event's `compute_time`), in interleaved rounds (each round's
order rotated), medians; each against the plain request, as a ratio of medians and as the median of
each round's ratio to that round's plain request (`paired_wall_vs_plain`: drift cancels).

Variants: `plain` (POST /, Accept image/png) and `plain-again` (the same: how far apart two
runs of one request come, the measure's noise); `stream` (events, no previews); `sketch-every-4`
and `sketch-every-1` (the linear map's previews every 4 steps, every step); `full-every-4` (the
VAE's previews every 4 steps); `openai-partial-3` (OpenAI `stream: true`, `partial_images: 3`,
against OpenAI's plain answer, `openai-plain`).

    PYTHONPATH=src python tools/bench/stream_overhead.py [OUT.json] [--rounds 15] [--steps 20]
"""

import argparse
import base64
import json
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import torch

PROMPT = "a red circle at the left on white"
HF_VARIANTS = {"plain": None, "plain-again": None, "stream": {}, "sketch-every-4": {"preview_every": 4},
               "sketch-every-1": {"preview_every": 1}, "full-every-4": {"preview_every": 4, "preview_full": True}}


def _hf(client: httpx.Client, steps: int, seed: int, stream: dict | None) -> tuple[float, float]:
    """(seconds until the image is in hand, the server's compute seconds) of one HF request."""
    parameters = {"seed": seed, "num_inference_steps": steps, **(stream or {})}
    started = time.perf_counter()
    if stream is None:
        response = client.post("/", json={"inputs": PROMPT, "parameters": parameters}, headers={"accept": "image/png"})
        response.raise_for_status()
        return time.perf_counter() - started, float(response.headers["x-compute-time"])
    with client.stream("POST", "/", json={"inputs": PROMPT, "parameters": parameters},
                       headers={"accept": "text/event-stream, image/png"}) as response:
        final = None
        for line in response.iter_lines():
            if line.startswith("data: {\"image\""):
                final = json.loads(line.removeprefix("data: "))
        assert final is not None, "no image event"
        base64.b64decode(final["image"])
    return time.perf_counter() - started, final["compute_time"]


def _openai(client: httpx.Client, steps: int, seed: int, partial_images: int | None) -> tuple[float, float]:
    """(seconds until the image is in hand, nan: the answer gives no compute time) of one OpenAI request."""
    body = {"prompt": PROMPT, "seed": seed, "num_inference_steps": steps}
    started = time.perf_counter()
    if partial_images is None:
        client.post("/v1/images/generations", json=body).raise_for_status()
    else:
        with client.stream("POST", "/v1/images/generations",
                           json={**body, "stream": True, "partial_images": partial_images}) as response:
            assert any("image_generation.completed" in line for line in response.iter_lines())
    return time.perf_counter() - started, float("nan")


def _variants(steps: int) -> dict:
    runs = {name: (lambda c, s, stream=stream: _hf(c, steps, s, stream)) for name, stream in HF_VARIANTS.items()}
    runs["openai-plain"] = lambda c, s: _openai(c, steps, s, None)
    runs["openai-partial-3"] = lambda c, s: _openai(c, steps, s, 3)
    return runs


def _serve(folder: str) -> tuple[subprocess.Popen, str]:
    """`loraswap serve` of the demo model on CPU, on a free loopback port, its files in `folder`."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "loraswap", "serve", "--model", "demo", "--device", "cpu",
                               "--no-compile", "--host", "127.0.0.1", "--port", str(port), "--state-dir", folder,
                               "--download-dir", folder], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return server, f"http://127.0.0.1:{port}"


def _until_ready(client: httpx.Client, server: subprocess.Popen) -> None:
    while True:
        assert server.poll() is None, "the server exited"
        try:
            if client.get("/ready").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def main(out: str | None, rounds: int, steps: int, warm_rounds: int = 3) -> dict:
    runs = _variants(steps)
    names = list(runs)
    wall = {name: [] for name in names}
    compute = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as folder:
        server, url = _serve(folder)
        try:
            _rounds(url, server, runs, wall, compute, warm_rounds + rounds, warm_rounds)
        finally:
            server.terminate()
            server.wait(30)
    report = _report(wall, compute, rounds, steps)
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    return report


def _rounds(url: str, server: subprocess.Popen, runs: dict, wall: dict, compute: dict, count: int, warm: int) -> None:
    """`count` rounds of every variant, each round's order rotated; the first `warm` not kept."""
    names = list(runs)
    with httpx.Client(base_url=url, timeout=120) as client:
        _until_ready(client, server)
        for round_ in range(count):
            order = names[round_ % len(names):] + names[:round_ % len(names)]  # drift hits each alike
            for name in order:
                seconds, computed = runs[name](client, round_)
                if round_ >= warm:
                    wall[name].append(seconds)
                    compute[name].append(computed)


def _report(wall: dict, compute: dict, rounds: int, steps: int) -> dict:
    def median_ms(values):
        finite = [v for v in values if v == v]
        return round(statistics.median(finite) * 1e3, 2) if finite else None

    rows = {}
    for name in wall:
        baseline = "openai-plain" if name.startswith("openai") else "plain"
        # each round's ratio to its own round's plain request (run beside it): drift cancels
        paired = [v / b for v, b in zip(wall[name], wall[baseline])]
        rows[name] = {"wall_ms": median_ms(wall[name]), "compute_ms": median_ms(compute[name]),
                      "wall_vs_plain": round(statistics.median(wall[name]) / statistics.median(wall[baseline]), 4),
                      "paired_wall_vs_plain": round(statistics.median(paired), 4)}
        if rows[name]["compute_ms"] is not None:
            rows[name]["compute_vs_plain"] = round(rows[name]["compute_ms"] / median_ms(compute[baseline]), 4)
        print(name, rows[name], flush=True)
    return {"model": "demo", "device": "cpu", "cpu": platform.processor() or platform.machine(),
            "cores": torch.get_num_threads(), "torch": torch.__version__, "steps": steps, "rounds": rounds,
            "variants": rows, "samples_ms": {n: [round(v * 1e3, 2) for v in wall[n]] for n in wall}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    arguments = parser.parse_args()
    main(arguments.out, arguments.rounds, arguments.steps)
