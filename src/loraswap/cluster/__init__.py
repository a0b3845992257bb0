"""Ray Serve deployments for more than one GPU or machine (`pip install 'loraswap[ray]'`).

`build_app(ClusterConfig)` is the application; `app_builder` its import path for Serve
config files and KubeRay; `run` deploys and serves it (`loraswap serve --ray`,
`loraswap deploy CONFIG.yaml`). docs/ray.md tells how to run it.

The config classes import without Ray (the CLI builds the `--ray` flags from them);
the application, which needs Ray, is imported when first asked for.
"""

from loraswap.cluster.config import ClusterConfig, ModelDeploymentConfig

__all__ = ["ClusterConfig", "ModelDeploymentConfig", "app_builder", "build_app", "load_config", "run"]


def __getattr__(name: str):
    if name in ("app_builder", "build_app", "load_config", "run"):
        from loraswap.cluster import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
