"""One image split over processes (`--ulysses-degree`, `--cfg-parallel`; gloo on the CPU): the
same images as one process with an adapter swapped per request, blends included; a swap
refused on every rank; sizes that do not split refused; a rank failing alone or killed ends
its server, once the requests it held are answered 503, a killed server takes its ranks with
it, and it starts again."""

import io
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image
from safetensors.torch import save_file
from support.servers import ServerProcess, free_port
from support.web import Web, body

from loraswap.adapters.random import make_random_adapter
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.parallel.ranked import RankedEngine
from loraswap.engine.request import GenerateRequest
from loraswap.models import lora_components

pytestmark = pytest.mark.slow  # two servers, three processes

PARAMS = {"num_inference_steps": 2, "width": 64, "height": 64}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cp-adapters")
    components = lora_components("tiny-flux")[1]
    for name, seed, kind in (("a", 1, "lora"), ("b", 2, "lora"), ("broken", 3, "lora"), ("k", 4, "lokr")):
        state_dict, metadata = make_random_adapter(components, 4, "all", "kohya", dtype=torch.float32, seed=seed,
                                                   kind=kind)
        if name == "broken":
            state_dict[next(k for k in state_dict if k.endswith("lora_up.weight"))][0, 0] = float("inf")
        save_file(state_dict, str(folder / f"{name}.safetensors"), metadata=metadata)
    return folder


def _image(url: str, lora: str, seed: int, **params) -> np.ndarray:
    response = httpx.post(url + "/", json={"inputs": "a red circle", "parameters": {**PARAMS, **params, "seed": seed}},
                          headers={"accept": "image/png", **({"lora": lora} if lora else {})}, timeout=120)
    assert response.status_code == 200, response.text
    return np.asarray(Image.open(io.BytesIO(response.content)).convert("RGB")).astype(int)


def _wait_for_log(server: ServerProcess, line: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while line not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)


def _failing_env() -> dict:
    """The server's processes with `support/fail_on_rank_1` (rank 1 fails, or holds, on cue)."""
    failing = str(Path(__file__).parents[1] / "support" / "fail_on_rank_1")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [failing, os.environ.get("PYTHONPATH")]))}


LOST = "one of the processes that make this server's images failed"  # the 503 of ranks that cannot go on


