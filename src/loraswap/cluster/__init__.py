"""Ray Serve deployments for more than one GPU or machine (`pip install 'loraswap[ray]'`).

`build_app(ClusterConfig)` is the application; `app_builder` its import path for Serve
config files and KubeRay; `run` deploys and serves it (`loraswap serve --ray`,
`loraswap deploy CONFIG.yaml`). docs/ray.md tells how to run it.
"""

from .app import app_builder, build_app, load_config, run
from .config import ClusterConfig, ModelDeploymentConfig

__all__ = ["ClusterConfig", "ModelDeploymentConfig", "app_builder", "build_app", "load_config", "run"]
