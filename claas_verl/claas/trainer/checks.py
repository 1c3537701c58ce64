"""verl settings the CLaaS contract needs, checked before Ray starts; each error names the key and the fix."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from claas_verl.claas.trainer.config import ClaasConfig

SAMPLER_PATH = "pkg://claas_verl.claas.trainer.sampler"
SAMPLER_NAME = "ClaasReplaySampler"


def select(config: Any, dotted: str, default: Any = None) -> Any:
    value = OmegaConf.select(config, dotted, default=default)
    return default if value is None else value


def check_claas_config(config: Any, claas: ClaasConfig) -> None:
    """Reject verl settings that would silently break the CLaaS contract; each error names the key and the fix."""
    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ValueError(f"{key}={select(config, key)!r}: {why}")

    rollout = "actor_rollout_ref.rollout"
    need(float(select(config, f"{rollout}.temperature", 1.0)) == 1.0, f"{rollout}.temperature",
         "CLaaS entries must be sampled at temperature 1 (docs/math.md §0: behaviour log-probs of the sampled "
         "distribution); set it to 1.0 (evaluation temperature is claas.eval.temperature)")
    need(int(select(config, f"{rollout}.n", 1)) == 1, f"{rollout}.n",
         "CLaaS draws single trajectories from the buffer (no GRPO groups); set it to 1")
    sampler = select(config, "trainer.v1.sampler.custom_sampler.path")
    need(sampler in (SAMPLER_PATH, SAMPLER_PATH.replace(".", "/")), "trainer.v1.sampler.custom_sampler.path",
         f"set it to {SAMPLER_PATH} (name {SAMPLER_NAME}) so steps are fed from the replay buffer")
    need(select(config, "trainer.v1.sampler.custom_sampler.name") == SAMPLER_NAME,
         "trainer.v1.sampler.custom_sampler.name", f"set it to {SAMPLER_NAME}")
    need(int(select(config, "trainer.test_freq", -1)) <= 0, "trainer.test_freq",
         "CLaaS evaluates split checkpoints itself (claas.eval); set it to -1")
    need(not bool(select(config, "trainer.val_before_train", False)), "trainer.val_before_train", "set it to false")
    if not claas.trains:
        return
    need(int(select(config, "data.train_batch_size", 0)) == claas.m, "data.train_batch_size",
         f"one update draws claas.m={claas.m} entries; set it to ${{claas.m}}")
    need(int(select(config, "actor_rollout_ref.actor.ppo_mini_batch_size", 0)) == claas.m,
         "actor_rollout_ref.actor.ppo_mini_batch_size",
         "one optimizer step per sampled minibatch (docs/math.md §A.1.6); set it to ${claas.m}")
    # verl splits the update batch evenly over the data-parallel ranks, then each rank's share into micro-batches
    ranks = int(select(config, "trainer.nnodes", 1)) * int(select(config, "trainer.n_gpus_per_node", 1))
    need(claas.m % ranks == 0, "trainer.n_gpus_per_node",
         f"claas.m={claas.m} entries per update must split evenly over the {ranks} training ranks")
    per_rank = claas.m // ranks
    key = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    micro = select(config, key, None)
    need(micro is None or bool(select(config, "actor_rollout_ref.actor.use_dynamic_bsz", False))
         or per_rank % int(micro) == 0, key,
         f"each of the {ranks} training ranks gets claas.m / {ranks} = {per_rank} entries per update; set it to a "
         f"divisor of {per_rank}")
    need(int(select(config, "actor_rollout_ref.actor.ppo_epochs", 1)) == 1, "actor_rollout_ref.actor.ppo_epochs",
         "each sampled minibatch gives exactly one update; set it to 1")
    need(bool(select(config, "algorithm.rollout_correction.bypass_mode", False)),
         "algorithm.rollout_correction.bypass_mode",
         "the stored behaviour log-probs are the old log-probs of the IS ratio; set it to true")
    loss_mode = select(config, "actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla")
    need(str(loss_mode).startswith("claas_seq_is"), "actor_rollout_ref.actor.policy_loss.loss_mode",
         "only a per-sequence behaviour log-prob is stored, so a per-token ratio is meaningless; use claas_seq_is")
    if claas.max_updates is None:
        check_schedule_without_step_count(config)
    if claas.algorithm == "sdpo":
        need(int(select(config, "actor_rollout_ref.model.lora_rank", 0)) > 0, "actor_rollout_ref.model.lora_rank",
             "the SDPO EMA teacher is kept over the LoRA adapter (docs/math.md §A.3.3); set a LoRA rank > 0")
        need(not bool(select(config, "critic.enable", False)), "critic.enable", "SDPO trains no critic; set it false")
    if claas.service.tenant_names:
        need(serves_lora_adapter(config), "actor_rollout_ref.model.lora_rank",
             "claas.service.tenants trains one LoRA adapter per tenant over shared base weights; set a LoRA rank "
             "> 0 with actor_rollout_ref.model.lora.merge=false")
        need(not bool(select(config, "critic.enable", False)), "critic.enable",
             "a multi-tenant job trains no critic (one per tenant is not built); set it false")
        need(select(config, "actor_rollout_ref.model.lora_adapter_path") is None,
             "actor_rollout_ref.model.lora_adapter_path",
             "every tenant's version 0 is served as the base model (a fresh LoRA has B = 0); a job whose tenants "
             "start from a pre-trained adapter is not supported: remove it")


def check_schedule_without_step_count(config: Any) -> None:
    """A stream-driven run (``claas.max_updates`` null) has no step count for an LR schedule to span.

    verl sizes its schedules from ``optim.total_training_steps``, which such a run sets to a placeholder far beyond
    any real run: a cosine decay would then never decay and a warm-up given as a ratio would never end. Both are
    refused, naming the key; a constant schedule with its warm-up in steps does not depend on the count.
    """
    for role in ("actor_rollout_ref.actor", "critic"):
        if role == "critic" and not bool(select(config, "critic.enable", False)):
            continue
        optim = f"{role}.optim"
        kind = select(config, f"{optim}.lr_scheduler_type", None) or select(config, f"{optim}.warmup_style", "constant")
        if str(kind) != "constant":
            raise ValueError(
                f"{optim}.lr_scheduler_type={kind!r} with claas.max_updates=null: a stream-driven run has no step "
                "count for the schedule to span, so it would never decay; set claas.max_updates=N (the schedule then "
                "spans N updates) or use lr_scheduler_type=constant")
        ratio = float(select(config, f"{optim}.lr_warmup_steps_ratio", 0.0))
        steps = int(select(config, f"{optim}.lr_warmup_steps", -1))
        if ratio > 0 and steps <= 0:
            raise ValueError(
                f"{optim}.lr_warmup_steps_ratio={ratio} with claas.max_updates=null: a ratio of an unknown step "
                f"count never ends the warm-up; give it in updates ({optim}.lr_warmup_steps=N) or set "
                "claas.max_updates")


def serves_lora_adapter(config: Any) -> bool:
    """The rollout serves a LoRA adapter (rank > 0, not merged into the base weights)."""
    rank = max(int(select(config, "actor_rollout_ref.model.lora_rank", 0) or 0),
               int(select(config, "actor_rollout_ref.model.lora.rank", 0) or 0))
    return rank > 0 and not bool(select(config, "actor_rollout_ref.model.lora.merge", False))
