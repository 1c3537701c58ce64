"""Ray worker of the MOPD trainer: verl's hybrid actor/rollout worker plus teachers and a stage-aware optimizer.

:class:`MOPDWorker` extends ``ActorRolloutRefWorker`` through its extension points only:

* ``actor_worker_cls = MOPDTrainingWorker`` (a ``TrainingWorker`` whose ``train_batch`` can run the balanced
  multi-pass update of docs/math.md §B.6/B.7 before the one optimizer step, single pass otherwise, and whose
  ``infer_batch`` hands TransferQueue the student's top-κ as one field per quantity, :func:`fold_topk_outputs`);
* ``init_model`` installs :class:`claas_verl.mopd.trainer.loss.MOPDLoss` on the student engine and declares a
  ``teacher`` dispatch mesh (teachers live in the same processes and data-parallel layout as the student,
  like verl's colocated reference model);
* new registered methods: ``mopd_set_teachers`` (load/drop forward-only teacher engines by plan name, e.g. at a
  stage boundary, from a Hugging Face directory), ``mopd_teacher_forward`` (teacher log-probs at the student's
  stored ids; with the non-tensor ``mopd_aux`` also the teacher's bf16 alignment targets, kept in this process for
  the same step's student update), ``mopd_reset_optimizer`` (fresh AdamW state per stage) and
  ``mopd_optimizer_steps``.
"""

from __future__ import annotations

import functools
import logging

from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import ActorConfig
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from claas_verl.align.balance import HostBalancer
from claas_verl.align.carried import CarriedBalance
from claas_verl.mopd.trainer import alignment
from claas_verl.mopd.trainer import fields as token_fields
from claas_verl.mopd.trainer import verl_couplings as vc
from claas_verl.mopd.trainer.balanced_passes import (  # noqa: F401 (update_row_groups: used by other modules through this one)
    alignment_pass,
    balance_metrics,
    carried_pass,
    dp_group,
    micro_batches,
    params_gathered_through_backward,
    pass_order,
    reduction,
    sequences,
    shared_step,
    step_inputs,
    targets_to,
    update_row_groups,
)
from claas_verl.mopd.trainer.loss import MOPDLoss
from claas_verl.mopd.trainer.teacher_pass import teacher_targets
from claas_verl.verl_ext.engine_device import engine_autocast
from claas_verl.verl_ext.logits_loss import SLOT_FIELD, gather_response_rows

logger = logging.getLogger(__name__)

TEACHER_KEY = "mopd_teacher"  # non-tensor key naming the teacher of a teacher forward


def _topk(data) -> int:
    return int(tu.get_non_tensor_data(data=data, key=token_fields.TOPK_KEY, default=0) or 0)


def fold_topk_outputs(output, response_mask, kept: dict, k: int):
    """Write a forward-only pass's top-κ outputs as ONE flattened-rows field per quantity (``token_fields.FOLDED``).

    The loss's logits processor hands its packed ``[1, N, κ]`` outputs past verl's per-field output handling;
    ``kept`` holds them for the whole forward (:meth:`LogitsProcessorLoss.collecting`, rows of all micro-batches in
    call order) and ``output`` carries verl's one :data:`SLOT_FIELD` per packed token, already in the batch's row
    order after verl's micro-batch reorder. Each quantity becomes the response-layout ``[B, T_b·κ]`` field the
    trainer and the loss read (:func:`claas_verl.mopd.trainer.fields.pack_rows`), on the host, before the output
    leaves the worker: TransferQueue encodes every (row, field) pair, so κ fields would cost κ × B of them.
    ``output`` is returned unchanged when it holds no slot field (a plain log-prob forward, a non-source rank).
    """
    if output is None or SLOT_FIELD not in output.keys():
        return output
    slots = output[SLOT_FIELD]
    output = output.exclude(SLOT_FIELD)
    for name in token_fields.FOLDED:
        if name not in kept:
            continue
        if kept[name].shape[-1] != k:
            raise ValueError(f"the forward's {name} holds {kept[name].shape[-1]} values per token, the batch asks "
                             f"for {token_fields.TOPK_SETTING}={k}")
        output[name] = gather_response_rows(kept[name], slots, response_mask)
    return output