def _children(pid: int) -> list[int]:
    """The server's rank processes (not multiprocessing's resource tracker beside them)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _all_gone(pids: list[int], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not any(_alive(pid) for pid in pids)


@pytest.fixture(scope="module")
def one(adapters, tmp_path_factory):
    """The plain server, one process, the split ones are held to."""
    server = ServerProcess(["--model", "tiny-flux", "--adapters", str(adapters), "--no-compile"],
                           tmp_path_factory.mktemp("one") / "one.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_two_ranks_make_the_images_of_one_process(adapters, one, tmp_path):
    """A file named by URL too (fetched once, into the download folder the ranks share). And a
    refused swap or size changes nothing; a killed server takes its ranks with it."""
    web = Web({"/loras/a.safetensors": body((adapters / "a.safetensors").read_bytes())})
    two = ServerProcess(["--model", "tiny-flux", "--adapters", str(adapters), "--no-compile", "--ulysses-degree",
                         "2", "--url-allow", f"127.0.0.1:{web.port}", "--download-dir", str(tmp_path / "downloads")],
                        tmp_path / "two.log")
    try:
        two.wait_ready()
        url = web.url("/loras/a.safetensors")
        cases = [("", 1), ("a", 2), ("b", 3), ("a:0.5,b:0.7", 4), ("a", 5), ("", 6), (url, 7), (url, 8)]
        for lora, seed in cases:  # swapped every request
            single, split = _image(one.url, lora.replace(url, "a"), seed), _image(two.url, lora, seed)
            # float outputs agree within ~1e-6 (a probe of the tensors); as 8-bit pixels, a level at most
            assert np.abs(single - split).max() <= 1 and (single != split).mean() < 0.01, lora
        assert web.paths() == ["/loras/a.safetensors"], "fetched once, by one rank"
        assert np.abs(_image(two.url, "a", 7) - _image(two.url, "", 7)).max() > 5, "the adapter changes the image"
        base = _image(two.url, "", 8)
        refused = httpx.post(two.url + "/", json={"inputs": "a red circle", "parameters": {**PARAMS, "seed": 8}},
                             headers={"lora": "broken"}, timeout=60)
        assert refused.status_code == 400 and "infinite" in refused.json()["error"]
        assert np.array_equal(_image(two.url, "", 8), base), "a refused swap leaves every rank as it was"
        uneven = httpx.post(two.url + "/", json={"inputs": "x", "parameters": {**PARAMS, "width": 48, "height": 48}},
                            timeout=60)
        assert uneven.status_code == 400 and "do not split over 2 ranks" in uneven.json()["error"]
        assert np.array_equal(_image(two.url, "", 8), base), "the server serves on after a refusal"
        assert "rank 1" in two.log()
        assert httpx.post(two.url + "/adapters/b/load", timeout=60).status_code == 200
        assert httpx.delete(two.url + "/adapters/b", timeout=60).status_code == 200
        _wait_for_log(two, "rank 1: evict b")
        assert two.log().index("rank 1: keep b") < two.log().index("rank 1: evict b"), "every rank keeps it too"
        ranks = _children(two.proc.pid)
        assert ranks, "rank 1 runs as a child of the server"
        two.proc.send_signal(signal.SIGKILL)
        two.proc.wait(30)
        assert _all_gone(ranks), "no rank outlives its server"
    finally:
        two.stop()
        web.close()


def test_a_rank_failing_or_dying_ends_its_server_and_it_starts_again(adapters, tmp_path):
    """A swap failing on one rank alone, or ranks reading different versions of a file, is
    answered as an error, every rank back on the base model. A failure inside an image on
    one rank alone (a GPU out of memory) leaves the others in a collective for good: that
    rank waits `--rank-wait-s` for them, then exits, and the server with it (code 70), for
    its supervisor to start it again rather than hang; so does a rank killed. Started
    again, the server makes the same images."""
    args = ["--model", "tiny-flux", "--adapters", str(adapters), "--no-compile", "--ulysses-degree", "2"]
    first = ServerProcess([*args, "--rank-wait-s", "5"], tmp_path / "first.log", env=_failing_env())
    try:
        first.wait_ready()
        image, base = _image(first.url, "a", 9), _image(first.url, "", 10)
        _wait_for_log(first, "rank 1: read a")
        assert "rank 1: read a" in first.log(), "told to read the adapter as the request was queued"
        # a swap failing on rank 1 alone: rank 0, which wrote the adapter, goes back to the base too
        failed = httpx.post(first.url + "/", json={"inputs": "x", "parameters": {**PARAMS, "seed": 10}},
                            headers={"lora": "k"}, timeout=60)
        assert failed.status_code == 503 and "out of memory" in failed.json()["error"]
        assert "rank 1: the adapters could not be applied here: out of memory in the swap" in first.log()
        rows = httpx.get(first.url + "/adapters", timeout=30).json()["adapters"]
        assert not any(row["applied"] for row in rows), "rank 0, which wrote it, went back to the base model"
        assert np.array_equal(_image(first.url, "", 10), base), "every rank is back on the base model"
        changed = httpx.post(first.url + "/", json={"inputs": "x", "parameters": {**PARAMS, "seed": 10}},
                             headers={"lora": "b"}, timeout=60)  # rank 1 read another version of its file
        assert changed.status_code == 503 and "Retry-After" in changed.headers
        assert "adapter 'b': its file changed while the processes read it" in changed.json()["error"]
        assert np.array_equal(_image(first.url, "a", 9), image), "and swaps on in step"
        lost = httpx.post(first.url + "/", json={"inputs": "x", "parameters": {**PARAMS, "width": 96}}, timeout=60)
        assert lost.status_code == 503 and "Retry-After" in lost.headers, "answered, then the server ends"
        assert LOST in lost.json()["error"] and "the server restarts: retry shortly" in lost.json()["error"]
        assert first.proc.wait(30) == 70
        assert "rank 1: the image failed here: out of memory, on rank 1 alone" in first.log()
        assert "rank 1: the ranks did not all end the image (waiting 5 s at most)" in first.log()
    finally:
        first.stop()
    second = ServerProcess(args, tmp_path / "second.log")
    try:
        second.wait_ready()
        assert np.array_equal(_image(second.url, "a", 9), image)
        os.kill(_children(second.proc.pid)[0], signal.SIGKILL)
        assert second.proc.wait(30) == 70
        assert "exited with code -9: the ranks cannot go on without it" in second.log()
    finally:
        second.stop()


def _post(url: str, seed: int, **params) -> httpx.Response:
    return httpx.post(url + "/", json={"inputs": "x", "parameters": {**PARAMS, **params, "seed": seed}}, timeout=60)


def test_a_rank_killed_mid_request_gets_its_clients_a_503_then_the_server_exits(adapters, tmp_path):
    """Rank 1 killed while an image generates, two more requests queued behind it: the
    process group cannot be used again, so rank 0 answers all three with a JSON 503 and
    Retry-After (never a connection closed unanswered), then exits (code 70) for its
    supervisor to start it again."""
    server = ServerProcess(["--model", "tiny-flux", "--adapters", str(adapters), "--no-compile", "--ulysses-degree",
                            "2"], tmp_path / "killed.log", env=_failing_env())
    try:
        server.wait_ready()
        with ThreadPoolExecutor(3) as pool:
            generating = pool.submit(_post, server.url, 1, width=64, height=128)  # rank 1 holds it
            _wait_for_log(server, "rank 1: holding the image")
            assert "rank 1: holding the image" in server.log()
            queued = [pool.submit(_post, server.url, seed) for seed in (2, 3)]
            deadline = time.monotonic() + 30
            while server.metric("loraswap_queue_depth") < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert server.metric("loraswap_queue_depth") == 2, "both wait behind the image"
            os.kill(_children(server.proc.pid)[0], signal.SIGKILL)
            responses = [generating.result(60)] + [future.result(60) for future in queued]
        for response in responses:
            assert response.status_code == 503 and response.headers["Retry-After"] == "2", response.text
            assert LOST in response.json()["error"]
        assert server.proc.wait(30) == 70
        assert "loraswap-rank-1 exited with code -9: the ranks cannot go on without it" in server.log()
        assert "rank 0: the ranks cannot go on" in server.log()
    finally:
        server.stop()


LORAS = {"tiny-flux": [[], [("a", 1.0)], [("a", 0.5), ("b", 0.7)], [("k", 1.0)], []],  # a LoKr too
         "tiny-wan": [[], [("a", 1.0)], [("a", 0.5), ("b", 0.7)]],  # swapped between calls
         "tiny-qwen-image": [[], [("a", 1.0)], [("a", 0.5), ("b", 0.7)]],
         "tiny-qwen-image-edit": [[], [("a", 1.0)]]}
# Wan and Qwen-Image guided with a negative prompt (two passes a step, split by --cfg-parallel);
# Qwen-Image's prompts make texts of odd lengths, padded to split over two ranks
PROMPT, NEGATIVE = "a red circle.", "blurry, dark, ugly"
CALLS = {"tiny-flux": dict(height=64, width=64),
         "tiny-wan": dict(height=32, width=32, num_frames=5, negative_prompt=NEGATIVE, guidance_scale=5.0),
         "tiny-qwen-image": dict(height=64, width=64, negative_prompt=NEGATIVE, true_cfg_scale=4.0),
         "tiny-qwen-image-edit": dict(height=64, width=64, negative_prompt=NEGATIVE, true_cfg_scale=4.0,
                                      image=Image.new("RGB", (64, 48), (200, 30, 30)))}


@pytest.fixture(scope="module")
def model_adapters(tmp_path_factory, adapters) -> dict[str, Path]:
    folders = {"tiny-flux": adapters}
    for model in ("tiny-wan", "tiny-qwen-image", "tiny-qwen-image-edit"):
        folder = folders[model] = tmp_path_factory.mktemp(f"cp-{model}")
        components = lora_components(model)[1]  # Wan: both experts
        for name, seed in (("a", 1), ("b", 2)):
            state_dict, metadata = make_random_adapter(components, 4, "all", "diffusers", dtype=torch.float32,
                                                       seed=seed)
            save_file(state_dict, str(folder / f"{name}.safetensors"), metadata=metadata)
    return folders


def _float_images(engine: Engine, model: str) -> list[torch.Tensor]:
    images = []
    for loras in LORAS[model]:
        engine.set_adapters(loras)
        call = dict(prompt=PROMPT, num_inference_steps=2, output_type="pt", **CALLS[model])
        output = engine.pipeline(**engine.pipeline_arguments(call), generator=torch.Generator().manual_seed(3))
        images.append(output.frames if model == "tiny-wan" else output.images)
    return images


def _rank(rank: int, model: str, parallelism: dict, port: int, folder: Path, out: Path) -> None:
    world = parallelism["ulysses_degree"] * (2 if parallelism["cfg_parallel"] else 1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    engine = RankedEngine(EngineConfig(model=model, adapters=folder, compile=False, warmup=False, **parallelism))
    images = _float_images(engine, model)
    if rank == 0:
        torch.save(images, out)
    dist.destroy_process_group()


@pytest.mark.parametrize(("model", "ulysses", "cfg"), [("tiny-flux", 2, False), ("tiny-wan", 2, True),
                                                      ("tiny-qwen-image", 2, False), ("tiny-qwen-image-edit", 1, True)])
def test_split_images_are_within_1e_5_of_one_process(model_adapters, tmp_path, model, ulysses, cfg):
    """The outputs over several ranks, adapters swapped in place between calls, against one
    process, as tensors before 8-bit rounding: a FLUX.1 image; a Wan 2.2 video, both experts
    split over two ranks and its two guidance passes over two pairs of them (4 ranks);
    Qwen-Image with its text padded to split; Qwen-Image-Edit's guidance passes on two ranks."""
    folder = model_adapters[model]
    engine = Engine(EngineConfig(model=model, adapters=folder, compile=False, warmup=False))
    if model == "tiny-qwen-image":  # texts of odd lengths: padded to split over two ranks
        assert all(engine.pipeline.encode_prompt(text, device="cpu")[0].shape[1] % 2 for text in (PROMPT, NEGATIVE))
    single = _float_images(engine, model)
    parallelism = dict(ulysses_degree=ulysses, cfg_parallel=cfg)
    # the ranks fork from one server process that imported the engine once, for every case
    # (a spawned rank imports it again: about 10 s on two cores); no effect once it runs
    mp.set_forkserver_preload(["loraswap.engine.parallel.ranked"])
    mp.start_processes(_rank, args=(model, parallelism, free_port(), folder, tmp_path / "split.pt"),
                       nprocs=ulysses * (2 if cfg else 1), start_method="forkserver")
    split = torch.load(tmp_path / "split.pt")
    for loras, one, two in zip(LORAS[model], single, split):
        torch.testing.assert_close(two, one, rtol=0, atol=1e-5, msg=str(loras))
    assert (single[1] - single[0]).abs().max() > 1e-2, "the adapter changes the output"


