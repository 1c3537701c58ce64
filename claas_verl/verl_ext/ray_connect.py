"""Join a running Ray cluster from an entry point, or leave the start of a local one to verl.

verl's ``run_ppo`` calls ``ray.init(**ray_kwargs.ray_init)`` when Ray is not initialised yet. The CPU
presets put ``num_cpus``/``num_gpus`` (logical resources for a local cluster) there, and Ray refuses
resources when it connects to an existing cluster. That happens inside a submitted job (``RAY_ADDRESS``
is set) and after ``ray start`` on the node (Ray remembers the address in its temp dir). So the entry
points call :func:`connect_if_cluster_running` first: when a plain ``ray.init()`` would connect, it
connects with the same runtime environment that verl would have passed and without the start-only
keys. ``run_ppo`` then sees an initialised Ray and skips its own ``ray.init``.

``RAY_ADDRESS=local`` forces a new local cluster (Ray's own meaning of ``address="local"``); the test
suite sets it so that it never joins a cluster that happens to be running on the machine.
"""

from __future__ import annotations

import json
import os
from typing import Any

# ray.init arguments that only configure a cluster being started; Ray raises on most of them when it
# connects to an existing one, and the others (dashboard, temp dir) are ignored there.
START_ONLY_KEYS = (
    "num_cpus",
    "num_gpus",
    "resources",
    "labels",
    "object_store_memory",
    "include_dashboard",
    "dashboard_host",
    "dashboard_port",
    "_temp_dir",
    "_system_config",
    "_node_name",
    "_enable_object_reconstruction",
    "_plasma_directory",
)


def existing_cluster_address() -> str | None:
    """The address a plain ``ray.init()`` in this process would connect to; None if it would start a cluster.

    ``RAY_ADDRESS`` first (``ray://`` client addresses included; ``local`` means start one), then the
    address that the last ``ray start`` on this node recorded in Ray's default temp dir. The second half is
    Ray's own resolution (``ray._private.services.canonicalize_bootstrap_address``, what ``ray.init(address=None)``
    calls), so the entry points decide exactly as Ray would; ``tests/cluster/test_ray_connect.py`` fails if
    a Ray upgrade moves that name.
    """
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env.startswith("ray://"):
        return env
    from ray._private.services import canonicalize_bootstrap_address

    return canonicalize_bootstrap_address(None)


def connect_kwargs(ray_init: dict[str, Any], default_runtime_env: dict[str, Any],
                   job_runtime_env: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split verl's ``ray_kwargs.ray_init`` into the ``ray.init`` kwargs for connecting and the ignored keys.

    The runtime environment is verl's default (``get_ppo_ray_runtime_env``) overlaid with
    ``ray_init.runtime_env``, as verl merges it for a local cluster. Inside a submitted job Ray merges the
    driver's runtime environment into the job's and refuses a field or an environment variable given by
    both, so whatever the job already sets (its ``working_dir``, its ``env_vars``) is left to the job.
    """
    kwargs = {k: v for k, v in ray_init.items() if v is not None}
    ignored = {k: kwargs.pop(k) for k in START_ONLY_KEYS if k in kwargs}
    runtime_env = dict(default_runtime_env)
    user_env = dict(kwargs.pop("runtime_env", None) or {})
    env_vars = {**(runtime_env.get("env_vars") or {}), **(user_env.pop("env_vars", None) or {})}
    runtime_env.update(user_env)
    job = job_runtime_env or {}
    env_vars = {k: str(v) for k, v in env_vars.items() if k not in (job.get("env_vars") or {})}
    runtime_env = {k: v for k, v in runtime_env.items() if k != "env_vars" and k not in job}
    if env_vars:
        runtime_env["env_vars"] = env_vars
    kwargs.pop("timeline_json_file", None)  # a verl key (its profiler output), not a ray.init argument
    if runtime_env:
        kwargs["runtime_env"] = runtime_env
    return kwargs, ignored


def _job_runtime_env() -> dict[str, Any] | None:
    """The runtime environment of the submitted job this driver runs in (None outside a job)."""
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    raw = os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR)
    return json.loads(raw).get("runtime_env") if raw else None


def _check_logical_gpus(config, address: str) -> None:
    """On CPU, verl's resource pools count (logical) GPUs: a cluster started without them cannot run a rank."""
    import ray

    trainer = config.trainer
    if str(trainer.get("device", "")) != "cpu":
        return  # GPU clusters may autoscale; verl's own resource check applies there
    need = int(trainer.nnodes) * int(trainer.n_gpus_per_node)
    have = int(ray.cluster_resources().get("GPU", 0))
    if have < need:
        raise ValueError(
            f"the Ray cluster at {address} has {have} GPU resources, but trainer.nnodes x trainer.n_gpus_per_node"
            f" = {need} training ranks need one (logical) GPU each on CPU: start its nodes with "
            f"`ray start ... --num-gpus=N` (N logical GPUs per node, no CUDA needed), or lower trainer.n_gpus_per_node"
        )


def connect_if_cluster_running(config) -> str | None:
    """Connect to the running cluster a plain ``ray.init()`` would find (returns its address), else do nothing.

    Prints which ``ray_kwargs.ray_init`` keys are ignored because the cluster already exists.
    """
    import ray
    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    if ray.is_initialized():
        return None
    address = existing_cluster_address()
    if address is None:
        return None
    ray_init = OmegaConf.to_container(config.get("ray_kwargs", {}).get("ray_init", {}) or {}, resolve=True)
    kwargs, ignored = connect_kwargs(ray_init, get_ppo_ray_runtime_env(config), _job_runtime_env())
    print(f"claas_verl: joining the running Ray cluster at {address}"
          + (f"; ray_kwargs.ray_init keys {sorted(ignored)} only apply to a new local cluster" if ignored else ""),
          flush=True)
    ray.init(address=address, **kwargs)
    _check_logical_gpus(config, address)
    return address
