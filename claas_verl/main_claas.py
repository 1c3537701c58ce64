"""CLaaS replay trainer entry: ``python -m claas_verl.main_claas --config-name claas/<recipe> [overrides]``.

Recipes live in the repository's ``recipes/`` directory (``recipes/claas/*.yaml``); they compose verl's
``ppo_trainer`` and, for the tiny CPU variants, the ``cpu`` preset. Like verl-recipe's ``main_dapo``: Hydra
config -> (join a running Ray cluster, :mod:`claas_verl.verl_ext.ray_connect`) ->
verl's ``run_ppo`` with a task runner that registers the ``claas`` trainer in its Ray process and
skips verl's agent loop (CLaaS rollouts come from its own scenario producers).

Example (CPU, a few minutes on 2 cores)::

    python -m claas_verl.tiny make /tmp/claas_verl_tiny
    python -m claas_verl.main_claas --config-name claas/reinforce_pp scale=tiny

Every ``claas.*`` key, its default and meaning: docs/config.md (``--help`` points there).
"""

from __future__ import annotations

import functools
import sys

import hydra
from omegaconf import OmegaConf

from claas_verl.config_docs import print_help_pointer
from claas_verl.paths import recipes_dir

RECIPES_DIR = str(recipes_dir())


@functools.cache
def claas_task_runner_class():
    """verl's v1 task runner, plus the ``claas`` trainer registration, minus the agent loop: rollouts come from
    claas_verl.claas.trainer.producer, not from verl's dataset-driven agent loop (skipping it saves its worker actors).

    Built on first use, so that ``--help`` (Hydra lists the recipes) does not import verl and Ray."""
    from claas_verl.verl_ext.trainer_base import task_runner_class

    return task_runner_class("claas_verl.claas.trainer.trainer", agent_loop=False)


@hydra.main(config_path=RECIPES_DIR, config_name=None, version_base=None)
def main(config) -> None:
    import ray
    from verl.trainer.main_ppo import run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    from claas_verl.verl_ext.ray_connect import connect_if_cluster_running
    from claas_verl.verl_ext.transfer_queue_env import cap_transfer_queue_threads

    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    cap_transfer_queue_threads()  # before Ray starts: its processes inherit it
    connect_if_cluster_running(config)  # inside `ray job submit` or after `ray start`; else run_ppo starts Ray
    if not OmegaConf.select(config, "claas.service.enabled"):
        run_ppo(config, task_runner_class=claas_task_runner_class())
        return
    run_dir = str(config.trainer.default_local_dir)
    if ray.is_initialized():
        _drain_service_on_sigterm(run_dir)
        run_ppo(config, task_runner_class=claas_task_runner_class())
        return
    # ray.init installs Ray's own fatal-signal handler (SIGTERM aborts the driver): ours goes in right after it
    init = ray.init

    def init_then_handle(*args, **kwargs):
        out = init(*args, **kwargs)
        _drain_service_on_sigterm(run_dir)
        return out

    ray.init = init_then_handle
    try:
        run_ppo(config, task_runner_class=claas_task_runner_class())
    finally:
        ray.init = init


def _drain_service_on_sigterm(run_dir: str) -> None:
    """A service-driven job: SIGTERM asks the chat API to shut down (``POST /v1/claas/shutdown`` with the admin key:
    ``$CLAAS_ADMIN_KEY`` or the run's own ``service_admin.key``), so the trainer stops intake, drains and takes its
    final checkpoint before the job ends; a second SIGTERM ends the driver at once."""
    import os
    import signal
    import threading

    def ask() -> None:
        import json

        import httpx

        from claas_verl.claas.trainer.chat_api import SERVICE_ADMIN_FILE

        try:
            with open(os.path.join(run_dir, "service.json")) as f:
                url = json.load(f)["url"]
            key = os.environ.get("CLAAS_ADMIN_KEY")
            if not key:
                with open(os.path.join(run_dir, SERVICE_ADMIN_FILE)) as f:
                    key = f.read().strip()
            httpx.post(f"{url}/v1/claas/shutdown", headers={"Authorization": f"Bearer {key}"}, timeout=30)
            print("[claas] SIGTERM: the chat API stops taking requests; final checkpoint, then exit", flush=True)
        except (OSError, ValueError, KeyError, httpx.HTTPError) as exc:
            print(f"[claas] SIGTERM: could not ask the chat API to shut down ({exc!r}); stopping now", flush=True)
            os.kill(os.getpid(), signal.SIGINT)

    def handler(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM: no more grace
        threading.Thread(target=ask, name="claas-sigterm", daemon=True).start()

    signal.signal(signal.SIGTERM, handler)


if __name__ == "__main__":
    print_help_pointer(sys.argv[1:])  # Hydra's --help lists the recipes; the keys are on docs/config.md
    main()
