"""The `claas:` block and the verl settings the CLaaS trainer refuses (each error names the key and the fix)."""

from __future__ import annotations

import os

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from claas_verl.claas.trainer import ClaasConfig

RECIPES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "recipes")
ALL_RECIPES = ["reinforce_pp", "ppo", "sdpo", "icl", "reinforce_pp scale=tiny", "ppo scale=tiny", "sdpo scale=tiny",
               "icl scale=tiny", "no_update scale=tiny"]


def compose_recipe(spelling: str, overrides=()):
    """``claas/<recipe>`` with the spelling's overrides (``"sdpo scale=tiny"``: docs/recipes.md), then ``overrides``."""
    name, *spelled = spelling.split()
    with initialize_config_dir(config_dir=os.path.abspath(RECIPES), version_base=None):
        return compose(config_name=f"claas/{name}", overrides=[*spelled, *overrides])


def test_sizes_and_keys_are_validated():
    with pytest.raises(ValueError, match="m .* must be <= b_min"):
        ClaasConfig.from_config({"m": 8, "b_min": 4})
    with pytest.raises(ValueError, match="b_min = 20 must be <= b_max"):
        ClaasConfig.from_config({"m": 4, "b_min": 20, "b_max": 10})
    with pytest.raises(ValueError, match=r"claas.stream: unknown key\(s\) \['splits'\]"):
        ClaasConfig.from_config({"stream": {"splits": 3}})
    with pytest.raises(ValueError, match="entry_unit"):
        ClaasConfig.from_config({"entry_unit": "turn"})
    with pytest.raises(ValueError, match="entry_unit=scenario with claas.algorithm=sdpo"):
        ClaasConfig.from_config({"entry_unit": "scenario", "algorithm": "sdpo"})
    assert ClaasConfig.from_config({"entry_unit": "scenario"}).entry_unit == "scenario"
    with pytest.raises(ValueError, match="claas.algorithm"):
        ClaasConfig.from_config({"algorithm": "grpo"})


def test_baselines_do_not_train():
    assert ClaasConfig.from_config({"algorithm": "reinforce_pp"}).trains
    assert not ClaasConfig.from_config({"algorithm": "icl"}).trains
    assert not ClaasConfig.from_config({"algorithm": "no_update"}).trains
    with pytest.raises(ValueError, match="service.enabled with claas.algorithm=no_update"):
        ClaasConfig.from_config({"algorithm": "no_update", "service": {"enabled": True}})


@pytest.mark.parametrize("name", ALL_RECIPES)
def test_every_recipe_composes_with_the_paper_or_tiny_settings(name):
    cfg = compose_recipe(name)
    c = ClaasConfig.from_config(cfg.claas)
    assert cfg.trainer.v1.trainer_mode == "claas"
    assert cfg.actor_rollout_ref.model.lora_rank == 16
    if name.endswith("scale=tiny"):
        assert cfg.actor_rollout_ref.rollout.name == "hf" and cfg.trainer.device == "cpu"
    else:
        # the papers' settings: LoRA r=16, lr 1e-4, M=8, B_max=1000, A_max 25/25/50, B_min feasible per split
        assert (c.m, c.b_max, cfg.actor_rollout_ref.actor.optim.lr) == (8, 1000, 1e-4)
        assert c.a_max == {"reinforce_pp": 25, "ppo": 25, "sdpo": 50, "icl": 25}[name]
        assert c.b_min <= c.stream.split_size * c.env.kwargs["num_turns"]
    assert c.algorithm == name.split()[0]
    if c.algorithm == "ppo":
        assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.enable


@pytest.mark.parametrize("name", ["service", "service scale=tiny"])
def test_service_recipes_run_the_chat_api_as_the_only_source(name):
    cfg = compose_recipe(name)
    c = ClaasConfig.from_config(cfg.claas)
    assert c.service.enabled and not c.producer.enabled and not c.eval.enabled
    assert (c.service.host, c.service.port, c.service.reward, c.algorithm) == ("127.0.0.1", 8000, "binary",
                                                                             "reinforce_pp")
    assert cfg.actor_rollout_ref.rollout.name == ("hf" if name.endswith("scale=tiny") else "vllm")
    with pytest.raises(ValueError, match="nothing would ever reach the buffer"):
        ClaasConfig.from_config({"producer": {"enabled": False}})
    # SDPO works behind the chat API (the feedback text is the teacher context: claas_verl/claas/service/teacher.py)
    sdpo = ClaasConfig.from_config({"algorithm": "sdpo", "producer": {"enabled": False}, "service": {"enabled": True}})
    assert sdpo.service.enabled and sdpo.algorithm == "sdpo"
    with pytest.raises(ValueError, match="claas.service.reward"):
        ClaasConfig.from_config({"service": {"reward": "float"}})


