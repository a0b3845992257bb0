"""Build the Ray Serve application, and run it: `loraswap serve --ray`, `loraswap deploy`.

The application: an `ingress` deployment (the HTTP contract, no GPU), one deployment
per base model (`ModelReplica`, each replica one GPU when there are GPUs), and `reports`
(one small replica). `app_builder` is the import path for Serve config files and
KubeRay (`import_path: loraswap.cluster:app_builder`, `args:` a `ClusterConfig`).
"""

import logging
import os
import signal
import threading
import time
from pathlib import Path

import ray
import torch
import yaml
from ray import serve
from ray.serve.config import RequestRouterConfig

from loraswap.cluster.config import ClusterConfig, ModelDeploymentConfig
from loraswap.cluster.ingress import Ingress
from loraswap.cluster.replica import ModelReplica
from loraswap.cluster.reports import Reports
from loraswap.cluster.request_router import RETRY_BACKOFF, LeastBusyAdapterRouter

logger = logging.getLogger("loraswap.cluster")

INGRESS_MAX_ONGOING = 1000  # the ingress only awaits replicas; the model deployments' queues bound the work


def replica_gpus(engine: ModelDeploymentConfig) -> float:
    """GPUs per replica: as configured, else one per rank (context parallelism: several) on
    CUDA (or auto on a cluster with GPUs), else 0."""
    if engine.num_gpus is not None:
        return engine.num_gpus
    ranks = float(engine.parallel.parallelism.world)
    if engine.device == "cuda":
        return ranks
    if engine.device == "auto" and ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= ranks:
        return ranks
    return 0.0


def build_app(config: ClusterConfig) -> serve.Application:
    """Configs travel as JSON-like dicts, validated again in each replica: a replica whose
    loraswap is newer than the deployer's (a field added) still gets a valid config."""
    reports = serve.deployment(Reports, name="reports", num_replicas=1, max_ongoing_requests=10_000,
                               ray_actor_options={"num_cpus": 0},
                               logging_config={"enable_access_log": False}).bind(config.report_interval_s)
    models = []
    worker_holds = config.scheduler.max_queue + 1  # its queue, and the request generating
    for engine in config.engines:
        deployment = serve.deployment(
            ModelReplica, name=engine.deployment_name, num_replicas=engine.replicas,
            max_ongoing_requests=engine.max_ongoing_requests or worker_holds,
            max_queued_requests=config.scheduler.max_queue,
            request_router_config=RequestRouterConfig(request_router_class=LeastBusyAdapterRouter, **RETRY_BACKOFF),
            ray_actor_options={"num_gpus": replica_gpus(engine), "num_cpus": engine.num_cpus},
            health_check_period_s=engine.health_check_period_s,
            graceful_shutdown_timeout_s=engine.graceful_shutdown_timeout_s)
        models.append(deployment.bind(engine.model_dump(mode="json"), config.scheduler.model_dump(mode="json"),
                                      reports, config.report_interval_s))
    ingress = serve.deployment(serve.ingress()(Ingress), name="ingress", num_replicas=config.ingress_replicas,
                               max_ongoing_requests=INGRESS_MAX_ONGOING, ray_actor_options={"num_cpus": 0},
                               graceful_shutdown_timeout_s=max(e.graceful_shutdown_timeout_s for e in config.engines))
    return ingress.bind(config.model_dump(mode="json"), models, reports)


def app_builder(args: dict) -> serve.Application:
    """For Serve config files and KubeRay's serveConfigV2: `args` is a ClusterConfig."""
    return build_app(ClusterConfig.model_validate(args))


def load_config(path: Path) -> ClusterConfig:
    """A ClusterConfig from YAML: loraswap's own file, or a Serve config file using app_builder."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if "applications" in data:  # a Serve config file: take loraswap's application
        apps = [a for a in data["applications"] if str(a.get("import_path", "")).startswith("loraswap.cluster")]
        if len(apps) != 1:
            raise ValueError(f"{path}: a Serve config file needs exactly one application with "
                             "import_path: loraswap.cluster:app_builder")
        http = data.get("http_options", {})
        data = {**{k: http[k] for k in ("host", "port") if k in http}, "app_name": apps[0].get("name", "loraswap"),
                **(apps[0].get("args") or {})}
    return ClusterConfig.model_validate(data)


def _with_local_threads(config: ClusterConfig) -> ClusterConfig:
    """Replicas on this machine compute with the torch threads this process has (as `loraswap
    serve` would), not Ray's OMP_NUM_THREADS=num_cpus: the same seed gives the same image."""
    engines = [e if e.torch_threads else e.model_copy(update={"torch_threads": torch.get_num_threads()})
               for e in config.engines]
    return config.model_copy(update={"engines": engines})


def run(config: ClusterConfig, address: str | None = None, detach: bool = False) -> None:
    """Deploy onto the Ray cluster at `address` (or RAY_ADDRESS; else a new local one) and
    serve until SIGTERM or SIGINT, then stop gracefully: replicas finish the requests they
    have. `detach`: return once healthy and leave the application running on the cluster."""
    address = address or os.environ.get("RAY_ADDRESS")
    if detach and not address:
        raise ValueError("--detach needs a running cluster (--address or RAY_ADDRESS): a local one ends with us")
    # 1. connect, or start a local cluster with enough logical CPUs for every replica
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        os.environ.pop("RAY_ADDRESS", None)  # set but empty: still a new local cluster
        config = _with_local_threads(config)
        needed = sum(e.num_cpus * e.replicas for e in config.engines) + 1
        ray.init(num_cpus=max(os.cpu_count() or 1, int(needed + 0.999)), include_dashboard=False,
                 logging_level=logging.WARNING)
    stop = threading.Event()
    try:
        # 2. the HTTP proxy, then the application; serve.run returns once every replica is healthy
        serve.start(http_options={"host": config.host, "port": config.port})
        started = time.perf_counter()
        serve.run(build_app(config), name=config.app_name, route_prefix="/", blocking=False)
        logger.info("serving %s on http://%s:%d (%s) in %.1f s", config.app_name, config.host, config.port,
                    ", ".join(f"{e.deployment_name} x{e.replicas}" for e in config.engines),
                    time.perf_counter() - started)
        if detach:
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        # 3. graceful stop: Serve drains each replica (graceful_shutdown_timeout_s) before removing it
        logger.info("stopping %s: replicas finish their requests", config.app_name)
        serve.delete(config.app_name)
        if not address:
            serve.shutdown()
    finally:
        if not detach:
            ray.shutdown()
    logger.info("stopped")
