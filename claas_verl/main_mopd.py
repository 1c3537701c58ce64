"""Run a continual MOPD recipe on verl: ``python -m claas_verl.main_mopd --config-name mopd/<recipe> [key=value ...]``.

The config is the recipe that ``python -m claas_verl.plan --config-name mopd/<recipe>`` shows, plus a verl
runtime group (``recipes/mopd/verl/{cpu,gpu}.yaml``: verl's ``ppo_trainer``, the CPU preset on CPU, and the
``mopd.train`` values mapped onto verl keys), chosen where the workers run unless the command line names one
(``+verl@_global_=cpu``): by the GPUs Ray detected on the running cluster's nodes, else (a local cluster) by this
machine's CUDA (:mod:`claas_verl.preflight.runtime`). Before Ray starts, the optional packages the reward needs
for the prompt files' data sources (:mod:`claas_verl.mopd.data.extras`) and every model of the plan are checked
(:mod:`claas_verl.preflight.models`), and the checkpoint disk the run needs is printed. Then it joins a running Ray
cluster if one is there (``RAY_ADDRESS``, as inside ``ray job submit``, or an earlier ``ray start`` on this node;
see :mod:`claas_verl.verl_ext.ray_connect`), and verl's own ``run_ppo`` starts a local one otherwise and its v1
``TaskRunner``, which builds the trainer registered as ``trainer.v1.trainer_mode=mopd``
(:class:`claas_verl.mopd.trainer.MOPDTrainer`; it checks verl's worker placement against the cluster first).

Examples::

    python -m claas_verl.tiny make /tmp/claas_verl_tiny          # once, offline
    python -m claas_verl.main_mopd --config-name mopd/seq scale=tiny   # 3 tiny stages on CPU
    python -m claas_verl.main_mopd --config-name mopd/replay_kl scale=tiny mopd.train.lr=1e-4

Filled in here (not in YAML, because they are derived): ``data.train_files``/``val_files`` (every domain's
prompt file), ``trainer.total_training_steps`` (the plan length, unless set lower to stop early),
``actor_rollout_ref.rollout.max_model_len`` and a repository-relative reward path made absolute.

Every ``mopd.*`` key, its default and meaning: docs/config.md (``--help`` points there).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, open_dict

from claas_verl.config_docs import print_help_pointer
from claas_verl.mopd.data.extras import check_reward_extras
from claas_verl.paths import recipes_dir
from claas_verl.preflight.disk import checkpoint_disk, human, parameter_count
from claas_verl.preflight.models import check_plan_models
from claas_verl.preflight.prompts import check_prompt_lengths
from claas_verl.preflight.runtime import choose_runtime
from claas_verl.schedule import build_plan

RUNTIME_GROUP = "verl@_global_"  # relative to the recipe folder: recipes/mopd/verl/
REPO = Path(__file__).resolve().parents[1]


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch is a dependency
        return False


def help_without_recipe(argv: list[str]) -> bool:
    """``--help`` (or ``-h``) given and no ``--config-name``/``-cn``: the user asks which recipes there are."""
    asks_help = any(a in ("--help", "-h") for a in argv)
    return asks_help and not any(a in ("-cn", "--config-name") or a.startswith("--config-name=") for a in argv)


def runtime_args(argv: list[str], group: str | None = None) -> list[str]:
    """Extra Hydra arguments: verl's config search path and the runtime group (unless the user chose one).

    ``group`` fixes the group when the command line names none; otherwise it is chosen where the workers run
    (:func:`claas_verl.preflight.runtime.choose_runtime`; ``ValueError`` when the cluster is ambiguous).
    ``--help`` without a recipe gets none: Hydra then lists the recipes at once, without importing verl to
    compose its config or probing for a Ray cluster."""
    if help_without_recipe(argv):
        return []
    extra = []
    if not any(a.startswith("hydra.searchpath") for a in argv):
        # verl's configs (ppo_trainer), and recipes/mopd itself so that Hydra accepts the runtime group
        # `verl` (an appended group of a recipe is resolved relative to the recipe's folder, mopd/verl/...,
        # but validated as a top-level group name)
        extra.append(f"hydra.searchpath=[pkg://verl.trainer.config,file://{recipes_dir() / 'mopd'}]")
    if not any(a.lstrip("+").startswith(("verl@", "verl=")) for a in argv):
        if group is None:
            group, why = choose_runtime(has_cuda())
            print(f"claas_verl.main_mopd: verl runtime group {group} ({why}; override: +{RUNTIME_GROUP}=cpu|gpu)",
                  file=sys.stderr)
        extra.append(f"+{RUNTIME_GROUP}={group}")
    return extra


def finalize_config(cfg: DictConfig) -> DictConfig:
    """Fill the derived verl keys and check the recipe before Ray starts (clear errors, no half-started jobs)."""
    from claas_verl.mopd.config import MopdConfig  # imports torch: not on the --help path

    mopd = MopdConfig.from_config(cfg)  # ValueError naming the bad mopd.* key
    plan = build_plan(mopd.schedule)
    with open_dict(cfg):
        files = []
        for d in plan.order:
            p = mopd.domains[d].prompts
            if p in (None, "???") or not os.path.exists(str(p)):
                raise ValueError(f"mopd.domains.{d}.prompts: prompt file {p!r} does not exist")
            files.append(str(p))
        # verl's own dataloaders must exist but are unused: every block comes from its domain's file
        cfg.data.train_files = files[:1]
        cfg.data.val_files = files[:1]
        steps = cfg.trainer.get("total_training_steps")
        if steps is None:
            cfg.trainer.total_training_steps = len(plan)
        elif not 1 <= int(steps) <= len(plan):
            raise ValueError(f"trainer.total_training_steps={steps} must be in [1, {len(plan)}] (the plan length)")
        rollout = cfg.actor_rollout_ref.rollout
        if rollout.get("max_model_len") is None:
            rollout.max_model_len = mopd.train.max_prompt_length + mopd.train.max_response_length
        reward = cfg.reward.custom_reward_function
        if reward.get("path") and not os.path.isabs(reward.path) and (REPO / reward.path).exists():
            reward.path = str(REPO / reward.path)
    check_reward_extras(cfg, plan)
    check_plan_models(cfg, plan)
    check_prompt_lengths(cfg, plan, mopd)  # verl's agent loop would cut longer prompts silently
    report_disk(cfg, plan, mopd.student)
    return cfg


def report_disk(cfg: DictConfig, plan, student: str) -> None:
    """Print the checkpoint disk the run needs; warn when the output folder's file system has less free."""
    need = checkpoint_disk(cfg, plan, parameter_count(student),
                           steps=int(cfg.trainer.total_training_steps))
    print(f"claas_verl.main_mopd: {need.summary()}", file=sys.stderr)
    folder = os.path.abspath(str(cfg.trainer.default_local_dir))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    free = shutil.disk_usage(folder).free
    if free < need.total:
        print(f"claas_verl.main_mopd: WARNING: {folder} has {human(free)} free, less than the "
              f"{human(need.total)} above: lower trainer.max_actor_ckpt_to_keep, raise trainer.save_freq, or "
              "point trainer.default_local_dir (CLAAS_OUT_DIR) at a larger disk", file=sys.stderr)


