"""EVERY private verl 0.9.1 name (and private Ray name) the trainers depend on, in one list.

Public extension points are not couplings: ``register_trainer``, the v1 hooks (``on_*``, ``prepare_step``),
the custom v1 sampler, ``TrainingWorker.set_loss_fn``, ``register`` / ``Dispatch`` for worker methods.

Each entry says which code relies on it (``base``: :mod:`claas_verl.verl_ext.trainer_base`, used by both trainers;
``claas``; ``mopd``) and why. ``tests/verl_ext/test_trainer_couplings.py`` checks every entry against the installed
verl (name, source marker, instance assignment) and that every private ``PPOTrainer`` method either trainer
overrides is listed here; the trainers override the listed ``PPOTrainer`` methods directly, and the per-system modules
(:mod:`claas_verl.claas.trainer.verl_couplings`, :mod:`claas_verl.mopd.trainer.verl_couplings`) hold the helpers that
read private worker and engine attributes and expose their system's view of this list.

This module imports nothing from verl (it is data); :func:`owner_object` imports a listed module only when a test
looks a name up.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

TRAINER = "verl.trainer.ppo.v1.trainer_base"
WORKERS = "verl.workers.engine_workers"
ENGINE = "verl.workers.engine.base"
FSDP = "verl.workers.engine.fsdp.transformer_impl"
AGENT_LOOP = "verl.experimental.agent_loop.agent_loop"
AGENT_LOOP_TQ = "verl.trainer.ppo.v1.agent_loop_tq"
TQ_WORKER = "AgentLoopWorkerTQ.__ray_metadata__.modified_class.__ray_actor_class__"  # the plain class of the actor


class Coupling(NamedTuple):
    """``owner.attr`` in ``module``: a class attribute (method) whose existence is checked; an empty ``owner``
    names a module-level attribute."""

    module: str
    owner: str
    attr: str
    users: tuple[str, ...]
    why: str


class SourceMarker(NamedTuple):
    """``marker`` must occur in the source of ``module.owner.attr``: the behaviour the seam assumes."""

    module: str
    owner: str
    attr: str
    marker: str
    users: tuple[str, ...]


class InstanceAttribute(NamedTuple):
    """``needle`` must still be assigned (``needle =``) in the source of ``module.owner.method``."""

    module: str
    owner: str
    method: str
    needle: str
    users: tuple[str, ...]


COUPLINGS: tuple[Coupling, ...] = (
    # ---- PPOTrainer methods overridden or called
    Coupling(TRAINER, "PPOTrainer", "_init_resource_pool_mgr", ("claas", "mopd"),
             "wrapped: worker swap and the placement check after verl built the pools"),
    Coupling(TRAINER, "PPOTrainer", "_init_dataloader", ("claas", "mopd"),
             "claas: replaced (no prompt dataset); mopd: extended with one dataset per domain"),
    Coupling(TRAINER, "PPOTrainer", "_next_train_batch", ("mopd",), "the plan step's block of prompts"),
    Coupling(TRAINER, "PPOTrainer", "_build_replay_buffer", ("mopd",), "the sync sampler's polling interval"),
    Coupling(TRAINER, "PPOTrainer", "_compute_old_log_prob", ("mopd",), "the student's top-k pre-update forward"),
    Coupling(TRAINER, "PPOTrainer", "_compute_advantage", ("mopd",), "teacher log-probs, rewards, advantages"),
    Coupling(TRAINER, "PPOTrainer", "_update_actor", ("mopd",), "the distillation flags of the update"),
    Coupling(TRAINER, "PPOTrainer", "_save_checkpoint", ("base", "claas", "mopd"),
             "extra checkpoint state in verl's global_step_N folder (claas: deferred to the checkpoint point)"),
    Coupling(TRAINER, "PPOTrainer", "_load_checkpoint", ("base", "claas", "mopd"),
             "extra checkpoint state read (claas: before verl loads, from the folder verl will load)"),
    Coupling(TRAINER, "PPOTrainer", "_compute_metrics", ("mopd",), "the step appended to steps.jsonl"),
    Coupling(TRAINER, "PPOTrainer", "_balance_batch", ("mopd",), "called on forgetting-evaluation batches"),
    Coupling(TRAINER, "PPOTrainer", "_consume_sync_metrics", ("claas", "mopd"),
             "reads _pending_sync_metrics, which claas's on_step_end sets (buffer size, evicted entries) and mopd's "
             "weight-sync probe sets (rollout/weight_sync_*)"),
    # ---- workers and engines
    Coupling(WORKERS, "ActorRolloutRefWorker", "actor_worker_cls", ("claas", "mopd"),
             "class-attribute hook selecting the training worker class"),
    Coupling(WORKERS, "TrainingWorker", "train_mini_batch", ("claas",), "SDPO: teacher pass before, EMA after"),
    Coupling(WORKERS, "TrainingWorker", "train_batch", ("mopd",), "balanced multi-pass update on replay steps"),
    Coupling(WORKERS, "TrainingWorker", "infer_batch", ("mopd",),
             "wrapped: collects the processor's top-k outputs and writes one field per quantity"),
    Coupling(ENGINE, "BaseEngine", "train_batch", ("mopd",), "shadowed for one call by the balanced step"),
    Coupling(ENGINE, "BaseEngine", "forward_backward_batch", ("mopd",),
             "re-sequenced by the balanced step (mopd.signal.passes=separate; shared passes replace it for that step)"),
    Coupling("verl.workers.engine.utils", "", "postprocess_batch_func", ("mopd",),
             "called by the shared-pass balanced step: its outputs have forward_backward_batch's shape"),
    Coupling(ENGINE, "BaseEngine", "optimizer_zero_grad", ("claas", "mopd"), "skipped SDPO steps; balanced step"),
    Coupling(ENGINE, "BaseEngine", "optimizer_step", ("claas", "mopd"),
             "claas: shadowed for one update (applied? skip?); mopd: re-sequenced by the balanced step"),
    Coupling(ENGINE, "BaseEngine", "is_mp_src_rank_with_outputs", ("mopd",), "which rank returns outputs"),
    Coupling(ENGINE, "BaseEngine", "eval_mode", ("claas", "mopd"), "no-grad teacher / pre-update forwards"),
    Coupling(FSDP, "FSDPEngine", "_build_lr_scheduler", ("mopd",), "fresh LR schedule per stage"),
    Coupling(FSDP, "FSDPEngineWithLMHead", "prepare_model_outputs", ("claas", "mopd"),
             "the installed loss runs as a logits processor (distillation_use_topk; verl_ext.logits_loss)"),
    Coupling(FSDP, "FSDPEngineWithLMHead", "forward_step", ("claas", "mopd"),
             "per micro-batch: the processor (inside prepare_model_outputs), then the loss, on the same micro-batch "
             "object; verl_ext.logits_loss hands the processor's [1, N, K] outputs to that loss call past verl"),
    # ---- Ray (private): verl exposes its task runner only as a Ray actor class
    Coupling("verl.trainer.main_ppo", "TaskRunnerV1", "__ray_metadata__", ("base",),
             "__ray_metadata__.modified_class.__ray_actor_class__ is the plain runner class (base.task_runner_class)"),
    # ---- the agent loop (verl_ext.agent_loop, selected by rollout.agent.agent_loop_manager_class)
    Coupling(AGENT_LOOP, "", "_agent_loop_registry", ("mopd",),
             "agent name -> Hydra config; read to tell a stateless single-turn loop from any other"),
    Coupling(AGENT_LOOP, "AgentLoopWorker", "_run_agent_loop", ("mopd",),
             "overridden: a stateless agent loop is built once per worker, any other per reply by verl"),
    Coupling(AGENT_LOOP, "AgentLoopWorker", "_agent_loop_postprocess", ("mopd",),
             "called after the shared loop's run, as verl's _run_agent_loop calls it (TQ: scores, writes the reply)"),
    Coupling(AGENT_LOOP_TQ, "AgentLoopWorkerTQ", "__ray_metadata__", ("mopd",),
             "__ray_metadata__.modified_class.__ray_actor_class__ is the plain TQ worker class it subclasses"),
    Coupling(AGENT_LOOP_TQ, TQ_WORKER, "_run_prompt", ("mopd",),
             "overridden: opens the prompt's row group that its sessions fill and the last one writes"),
    Coupling(AGENT_LOOP_TQ, TQ_WORKER, "_agent_loop_postprocess", ("mopd",),
             "overridden: inside a prompt run, builds verl's rows without writing them (one put per prompt)"),
    Coupling(AGENT_LOOP, "AgentLoopWorker", "_compute_score", ("mopd",), "the reward call of verl's post-process"),
    Coupling(AGENT_LOOP, "AgentLoopWorker", "_compute_teacher_logprobs", ("mopd",),
             "verl's teacher log-probs of its post-process (a no-op without verl's own distillation)"),
    Coupling(AGENT_LOOP, "AgentLoopWorker", "_compute_multi_modal_inputs", ("mopd",), "a row's multi_modal_inputs"),
    Coupling(AGENT_LOOP, "AgentLoopWorker", "_compute_position_ids", ("mopd",), "a row's position_ids"),
    # ---- the single-controller worker group (read, not overridden)
    Coupling("verl.single_controller.base.worker", "Worker", "_query_dispatch_info", ("mopd",),
             "fills worker_group._dispatch_info, read for the data-parallel size (canonical row order); "
             "if it vanished the trainer would silently assume one rank"),
)

SOURCE_MARKERS: tuple[SourceMarker, ...] = (
    SourceMarker(FSDP, "FSDPEngineWithLMHead", "prepare_model_outputs", "distillation_use_topk", ("claas", "mopd")),
    SourceMarker(FSDP, "FSDPEngineWithLMHead", "prepare_model_outputs", "logits_processor_func(student_logits=",
                 ("claas", "mopd")),
    SourceMarker(FSDP, "FSDPEngineWithLMHead", "prepare_model_outputs", "if not distillation_only:", ("claas", "mopd")),
    # the processor's one slot field: verl accepts exactly one value per packed token (logits rows), nested per row
    SourceMarker(FSDP, "FSDPEngineWithLMHead", "prepare_model_outputs",
                 "assert v.shape == (logits_rmpad.shape[0],)", ("claas", "mopd")),
    # the hand-off: the loss call right after the processor, on the same micro-batch object
    SourceMarker(FSDP, "FSDPEngineWithLMHead", "forward_step", "logits_processor_func=loss_function",
                 ("claas", "mopd")),
    SourceMarker(FSDP, "FSDPEngineWithLMHead", "forward_step", "model_output=model_output, data=micro_batch",
                 ("claas", "mopd")),
    # forward (processor + loss) then backward, micro-batch by micro-batch (gradient accumulation), one output list
    SourceMarker(FSDP, "FSDPEngine", "forward_backward_batch",
                 "self.forward_step(micro_batch, loss_function=loss_function", ("claas", "mopd")),
    SourceMarker(FSDP, "FSDPEngine", "forward_backward_batch",
                 "postprocess_batch_func(output_lst=output_lst, indices=indices, data=data)", ("mopd",)),
    # postprocess_batch_func concatenates the micro-batches' processor fields and undoes the dynamic-batch reorder:
    # the one slot field of verl_ext.logits_loss rides it, so the worker reads the kept outputs in the batch's order
    SourceMarker("verl.workers.engine.utils", "", "postprocess_batch_func",
                 "restore_dynamic_batch(model_output[key], indices)", ("mopd",)),
    # the micro-batch's non-tensor sp_size, read by verl_ext.logits_loss to refuse Ulysses sequence parallelism
    SourceMarker(FSDP, "FSDPEngine", "forward_backward_batch", "sp_size=self.ulysses_sequence_parallel_size",
                 ("claas", "mopd")),
    SourceMarker(TRAINER, "PPOTrainer", "_init_resource_pool_mgr", "self.role_worker_mapping", ("base",)),
    # the placement check (claas_verl.preflight.placement) reads the manager verl builds there
    SourceMarker(TRAINER, "PPOTrainer", "_init_resource_pool_mgr", "self.resource_pool_manager =", ("base",)),
    SourceMarker(TRAINER, "PPOTrainer", "fit", "self._save_checkpoint()", ("claas",)),
    SourceMarker(TRAINER, "PPOTrainer", "_save_checkpoint", "latest_checkpointed_iteration.txt", ("claas",)),
    SourceMarker(TRAINER, "PPOTrainer", "_load_checkpoint", "find_latest_ckpt_path", ("claas",)),
    # stop_after_this_step: the loop condition is re-read every step
    SourceMarker(TRAINER, "PPOTrainer", "fit", "self.global_steps <= self.total_training_steps", ("base",)),
    # hidden_verl_progress_bar: the bar is built through the module's own ``tqdm`` name, before on_train_begin
    SourceMarker(TRAINER, "PPOTrainer", "fit", "progress_bar = tqdm(total=self.total_training_steps", ("claas",)),
    # trainer_mode is read as the sync/async switch (VerlSeams keeps it "sync")
    SourceMarker(TRAINER, "PPOTrainer", "_init_dataloader", 'self.trainer_mode != "sync"', ("base",)),
    SourceMarker(TRAINER, "PPOTrainer", "_consume_sync_metrics", "self._pending_sync_metrics", ("claas", "mopd")),
    # canonical row order reads the data-parallel size from the mapping verl's dispatch caches
    SourceMarker("verl.single_controller.base.decorator", "", "dispatch_lazy_compute_data_proto",
                 "worker_group._dispatch_info[mesh_name] =", ("mopd",)),
    SourceMarker(WORKERS, "TrainingWorker", "train_batch", "self.engine.train_batch(data, loss_function=self.loss_fn)",
                 ("mopd",)),
    # verl_ext.agent_loop builds the shared loop with the very arguments verl passes per reply, then does what
    # verl does after the build: run, then post-process
    SourceMarker(AGENT_LOOP, "AgentLoopWorker", "_run_agent_loop", "tools=ToolListWrap(self.tools),", ("mopd",)),
    SourceMarker(AGENT_LOOP, "AgentLoopWorker", "_run_agent_loop", "data_config=DictConfigWrap(self.config.data),",
                 ("mopd",)),
    SourceMarker(AGENT_LOOP, "AgentLoopWorker", "_run_agent_loop",
                 "return await self._agent_loop_postprocess(output, trajectory[\"validate\"], **kwargs)", ("mopd",)),
    # ... and writes the rows verl's TQ post-process writes, with the session count verl's _run_prompt starts; the
    # rows go before the prompt's terminal status, which verl puts after every session settled
    *(SourceMarker(AGENT_LOOP_TQ, TQ_WORKER, "_agent_loop_postprocess", marker, ("mopd",)) for marker in (
        "await self._compute_score(outputs, kwargs=kwargs)",
        "output.reward_score = final_output.reward_score",
        "input_ids.unsqueeze(0), attention_mask.unsqueeze(0), multi_modal_inputs",
        'keys.append(f"{uid}_{session_id}_{i}")',
        'field.pop("multi_modal_data", None)',
        'field["loss_mask"] = field["response_mask"]',
        '"seq_len": prompt_len + response_len,',
        '"min_global_steps": field["extra_fields"].get("min_global_steps"),',
        "fields=list_of_dict_to_tensordict(fields),")),
    *(SourceMarker(AGENT_LOOP_TQ, TQ_WORKER, "_run_prompt", marker, ("mopd",)) for marker in (
        'n = prompt.pop("__rollout_n__", config.n if not trajectory["validate"] else config.val_kwargs.n)',
        "self._run_agent_loop(",
        "session_errors = await _settle_session_tasks(tasks)")),
    # the manager's worker class is the attribute verl's _init_agent_loop_workers instantiates
    SourceMarker(AGENT_LOOP, "AgentLoopManager", "_init_agent_loop_workers", "self.agent_loop_workers_class.options(",
                 ("mopd",)),
)

INSTANCE_ATTRIBUTES: tuple[InstanceAttribute, ...] = (
    InstanceAttribute(TRAINER, "PPOTrainer", "__init__", "self.trainer_mode", ("base",)),
    # verl's own name for its sampler (claas: the ClaasReplaySampler; mopd: the sync sampler)
    InstanceAttribute(TRAINER, "PPOTrainer", "__init__", "self.replay_buffer", ("claas", "mopd")),
    InstanceAttribute(TRAINER, "PPOTrainer", "_init_resource_pool_mgr", "self.resource_pool_manager", ("base",)),
    InstanceAttribute(TRAINER, "PPOTrainer", "_init_dataloader", "self.total_training_steps", ("base",)),
    InstanceAttribute(TRAINER, "PPOTrainer", "_init_dataloader", "self.steps_per_epoch", ("base",)),
    InstanceAttribute(TRAINER, "PPOTrainer", "_consume_sync_metrics", "self._pending_sync_metrics", ("claas", "mopd")),
    # mopd: the balanced step's optimizer; claas: a tenant's AdamW state and schedule swapped in and out
    InstanceAttribute(FSDP, "FSDPEngine", "_build_model_optimizer", "self.optimizer", ("claas", "mopd")),
    InstanceAttribute(FSDP, "FSDPEngine", "_build_model_optimizer", "self.lr_scheduler", ("claas", "mopd")),
    InstanceAttribute(FSDP, "FSDPEngine", "initialize", "self.checkpoint_manager", ("mopd",)),
    # the student / teacher nn.Module (FSDP2-wrapped): claas's SDPO forwards, mopd's alignment forwards
    InstanceAttribute(FSDP, "FSDPEngine", "_build_model_optimizer", "self.module", ("claas", "mopd")),
    InstanceAttribute(FSDP, "FSDPEngine", "_build_fsdp_module", "self.scaler", ("mopd",)),
    # the dtype of the autocast verl wraps every forward in (= mixed_precision.param_dtype)
    InstanceAttribute(FSDP, "FSDPEngine", "_build_fsdp_module", "self._autocast_dtype", ("mopd",)),
    # the sync sampler's sleep between looks at TransferQueue (set from mopd.sampler_poll_s)
    InstanceAttribute("verl.trainer.ppo.v1.replay_buffer", "ReplayBuffer", "__init__", "self.poll_interval",
                      ("mopd",)),
    # worker_group._dispatch_info[mesh] = rank -> data-parallel rank (filled by the dispatch above)
    InstanceAttribute("verl.single_controller.base.worker_group", "WorkerGroup", "__init__", "self._dispatch_info",
                      ("mopd",)),
)


def owner_object(module: str, owner: str):
    """The object a listed name lives on: ``module.owner`` (a dotted path of attributes), or the module itself when
    ``owner`` is empty."""
    obj = importlib.import_module(module)
    for name in owner.split(".") if owner else ():
        obj = getattr(obj, name)
    return obj


def _uses(users: tuple[str, ...], system: str) -> bool:
    return system in users or "base" in users  # both trainers stand on the shared base


def couplings_of(system: str) -> tuple[tuple[str, str, str], ...]:
    """(module, owner, attribute) of the couplings ``system`` (``claas`` or ``mopd``, the base included) relies on."""
    return tuple((c.module, c.owner, c.attr) for c in COUPLINGS if _uses(c.users, system))


def source_markers_of(system: str) -> tuple[tuple[str, str, str, str], ...]:
    return tuple((m.module, m.owner, m.attr, m.marker) for m in SOURCE_MARKERS if _uses(m.users, system))


def instance_attributes_of(system: str) -> tuple[tuple[str, str], ...]:
    """(``Owner.method``, ``self.attr``) pairs, the layout the MOPD coupling test reads."""
    return tuple((f"{a.owner}.{a.method}", a.needle) for a in INSTANCE_ATTRIBUTES if _uses(a.users, system))