def test_trainer_rejects_settings_that_break_the_contract():
    from claas_verl.claas.trainer.trainer import check_claas_config

    cfg = compose_recipe("reinforce_pp scale=tiny")
    claas = ClaasConfig.from_config(cfg.claas)
    check_claas_config(cfg, claas)  # the recipe itself is fine
    cases = [
        ("actor_rollout_ref.rollout.temperature", 0.7, "temperature 1"),
        ("actor_rollout_ref.rollout.n", 4, "single trajectories"),
        ("algorithm.rollout_correction.bypass_mode", False, "old log-probs"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla", "claas_seq_is"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", 2, "one optimizer step"),
        ("trainer.test_freq", 5, "claas.eval"),
        ("trainer.v1.sampler.custom_sampler.path", None, "ClaasReplaySampler|claas_verl.claas.trainer.sampler"),
        ("trainer.n_gpus_per_node", 3, "split evenly over the 3 training ranks"),
    ]
    for key, value, msg in cases:
        bad = compose_recipe("reinforce_pp scale=tiny")
        with open_dict(bad):
            parent, leaf = key.rsplit(".", 1)
            node = bad
            for part in parent.split("."):
                node = node[part]
            node[leaf] = value
        with pytest.raises(ValueError, match=key.replace(".", r"\.")) as err:
            check_claas_config(bad, claas)
        assert any(m in str(err.value) for m in msg.split("|")), str(err.value)
    # two ranks: the tiny recipes' micro-batch is one rank's share, claas.m / 2 = 2, so the rank count is the only key
    two = compose_recipe("reinforce_pp scale=tiny", ["trainer.n_gpus_per_node=2"])
    assert two.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 2
    assert two.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 2
    check_claas_config(two, claas)
    assert compose_recipe("ppo scale=tiny", ["trainer.n_gpus_per_node=2"]).critic.ppo_micro_batch_size_per_gpu == 2
    # a micro-batch that does not divide a rank's share would stop the first update deep inside verl's
    # prepare_micro_batches in a Ray worker: refused before Ray, naming the key
    with open_dict(two):
        two.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 4
    with pytest.raises(ValueError, match=r"ppo_micro_batch_size_per_gpu=4: each of the 2 training ranks gets .* = 2"):
        check_claas_config(two, claas)
    sdpo = compose_recipe("sdpo scale=tiny")
    sdpo_claas = ClaasConfig.from_config(sdpo.claas)
    check_claas_config(sdpo, sdpo_claas)  # SDPO runs (claas_verl.claas.trainer.sdpo_worker)
    assert sdpo_claas.sdpo.mode == "gjs" and sdpo_claas.sdpo.alpha == 0.5 and sdpo_claas.sdpo.tau == 0.05
    with open_dict(sdpo):
        sdpo.actor_rollout_ref.model.lora_rank = 0
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.model\.lora_rank"):
        check_claas_config(sdpo, sdpo_claas)  # the EMA teacher lives on the LoRA adapter


@pytest.mark.parametrize("key,value", [("mode", "kl"), ("is_reference", "ref"), ("alpha", 1.5), ("topk", 0),
                                       ("tau", 2.0), ("is_clip", 0.0)])
def test_sdpo_block_rejects_bad_values_naming_the_key(key, value):
    with pytest.raises(ValueError, match=f"claas.sdpo.{key}"):
        ClaasConfig.from_config({"algorithm": "sdpo", "m": 4, "b_min": 4, "b_max": 64, "sdpo": {key: value}})


@pytest.mark.parametrize("name", ALL_RECIPES)
def test_every_recipe_schedule_does_not_depend_on_an_unknown_step_count(name):
    from claas_verl.claas.trainer.checks import check_schedule_without_step_count

    # a stream-driven recipe whose schedule spans the placeholder step count would fail here
    check_schedule_without_step_count(compose_recipe(name))


@pytest.mark.parametrize("overrides, key", [
    (["actor_rollout_ref.actor.optim.lr_scheduler_type=cosine"], "actor_rollout_ref.actor.optim.lr_scheduler_type"),
    (["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1"],
     "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio"),
    (["critic.optim.lr_scheduler_type=cosine"], "critic.optim.lr_scheduler_type"),
])
def test_a_run_without_max_updates_refuses_a_schedule_sized_by_the_step_count(overrides, key):
    from claas_verl.claas.trainer.checks import check_claas_config

    cfg = compose_recipe("ppo scale=tiny", overrides)
    claas = ClaasConfig.from_config(cfg.claas)
    assert claas.max_updates is None
    with pytest.raises(ValueError, match=key.replace(".", r"\.") + ".*claas.max_updates"):
        check_claas_config(cfg, claas)
    # a cap gives the schedule its length; a warm-up in updates does not need one
    capped = compose_recipe("ppo scale=tiny", [*overrides, "claas.max_updates=20"])
    check_claas_config(capped, ClaasConfig.from_config(capped.claas))
    if "ratio" in key:
        steps = compose_recipe("ppo scale=tiny", [*overrides, "actor_rollout_ref.actor.optim.lr_warmup_steps=5"])
        check_claas_config(steps, ClaasConfig.from_config(steps.claas))


@pytest.mark.parametrize("name", [n for n in ALL_RECIPES if n.endswith("scale=tiny")])
def test_tiny_recipes_seed_the_random_initialisation_from_claas_seed(name):
    # verl seeds a worker's RNG (LoRA's A matrices, the critic's value head) only with full_determinism; the
    # continual benchmark's runs must be a function of their seed keys
    cfg = compose_recipe(name, ["claas.seed=7"])
    actor = cfg.actor_rollout_ref.actor.fsdp_config
    assert actor.full_determinism is True and actor.seed == 7
    if cfg.critic.get("enable"):
        assert cfg.critic.fsdp.full_determinism is True and cfg.critic.fsdp.seed == 7
