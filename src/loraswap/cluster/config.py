"""The typed configuration of a Ray Serve deployment: the server's, plus replicas per model.

A `ClusterConfig` is a `ServerConfig` (the HTTP edge's limits, the scheduler) whose
`engines` are `ModelDeploymentConfig`s: an `EngineConfig` plus how many replicas serve
that base model and what each holds. It is what `loraswap deploy CONFIG.yaml` reads,
and the `args` of a Ray Serve config file (`import_path: loraswap.cluster:app_builder`),
which is how KubeRay's RayService runs it.
"""

import re
from typing import Annotated

from pydantic import Field, model_validator

from loraswap.engine.config.engine import EngineConfig
from loraswap.flags import RAY, Flag
from loraswap.server.config import ServerConfig


class ModelDeploymentConfig(EngineConfig):
    """One base model: its engine, and the Ray Serve deployment whose replicas serve it."""

    name: str | None = Field(None, description="Deployment name (default: derived from the model); "
                             "the name Serve config files and `serve status` use.")
    replicas: Annotated[int, Flag(RAY)] = Field(
        1, ge=1, le=1024, description="Replicas per model, each one engine on one GPU (or CPU).")
    max_adapters: Annotated[int, Flag(RAY)] = Field(
        32, ge=1, description="Adapters (or blends) one replica holds; the least recently used is evicted past "
                              "this (Ray Serve's multiplexing budget).")
    max_ongoing_requests: int | None = Field(None, ge=1, le=1024, description="Requests one replica takes "
                                             "at once; None: what its GPU worker holds (the scheduler's "
                                             "max_queue + 1), so the worker's scheduler orders them. "
                                             "More wait at the router, oldest first.")
    num_gpus: float | None = Field(None, ge=0, description="GPUs per replica; None: 1 when the device is "
                                   "cuda, or auto on a cluster with GPUs; else 0.")
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per replica (Ray logical CPUs).")
    torch_threads: int | None = Field(None, ge=1, description="torch CPU threads per replica; None: Ray's "
                                      "OMP_NUM_THREADS (num_cpus), or on a local cluster started by loraswap, "
                                      "what a plain loraswap process uses (the same images, bit for bit).")
    health_check_period_s: float = Field(10.0, gt=0, description="How often Serve checks each replica.")
    graceful_shutdown_timeout_s: float = Field(120.0, ge=0, description="How long a stopping replica may "
                                               "finish its requests.")

    @property
    def deployment_name(self) -> str:
        return self.name or "model-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", self.model).strip("_")


class ClusterConfig(ServerConfig):
    """The server's configuration, served by Ray Serve: an ingress and one deployment per model."""

    engines: list[ModelDeploymentConfig] = Field(default_factory=lambda: [ModelDeploymentConfig()], min_length=1,
                                                 description="The served base models; the first is the default.")
    app_name: str = Field("loraswap", description="The Ray Serve application's name.")
    ingress_replicas: int = Field(1, ge=1, description="Replicas of the HTTP ingress (no GPU).")
    report_interval_s: float = Field(0.5, gt=0, le=60, description="How often replicas report figures "
                                     "and cache tables to the ingress.")

    @model_validator(mode="after")
    def _distinct_deployments(self):
        names = [e.deployment_name for e in self.engines]
        if len(set(names)) != len(names):
            raise ValueError(f"two models share a deployment name ({', '.join(names)}); give each a `name`")
        return self