# First-Block Cache settings that skip some of 6 steps and compute others, each threshold
# 0.02 or more from the measure of every step on one process (no rounding flips a decision)
FIRST_BLOCK = ["first-block:threshold=0.33", "first-block:threshold=0.5"]
CACHED = dict(prompt=PROMPT, seed=3, steps=6, width=64, height=64)


def _cached_rank(rank: int, port: int, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    engine = RankedEngine(EngineConfig(model="tiny-flux", compile=False, warmup=False, ulysses_degree=2,
                                       step_cache_allow=["first-block"]))
    results = [engine.generate(GenerateRequest(**CACHED, step_cache=setting)) for setting in FIRST_BLOCK]
    torch.save([(torch.from_numpy(np.asarray(r.image)), r.steps_skipped) for r in results], out / f"rank-{rank}.pt")
    dist.destroy_process_group()


def test_first_block_cache_skips_the_same_steps_on_every_rank_as_one_process(tmp_path):
    """Each rank measures the first block's change on its slice of the sequence; the decision
    to skip is taken from the sums over every rank, so all skip the steps one process skips
    (ranks that disagreed would wait on each other's collectives for good)."""
    engine = Engine(EngineConfig(model="tiny-flux", compile=False, warmup=False, step_cache_allow=["first-block"]))
    single = [engine.generate(GenerateRequest(**CACHED, step_cache=setting)) for setting in FIRST_BLOCK]
    assert [r.steps_skipped for r in single] == [3, 5], "some steps skipped, others computed"
    mp.set_forkserver_preload(["loraswap.engine.parallel.ranked"])
    ranks = mp.start_processes(_cached_rank, args=(free_port(), tmp_path), nprocs=2, start_method="forkserver",
                               join=False)
    deadline = time.monotonic() + 180
    while not ranks.join(timeout=5):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("the ranks never ended the images: they did not skip the same steps")
    for rank in (0, 1):
        for setting, one, (image, skipped) in zip(FIRST_BLOCK, single, torch.load(tmp_path / f"rank-{rank}.pt")):
            assert skipped == one.steps_skipped, (rank, setting)
            assert np.abs(image.numpy().astype(int) - np.asarray(one.image).astype(int)).max() <= 1, (rank, setting)


@pytest.mark.ray
def test_a_ray_replica_spans_its_ranks(adapters, one, tmp_path):
    """On Ray Serve one replica is rank 0 of its own processes (one per GPU it holds): the
    same images as one plain process."""
    from support.servers import ray_env

    ray = ServerProcess(["--model", "tiny-flux", "--adapters", str(adapters), "--no-compile", "--ray",
                         "--ulysses-degree", "2"], tmp_path / "ray.log", env=ray_env())
    try:
        ray.wait_ready()
        for lora, seed in (("a", 11), ("a:0.5,b:0.7", 12), ("", 13)):
            single, split = _image(one.url, lora, seed), _image(ray.url, lora, seed)
            assert np.abs(single - split).max() <= 1 and (single != split).mean() < 0.01, lora
    finally:
        ray.stop()
