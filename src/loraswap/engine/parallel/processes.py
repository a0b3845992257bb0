"""The processes of a context-parallel engine (`--ulysses-degree`, `--ring-degree`).

Rank 0 is the process that serves HTTP; ranks 1 to N-1 are started here, each joining the
process group (NCCL on GPUs, gloo on the CPU), building the same engine on its own GPU (the
warm-up made in step with rank 0's) and then following rank 0 (`ranks.follow`).
They end with it: when it says stop, and when it dies (Linux: `PR_SET_PDEATHSIG`), so no
rank outlives a killed server and a restart starts from nothing.
"""

import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.parallel.loss import exit_for_restart
from loraswap.engine.parallel.ranks import Ranks, follow

logger = logging.getLogger(__name__)
WATCH_S = 0.5  # how often rank 0 looks for a rank that exited


class RankProcesses:
    """Ranks 1..N-1 started, and this process joined as rank 0; `engine_factory` builds rank
    0's engine and makes it lead."""

    def __init__(self, config: EngineConfig):
        check_gpu_count(config)
        self.parallelism = config.parallel.parallelism
        self.ranks: Ranks | None = None
        port = free_port()
        engine_only = config.model_dump(mode="json", include=set(EngineConfig.model_fields))  # a Ray replica's too
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked CUDA or threads
        self.processes = [context.Process(target=_follower, args=(engine_only, rank, port),
                                          name=f"loraswap-rank-{rank}", daemon=True)
                          for rank in range(1, self.parallelism.world)]
        for process in self.processes:
            process.start()
        self._join_while_alive(config, port)
        logger.info("rank 0 of %d joined (%s)", self.parallelism.world, dist.get_backend())
        self._stopping = False
        threading.Thread(target=self._watch, name="loraswap-rank-watch", daemon=True).start()

    def _watch(self) -> None:
        """A rank that dies leaves the others waiting in their next collective: end this
        process too, once the requests it holds are answered (503), for its supervisor (or Ray
        Serve) to start the server again, all ranks anew."""
        while not self._stopping:
            gone = next((p for p in self.processes if p.exitcode is not None), None)
            if gone is not None and not self._stopping:
                logger.error("%s exited with code %s: the ranks cannot go on without it", gone.name, gone.exitcode)
                if self.ranks is None:  # still starting: no request to answer
                    exit_for_restart()
                self.ranks.loss.give_up(f"{gone.name} exited with code {gone.exitcode}")
                return
            time.sleep(WATCH_S)

    def _join_while_alive(self, config: EngineConfig, port: int) -> None:
        """Join as rank 0, unless a rank exits first (it would never join: its error is in the log)."""
        joining = threading.Thread(target=_join, args=(config, 0, self.parallelism.world, port), daemon=True)
        joining.start()
        while joining.is_alive():
            joining.join(0.5)
            gone = [p for p in self.processes if p.exitcode is not None]
            if gone and joining.is_alive():
                raise RuntimeError(f"{gone[0].name} exited with code {gone[0].exitcode} before joining "
                                   "(its error is logged above)")
        if not dist.is_initialized():
            raise RuntimeError("rank 0 could not join the process group (its error is logged above)")

    def engine_factory(self, config: EngineConfig):
        from loraswap.engine.parallel.ranked import RankedEngine

        engine = RankedEngine(config)
        self.ranks = Ranks(config.parallel.rank_wait_s)
        engine.use_ranks(self.ranks)
        return engine

    def stop(self, timeout: float = 30.0) -> None:
        """Tell the other ranks to stop and wait for them; kill those that do not (a batch still
        in flight when the server gave up waiting for it)."""
        self._stopping = True
        deadline = time.monotonic() + timeout  # for them all: they stop at once
        if self.ranks is not None:
            telling = threading.Thread(target=self.ranks.stop, daemon=True)
            telling.start()
            telling.join(timeout)
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the process group's rendezvous, a benchmark's server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _on_gpus(config: EngineConfig) -> bool:
    return config.device != "cpu" and torch.cuda.is_available()


def check_gpu_count(config: EngineConfig) -> None:
    """One GPU per rank: NCCL refuses two ranks on one GPU, but only at the first collective,
    after every rank has loaded the model; refuse before anything starts."""
    world, gpus = config.parallel.parallelism.world, torch.cuda.device_count() if _on_gpus(config) else None
    if gpus is not None and gpus < world:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ValueError(f"{world} processes (--ulysses-degree x --ring-degree, x 2 with --cfg-parallel) need "
                         f"{world} GPUs, one each; {gpus} visible"
                         f"{f' (CUDA_VISIBLE_DEVICES={visible})' if visible is not None else ''}")


def _join(config: EngineConfig, rank: int, world: int, port: int) -> None:
    on_gpus = _on_gpus(config)
    if on_gpus:
        torch.cuda.set_device(rank % torch.cuda.device_count())  # "cuda" is then this rank's GPU
    dist.init_process_group("nccl" if on_gpus else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)


def _follower(config_json: dict, rank: int, port: int) -> None:
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"rank {rank} %(levelname)s %(name)s: %(message)s")
    from loraswap.engine.parallel.ranked import RankedEngine
    from loraswap.engine.process import freeze_loaded_objects

    config = EngineConfig.model_validate(config_json)
    _join(config, rank, config.parallel.parallelism.world, port)
    engine = RankedEngine(config)
    freeze_loaded_objects()
    follow(engine, Ranks(config.parallel.rank_wait_s))
    dist.destroy_process_group()


def _die_with_parent() -> None:
    """This rank ends when rank 0 does, however rank 0 ends."""
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # rank 0 died before the call took effect
            os._exit(1)