def _run(cfg: DictConfig) -> None:
    from verl.trainer.main_ppo import run_ppo
    from verl.utils.config import validate_config

    from claas_verl.verl_ext.ray_connect import connect_if_cluster_running
    from claas_verl.verl_ext.transfer_queue_env import cap_transfer_queue_threads

    try:
        cfg = finalize_config(cfg)
    except ValueError as e:
        print(f"claas_verl.main_mopd: error: {e}", file=sys.stderr)
        sys.exit(2)
    validate_config(config=cfg, use_reference_policy=False, use_critic=False)
    cap_transfer_queue_threads()  # before Ray starts: its processes inherit it
    connect_if_cluster_running(cfg)  # inside `ray job submit` or after `ray start`; else run_ppo starts Ray
    run_ppo(cfg, task_runner_class=mopd_task_runner_class())


def mopd_task_runner_class():
    """verl's v1 ``TaskRunner`` whose ``run`` first imports the MOPD trainer module (``register_trainer("mopd")``
    in the runner's own Ray process); see :func:`claas_verl.verl_ext.trainer_base.task_runner_class`."""
    from claas_verl.verl_ext.trainer_base import task_runner_class

    return task_runner_class("claas_verl.mopd.trainer.trainer")


def main() -> None:
    print_help_pointer(sys.argv[1:])  # Hydra's --help lists the recipes; the keys are on docs/config.md
    try:
        sys.argv += runtime_args(sys.argv[1:])
    except ValueError as e:
        print(f"claas_verl.main_mopd: error: {e}", file=sys.stderr)
        sys.exit(2)
    hydra.main(config_path=str(recipes_dir()), config_name=None, version_base=None)(_run)()


if __name__ == "__main__":
    main()