class MOPDTrainingWorker(TrainingWorker):
    """verl's training worker whose step can be the balanced multi-pass update of docs/math.md §B.6/B.7.

    A batch without the non-tensor ``mopd_aux`` trains exactly like verl (one forward/backward pass, clip,
    AdamW step). A batch with it (replay steps of FSAR/SATS/OPRD recipes; recovery steps are token-only, docs/math.md
    B.8) runs, inside verl's own ``train_batch`` (so lr scheduling and metric post-processing stay verl's), a
    replacement of the engine's step, :meth:`balanced_engine_step`: verl's token pass, one pass per alignment
    term, the balanced combination written into ``.grad``, then the engine's ``optimizer_step`` (clip, step).
    """

    # set by MOPDWorker.mopd_teacher_forward: {"fingerprint": str, "targets": [AlignmentSignals per micro-batch]}
    mopd_targets: dict | None = None

    def infer_batch(self, data):
        """verl's forward-only pass; a student top-κ forward returns its ids and S as two flattened-rows fields."""
        k = _topk(data)
        if not k:
            return super().infer_batch(data)
        mask = data["response_mask"]  # read first: verl's infer_batch may pop batch keys
        with self.loss_fn.collecting() as kept:
            output = super().infer_batch(data)
        return fold_topk_outputs(output, mask, kept, k)

    def train_batch(self, data):
        aux = tu.get_non_tensor_data(data=data, key=alignment.AUX_KEY, default=None)
        if not aux:
            return super().train_batch(data)
        cfg = alignment.AuxConfig.from_dict(aux)
        engine = self.engine
        # verl fixes zero-grad -> one backward -> step in BaseEngine.train_batch; swap in the balanced step for
        # this call only (an instance attribute shadowing the engine's public method), then restore it
        engine.train_batch = functools.partial(self.balanced_engine_step, cfg=cfg, key=aux.get(alignment.DOMAIN_KEY))
        try:
            return super().train_batch(data)
        finally:
            del engine.train_batch
            self.mopd_targets = None

    def balanced_engine_step(self, data, loss_function, cfg: alignment.AuxConfig, key=None):
        """One optimizer update with g = balance(g_tok, combine_aux(g_sats, g_vr, g_hid)) (docs/math.md §B.6 eqs. 9-10).

        1. the micro-batch row groups of this update: verl's own partition of the batch (``use_dynamic_bsz`` token
           budget or ``ppo_micro_batch_size_per_gpu`` rows), the SAME for every term and for the teacher targets
           (B.6: separate backward passes over the same micro-batches);
        2. zero grads; verl's ``forward_backward_batch`` with the MOPD loss (the token pass: per micro-batch the
           token mean ℓ_tok(mb) with weight ``n_resp(mb)/n_resp``, B.7); g_tok goes to the host;
        3. per alignment term: one forward + backward per micro-batch (weight ``n_resp(mb)/n_resp``, B.7) of
           the student's signals against the teacher's bf16 targets, under the engine's autocast (like verl's
           forward); the pooled terms' unit directions accumulate on the host (``u``), the last term stays in
           ``.grad`` (:class:`claas_verl.align.HostBalancer`: one gradient vector on the device);
        4. norms and inner products over all FSDP2 shards/ranks (all-reduce over the shard group) BEFORE
           clipping; the combination is written into ``.grad`` in place;
        5. ``optimizer_step`` (clip at ``actor.optim.clip_grad``, AdamW step).

        With ``mopd.signal.balance: carried`` a step that has multipliers of an earlier exact step of its ``key``
        replaces 3-4 by :meth:`_carried_pass` (docs/math.md §B.6, "Carried balancing"); the exact steps record them.

        Separate passes per term (the MOPD paper's schedule): FSDP2 reshards after each backward, so one forward cannot
        serve several backward passes there. ``balanced_backward`` of ``claas_verl.align`` is not used because
        the token pass must be verl's engine pass (packed inputs, chunked logits processor), not a plain forward.
        """
        engine = self.engine
        tu.maybe_fix_3d_position_ids(data)
        if getattr(engine, "scaler", None) is not None:
            raise ValueError("the balanced MOPD update does not support fp16 loss scaling; use bf16 or fp32 params")
        groups = update_row_groups(data, dp_group(engine))
        # carried balancing keeps one set of multipliers per replay domain when the driver names it, else per teacher
        key = key if key is not None else (self.mopd_targets or {}).get("teacher")
        targets = self._take_targets(data, groups)
        mults = self._carried_balance(cfg).plan(key) if cfg.balance == "carried" else None
        if cfg.passes == "shared":
            outputs, metrics = self._shared_step(data, loss_function, cfg, groups, targets, mults)
            if mults is None and cfg.balance == "carried":
                self._carried_balance(cfg).record(key, {k[len("mopd/"):]: v for k, v in metrics.items()})
            return self._finish_step(outputs, metrics)
        engine.optimizer_zero_grad()
        outputs = engine.forward_backward_batch(data, loss_function, forward_only=False)
        module, params, micro, weights, layers, device = step_inputs(engine, data, cfg, groups)
        if mults is not None:
            with params_gathered_through_backward(engine):
                metrics = self._carried_pass(module, cfg.terms, mults, params, micro, weights, targets, layers,
                                             device, engine_autocast(engine, device))
        else:
            sync, group = reduction(params)
            if getattr(self, "_host_grads", None) is None:
                self._host_grads = {}  # g_tok and u on the host (pinned on CUDA), reused step after step
            hb = HostBalancer(params, variant=cfg.combine, ratio=cfg.ratio, rho=cfg.rho, sync=sync, group=group,
                              buffers=self._host_grads)
            hb.take_token()
            losses = {}
            pooled, last = pass_order(cfg)
            with params_gathered_through_backward(engine):
                for term in cfg.terms:
                    losses[term] = self._alignment_pass(module, term, micro, weights, targets, layers, device,
                                                        engine_autocast(engine, device))
                    if term in pooled:
                        hb.take_pooled(alignment.BALANCE_TERM[term])
            info = hb.finish(None if last is None else alignment.BALANCE_TERM[last])
            metrics = balance_metrics(losses, info, cfg.combine)
            if cfg.balance == "carried":
                self._carried_balance(cfg).record(key, info)
        return self._finish_step(outputs, metrics)

    def _finish_step(self, outputs: dict, metrics: dict) -> dict:
        """The engine's optimizer step (clip, AdamW) on the balanced ``.grad``; the step's metrics join verl's."""
        engine = self.engine
        grad_norm = engine.optimizer_step()
        if engine.is_mp_src_rank_with_outputs():
            outputs["metrics"]["grad_norm"] = grad_norm
            for name, value in metrics.items():
                outputs["metrics"][name] = [value]  # a list per rank: verl concatenates them over ranks
        return outputs

    def _shared_step(self, data, loss_function, cfg, groups, targets, mults) -> tuple[dict, dict]:
        return shared_step(self.engine, data, loss_function, cfg, groups, targets, mults)

    _carried_pass = staticmethod(carried_pass)  # the tests call the passes on a bare model
    _alignment_pass = staticmethod(alignment_pass)

    def _carried_balance(self, cfg: alignment.AuxConfig) -> CarriedBalance:
        """The worker's carried multipliers (``mopd.signal.balance: carried``), kept across steps in this process
        and in the run's checkpoints (:meth:`carried_state`); a changed ``balance_refresh`` starts them afresh."""
        state = getattr(self, "_carried", None)
        if state is None or state.refresh != cfg.balance_refresh:
            state = self._carried = CarriedBalance(cfg.balance_refresh)
        return state

    def carried_state(self) -> dict | None:
        """The carried multipliers per key and their uses (JSON-able), or None before any carried step."""
        state = getattr(self, "_carried", None)
        return None if state is None else state.state_dict()

    def load_carried_state(self, state: dict | None) -> None:
        """Restore :meth:`carried_state` of a checkpoint: the next replay step of a key is then carried or exact
        exactly as it would have been without the restart."""
        if state is None:
            self._carried = None
            return
        carried = CarriedBalance(int(state["refresh"]))
        carried.load_state_dict(state)
        self._carried = carried

    def _take_targets(self, data, groups: list[list[int]]) -> list:
        held, self.mopd_targets = self.mopd_targets, None
        fingerprint = alignment.batch_fingerprint(sequences(data))
        if held is None:
            raise ValueError(
                "balanced MOPD update without teacher alignment targets: the step's teacher forward must run with "
                f"the same non-tensor {alignment.AUX_KEY!r} on this worker first (MOPDTrainer does this)"
            )
        if held["fingerprint"] != fingerprint:
            raise ValueError(
                "the teacher's alignment targets were computed for other rows than this update batch "
                f"({held['fingerprint']} != {fingerprint}): keep one mini-batch per step (ppo_mini_batch_size = "
                "mopd.block_size) and no shuffling"
            )
        if held["groups"] != groups:
            raise ValueError(
                f"the teacher's alignment targets were computed for micro-batches {held['groups']} but the update "
                f"partitions the batch as {groups}: both must use the actor's use_dynamic_bsz / "
                "ppo_max_token_len_per_gpu / ppo_micro_batch_size_per_gpu"
            )
        return held["targets"]


