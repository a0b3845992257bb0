"""A model replica SIGKILLed mid-request under `loraswap serve --ray`: what the clients see.

    PYTHONPATH=src python tools/bench/ray_kill_check.py --model sdxl-random --out kill.json

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


class Clients:
    """Clients sending requests back to back, each request's send time, latency and status kept."""

    def __init__(self, url: str, ids: list[str]):
        self.url, self.ids = url, ids
        self.records, self.lock, self.stop, self.threads = [], threading.Lock(), threading.Event(), []

    def start(self, name: str, count: int, first_seed: int, steps: int) -> threading.Thread:
        thread = threading.Thread(target=self._send, args=(name, count, first_seed, steps))
        thread.start()
        self.threads.append(thread)
        return thread

    def _send(self, name: str, count: int, first_seed: int, steps: int) -> None:
        for seed in range(first_seed, first_seed + count):
            if self.stop.is_set():
                return
            sent = time.time()
            status, error = post(self.url, self.ids[seed % len(self.ids)], steps, seed)
            with self.lock:
                self.records.append({"client": name, "sent": sent, "latency_s": time.time() - sent,
                                     "status": status, "error": error})
            if status != 200:
                time.sleep(0.5)  # as a client would, before trying again

    def served_since(self, moment: float) -> int:
        with self.lock:
            return sum(r["sent"] > moment and r["status"] == 200 for r in self.records)

    def finish(self) -> list[dict]:
        self.stop.set()
        for thread in self.threads:
            thread.join(900)
        return self.records


def kill_mid_request(url: str, clients: Clients, steps: int) -> dict:
    """Send a long request (twice the steps: still generating at the kill), then SIGKILL the
    replica holding its adapter; wait until it is answered."""
    killed = clients.start("killed", 1, 1, 2 * steps)
    time.sleep(1.0)  # it is generating (or next in the worker's queue) on the replica
    live = live_replicas(url)
    victim = next((r for r in live if clients.ids[1] in r["held"]), live[0])
    kill_at = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    killed.join(900)
    return {"pid": victim["pid"], "replica": victim["replica"], "at": kill_at}


def wait_for_replacement(url: str, before: list[dict], clients: Clients, kill_at: float, images: int) -> tuple:
    """The new replica (and when /replicas listed it), once `images` requests sent after the kill
    were served; at most 10 minutes."""
    deadline, known, new = time.time() + 600, {r["replica"] for r in before}, []
    while time.time() < deadline and not new:
        new = [r for r in live_replicas(url) if r["replica"] not in known]
        time.sleep(0.5)
    listed_at = time.time()
    while time.time() < deadline and clients.served_since(kill_at) < images:
        time.sleep(0.5)
    return new[:1], listed_at - kill_at if new else None


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
    clients = Clients(url, ids)
    try:
        post(url, ids[0], args.steps, 0)  # warm
        before = live_replicas(url)
        clients.start("steady", 10_000, 100, args.steps)
        time.sleep(3.0)
        victim = kill_mid_request(url, clients, args.steps)
        new, listed_s = wait_for_replacement(url, before, clients, victim["at"], args.after + 1)
    finally:
        records = clients.finish()
        stop_server(proc)
        log.close()
    write_report(args, ready_s, victim, records, new, listed_s)


def write_report(args, ready_s: float, victim: dict, records: list[dict], new: list[dict], listed_s) -> None:
    for record in records:
        record["sent"] -= victim["at"]
    done_after = sorted(r["sent"] + r["latency_s"] for r in records if r["status"] == 200
                        and r["sent"] + r["latency_s"] > 0)
    result = {"model": args.model, "replicas": args.replicas, "steps": args.steps, "ready_s": ready_s,
              "killed_pid": victim["pid"], "killed_replica": victim["replica"],
              "killed_request": next((r for r in records if r["client"] == "killed"), None),
              "statuses": dict(Counter(r["status"] for r in records)),
              "first_image_after_kill_s": done_after[0] if done_after else None,
              "new_replica_reported_s": listed_s, "new_replica": new, "records": records}
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "records"}, indent=1))


if __name__ == "__main__":
    main()
