"""A model replica SIGKILLed mid-request under `loraswap serve --ray`: what the clients see.

    PYTHONPATH=src python scripts/ray_kill_check.py --model sdxl-random --out kill.json

Starts `loraswap serve --ray --replicas N` on the model (random adapters of real size),
keeps one client sending requests back to back, sends one more request, kills the replica
serving it with SIGKILL while it generates, then waits until a new replica serves again.
Writes every request's send time, latency and status (relative to the kill), the killed
request's answer, how long until the first image after the kill and until Serve reports
the new replica, and the new replica's placement from `/replicas`.
"""

import argparse
import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from loraswap.bench.serve import RAY_ENV, prepare_adapters, start_server, stop_server


def post(url: str, adapter: str, steps: int, seed: int) -> tuple[int, str]:
    try:
        response = httpx.post(url + "/", json={"inputs": f"image {seed}",
                                               "parameters": {"num_inference_steps": steps, "seed": seed}},
                              headers={"lora": adapter}, timeout=900)
        return response.status_code, "" if response.status_code == 200 else response.text[:300]
    except httpx.HTTPError as e:
        return 0, f"{type(e).__name__}: {e}"


def live_replicas(url: str) -> list[dict]:
    return [r for r in httpx.get(url + "/replicas", timeout=10).json()["replicas"] if r["alive"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="sdxl-random")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/loraswap-kill-check"))
    parser.add_argument("--out", type=Path, default=Path("ray-kill.json"))
    parser.add_argument("--after", type=int, default=5, help="images to serve after the first one after the kill")
    args = parser.parse_args()
    os.environ.update(RAY_ENV)
    ids = prepare_adapters(args.model.removesuffix("-random"), args.workdir / "adapters", 16)
    proc, url, log, ready_s = start_server(args.model, args.workdir / "adapters", "ray", args.workdir / "server.log",
                                           ["--replicas", str(args.replicas)])
    records, lock, stop = [], threading.Lock(), threading.Event()
    try:
        post(url, ids[0], args.steps, 0)  # warm
        before = live_replicas(url)

        def client(name: str, count: int, start: int, steps: int):
            for i in range(start, start + count):
                if stop.is_set():
                    return
                sent = time.time()
                status, error = post(url, ids[i % len(ids)], steps, i)
                with lock:
                    records.append({"client": name, "sent": sent, "latency_s": time.time() - sent,
                                    "status": status, "error": error})
                if status != 200:
                    time.sleep(0.5)  # as a client would, before trying again

        steady = threading.Thread(target=client, args=("steady", 10_000, 100, args.steps))
        steady.start()
        time.sleep(3.0)
        killed = threading.Thread(target=client, args=("killed", 1, 1, 2 * args.steps))  # still running at the kill
        killed.start()
        time.sleep(1.0)  # it is generating (or next in the worker's queue) on the replica
        victim = live_replicas(url)[0]
        kill_at = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        killed.join(900)
        deadline = time.time() + 600
        new = []
        while time.time() < deadline and not new:
            new = [r for r in live_replicas(url) if r["replica"] not in {b["replica"] for b in before}]
            time.sleep(0.5)
        replaced_at = time.time()
        while time.time() < deadline:
            with lock:
                after = [r for r in records if r["sent"] > kill_at and r["status"] == 200]
            if len(after) >= args.after + 1:
                break
            time.sleep(0.5)
    finally:
        stop.set()
        stop_server(proc)
        log.close()
    for record in records:
        record["sent"] -= kill_at
    served_after = sorted(r["sent"] + r["latency_s"] for r in records if r["sent"] + r["latency_s"] > 0
                          and r["status"] == 200)
    result = {"model": args.model, "replicas": args.replicas, "steps": args.steps, "ready_s": ready_s,
              "killed_pid": victim["pid"], "killed_request": next(r for r in records if r["client"] == "killed"),
              "statuses": dict(Counter(r["status"] for r in records)),
              "first_image_after_kill_s": served_after[0] if served_after else None,
              "new_replica_reported_s": replaced_at - kill_at if new else None, "new_replica": new[:1],
              "records": records}
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "records"}, indent=1))


if __name__ == "__main__":
    main()