class MOPDWorker(ActorRolloutRefWorker):
    """Student actor + rollout + the current stage's teachers, in one colocated Ray worker."""

    actor_worker_cls = MOPDTrainingWorker

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        super().init_model()
        self.teachers: dict[str, TrainingWorker] = {}
        self.teacher_paths: dict[str, str] = {}
        if self.actor is None:
            raise ValueError("the MOPD worker needs the actor role (actor_rollout)")
        actor_config: ActorConfig = omega_conf_to_dataclass(self.config.actor)
        self.loss_fn = MOPDLoss(actor_config=actor_config)
        self.actor.set_loss_fn(self.loss_fn)
        # teachers run on the same ranks with the same data-parallel layout as the student
        self.set_dispatch_collect(mesh_name="teacher", **self.actor.get_dispatch_collect())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def mopd_set_teachers(self, specs: dict[str, str], teacher_dtype: str = "fp32_bf16_autocast") -> list[str]:
        """Hold exactly the teachers ``{plan name: HF path}``: drop the others, build the missing ones
        (weights and forward precision per ``mopd.train.teacher_dtype``, docs/math.md §B.1)."""
        for name in list(self.teachers):
            if name not in specs or self.teacher_paths[name] != specs[name]:
                del self.teachers[name]
                del self.teacher_paths[name]
        for name, path in specs.items():
            if name in self.teachers:
                continue
            worker = TrainingWorker(config=vc.teacher_training_config(self.config, path, teacher_dtype))
            worker.reset()
            vc.apply_teacher_dtype(worker.engine, teacher_dtype)
            worker.set_loss_fn(MOPDLoss(actor_config=None))
            self.teachers[name] = worker
            self.teacher_paths[name] = path
        import gc

        gc.collect()
        return sorted(self.teachers)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="teacher"))
    def mopd_teacher_forward(self, data):
        name = tu.get_non_tensor_data(data=data, key=TEACHER_KEY, default=None)
        if name not in self.teachers:
            raise ValueError(f"teacher {name!r} is not loaded on this worker (held: {sorted(self.teachers)})")
        if tu.get_non_tensor_data(data=data, key=token_fields.PHASE_KEY, default=None) != token_fields.PHASE_TEACHER:
            raise ValueError(f"mopd_teacher_forward needs {token_fields.PHASE_KEY}={token_fields.PHASE_TEACHER!r}")
        aux = tu.get_non_tensor_data(data=data, key=alignment.AUX_KEY, default=None)
        if aux:
            # alignment targets of the last W response tokens (bf16), kept in this process for the colocated
            # student update of the same step (TransferQueue cannot carry [B, T, K]-shaped fields)
            groups = update_row_groups(data, dp_group(self.actor.engine), self._update_partition())
            cfg = alignment.AuxConfig.from_dict(aux)
            # passes=shared: the targets' forward also gives Q (verl's separate log-prob pass is not run)
            held, output = teacher_targets(self.teachers[name], data, cfg, groups,
                                           with_q=_topk(data) if cfg.passes == "shared" else 0)
            self.actor.mopd_targets = {**held, "teacher": name}  # the teacher: carried balancing's fallback key
            if output is not None:
                return output
        k = _topk(data)
        mask = data["response_mask"] if k else None
        teacher = self.teachers[name]
        with teacher.loss_fn.collecting() as kept:
            output = teacher.infer_batch(data)
        output = fold_topk_outputs(output, mask, kept, k)
        return output.cpu() if output is not None else None

    def _teacher_targets(self, teacher: TrainingWorker, data, cfg: alignment.AuxConfig,
                         groups: list[list[int]]) -> dict:
        """docs/math.md §B.3-B.5 teacher side: detached bf16 host targets per micro-batch of the update's partition
        ``groups``, bounded in host RAM (:func:`claas_verl.mopd.trainer.teacher_pass.teacher_targets`)."""
        return teacher_targets(teacher, data, cfg, groups)[0]

    def _update_partition(self) -> dict:
        """The actor's micro-batch settings, as ``TrainingWorker.train_batch`` hands them to its engine."""
        ec = self.actor.engine_config
        return {"use_dynamic_bsz": ec.use_dynamic_bsz, "max_token_len_per_gpu": ec.max_token_len_per_gpu,
                "micro_batch_size_per_gpu": ec.micro_batch_size_per_gpu}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def mopd_reset_optimizer(self) -> int:
        return vc.reset_engine_optimizer(self.actor.engine)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def mopd_optimizer_steps(self) -> int:
        return vc.optimizer_step_count(self.actor.engine)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def mopd_carried_state(self) -> dict | None:
        """``mopd.signal.balance: carried``: this rank's carried multipliers, saved with the run's checkpoint (every
        rank holds the same ones: they come from all-reduced norms)."""
        return self.actor.carried_state()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def mopd_carried_load(self, state: dict | None) -> None:
        self.actor.load_carried_state(state)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def mopd_probe_logprobs(self, ids: list[int], targets: list[list[int]]) -> list[list[float]]:
        """The student's log-probabilities ``log p(targets[r][j] | ids[:j+1])``
        (:func:`claas_verl.verl_ext.weight_probe.engine_prefix_logprobs`)."""
        from claas_verl.verl_ext.weight_probe import engine_prefix_logprobs

        return engine_prefix_logprobs(self.actor.engine, ids, targets)
