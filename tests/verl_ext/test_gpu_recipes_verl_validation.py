"""Every GPU recipe, composed exactly as its entry point composes it, passes verl's own start-up validation.

``main_mopd``: the recipe + verl's search path + the ``gpu`` runtime group (:func:`claas_verl.main_mopd.runtime_args`),
then its own :func:`~claas_verl.main_mopd.finalize_config` and verl's ``validate_config`` with the arguments it passes.
``main_claas``: the recipe (it composes verl's ``ppo_trainer`` itself), verl's ``auto_set_device`` and
``validate_config(use_reference_policy=need_reference_policy, use_critic=need_critic)``. Then the config dataclasses
the workers build at start-up (the model, actor, rollout and checkpoint configs; the teachers' engine config as the
MOPD worker converts it; the critic's). Model paths point at the tiny bundle, as a user points them at local
checkpoints. verl's ``validate_config`` imports vLLM for a LoRA recipe on the vLLM rollout (every CLaaS GPU recipe),
so that part runs where vLLM is importable (``make test-vllm``); the dataclass checks run everywhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

REPO = Path(__file__).resolve().parents[2]
MOPD_GPU = sorted(p.stem for p in (REPO / "recipes" / "mopd").glob("*.yaml")
                  if not p.stem.startswith(("tiny_", "gym_")))  # tiny_*/gym_*: the CPU recipes
CLAAS_GPU = sorted(p.stem for p in (REPO / "recipes" / "claas").glob("*.yaml") if not p.stem.startswith("tiny_"))


@pytest.fixture(scope="module")
def tiny_root():
    from claas_verl.tiny import ensure_tiny

    return Path(ensure_tiny().root)


def compose_mopd(recipe: str, tiny_root: Path):
    """``python -m claas_verl.main_mopd --config-name mopd/<recipe>`` on a GPU node, with local model paths."""
    from claas_verl.main_mopd import finalize_config, runtime_args
    from claas_verl.paths import recipes_dir

    with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
        cfg = compose(config_name=f"mopd/{recipe}", overrides=runtime_args([], group="gpu"))
    with open_dict(cfg):  # the user's local checkpoints and prompt files (the tiny bundle's here)
        cfg.mopd.student = str(tiny_root / "student")
        for d in cfg.mopd.domains:
            cfg.mopd.domains[d].expert = str(tiny_root / "experts" / "logic")
            cfg.mopd.domains[d].prompts = str(tiny_root / "data" / "logic" / "train.parquet")
    return finalize_config(cfg)


def compose_claas(recipe: str, tiny_root: Path):
    """``python -m claas_verl.main_claas --config-name claas/<recipe> actor_rollout_ref.model.path=<local>``."""
    from verl.utils.device import auto_set_device

    from claas_verl.paths import recipes_dir

    with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
        cfg = compose(config_name=f"claas/{recipe}",
                      overrides=[f"actor_rollout_ref.model.path={tiny_root / 'student'}"])
    auto_set_device(cfg)
    return cfg


def build_worker_configs(cfg, teacher_path: str | None = None) -> dict:
    """The dataclasses verl's workers build from ``cfg`` at start-up (each conversion runs its own checks)."""
    from verl.trainer.ppo.utils import need_critic
    from verl.utils.config import omega_conf_to_dataclass

    arr = cfg.actor_rollout_ref
    n_gpus = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    out = {
        "model": omega_conf_to_dataclass(arr.model),
        "actor": omega_conf_to_dataclass(arr.actor),
        "rollout": omega_conf_to_dataclass(arr.rollout),
        "checkpoint_engine": omega_conf_to_dataclass(arr.rollout.checkpoint_engine),
    }
    out["actor"].validate(n_gpus, cfg.data.train_batch_size, arr.model)
    if teacher_path is not None:  # the MOPD worker's conversion of the ref section (one engine per teacher)
        from claas_verl.mopd.trainer.verl_couplings import teacher_training_config

        out["teacher"] = teacher_training_config(arr, teacher_path, str(cfg.mopd.train.teacher_dtype))
    if need_critic(cfg):
        critic = omega_conf_to_dataclass(cfg.critic)
        critic.validate(n_gpus, cfg.data.train_batch_size)
        out["critic"] = critic
    return out


@pytest.mark.parametrize("recipe", MOPD_GPU)
def test_mopd_gpu_recipe_passes_verl_validation(recipe, tiny_root):
    from verl.utils.config import validate_config

    from claas_verl.mopd.config_train import check_teacher_dtype
    from claas_verl.mopd.trainer.config_checks import check_one_update_per_step

    cfg = compose_mopd(recipe, tiny_root)
    assert cfg.trainer.device == "cuda" and cfg.actor_rollout_ref.rollout.name == "vllm"
    validate_config(config=cfg, use_reference_policy=False, use_critic=False)  # as main_mopd calls it
    built = build_worker_configs(cfg, teacher_path=str(tiny_root / "experts" / "logic"))
    assert built["actor"].strategy == "fsdp2" and built["teacher"].engine_config.forward_only
    # the MOPD trainer's own start-up checks on the verl keys
    actor = cfg.actor_rollout_ref.actor
    check_one_update_per_step(int(cfg.mopd.block_size), actor.ppo_mini_batch_size, actor.ppo_epochs)
    check_teacher_dtype(cfg.mopd.train.teacher_dtype)


@pytest.mark.parametrize("recipe", CLAAS_GPU)
def test_claas_gpu_recipe_builds_verl_worker_configs(recipe, tiny_root):
    cfg = compose_claas(recipe, tiny_root)
    assert cfg.actor_rollout_ref.rollout.name == "vllm"
    built = build_worker_configs(cfg)
    assert ("critic" in built) == (cfg.claas.algorithm == "ppo")


@pytest.mark.vllm
@pytest.mark.parametrize("recipe", CLAAS_GPU)
def test_claas_gpu_recipe_passes_verl_validation(recipe, tiny_root):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    cfg = compose_claas(recipe, tiny_root)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))


def test_the_check_catches_an_unset_critic_micro_batch(tiny_root):
    """What ``claas/ppo`` shipped with: verl refuses a critic without ``ppo_micro_batch_size(_per_gpu)``."""
    cfg = compose_claas("ppo", tiny_root)
    with open_dict(cfg):
        cfg.critic.ppo_micro_batch_size_per_gpu = None
    with pytest.raises(Exception, match=r"critic\.micro_batch_size"):  # hydra wraps verl's ValueError
        build_worker_configs(cfg)
    assert OmegaConf.select(compose_claas("ppo", tiny_root), "critic.ppo_micro_batch_size_per_gpu") is not None
