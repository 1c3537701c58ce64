"""SDPO inside verl's actor worker: EMA teacher over the LoRA adapter, teacher top-K on the re-prompted context.

docs/math.md §A.3.3. The SDPO loss needs, per response token, the student's full-vocabulary log-probs at its top-K ids
(with grad) and the EMA teacher's at the same ids on the feedback re-prompted context x'. verl's engine shows
a model's full logits only to a loss function's logits-processor form, so one update step runs as:

1. **pre-pass** (:meth:`ClaasSdpoTrainingWorker.train_mini_batch`, no grad, student weights): the student's
   top-K ids on (x, y);
2. **teacher pass** (EMA LoRA swapped into the same module, :meth:`EmaTeacher.swapped_into`): the teacher's
   full-vocabulary log-probs at those ids on (x', y), its log-prob of y_j (``pg+jsd``) and, with
   ``is_reference=ema_teacher``, its sequence log-prob of y on the student context x;
   both are added to the batch, the K values per token as ONE flattened-rows field per quantity
   (:data:`IDS`, :data:`TEACHER_LP`; :func:`claas_verl.verl_ext.topk_fields.pack_rows`: a ``[B, T, K]`` field does
   not survive verl's nested-tensor utilities, and verl's mini/micro-batch split keeps each row's values), then
3. verl's own ``train_mini_batch`` runs the update with :class:`ClaasSdpoLoss`, a
   :class:`claas_verl.verl_ext.logits_loss.LogitsProcessorLoss`: its logits processor returns the differentiable
   student log-probs at the stored ids and at the sampled tokens (one packed ``[1, N, K + 1]`` tensor, handed to
   the loss of the same micro-batch past verl's per-field output handling), its loss calls
   :func:`claas_verl.losses.sdpo.sdpo_loss`. verl computes no log-probs of its own in this forward
   (:data:`UPDATE_FLAGS`);
4. after an APPLIED optimizer step with a finite gradient norm: ``θ_T ← (1−τ)θ_T + τθ`` over the LoRA tensors.
   A step whose minibatch has no self-distillation token (``gjs`` mode) is skipped (docs/math.md §A.2.4).

The student's top-K ids come from a padded forward before the update and are then FIXED for the update forward:
the parameters are the same (one optimizer step per sampled minibatch), so they are the student's top-K up to
float noise between the two forward layouts; student and teacher are always compared at the same ids.

Every private verl name used here is listed in :mod:`claas_verl.claas.trainer.verl_couplings`.
Memory note: the pre/teacher passes keep the forward's logits on the device in the model's dtype and reduce them
there in chunks of response positions (:func:`response_logprob_stats`): only top-K ids and gathered log-probs reach
the host, so a 152k vocabulary fits.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils import tensordict_utils as tu
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from claas_verl.claas.trainer import verl_couplings as vc
from claas_verl.claas.trainer.tq_fields import HAS_FEEDBACK_FIELD, TEACHER_PROMPT_FIELD
from claas_verl.claas.trainer.worker import ClaasProbeMixin
from claas_verl.distill import topk_logprobs
from claas_verl.losses.sdpo import EmaTeacher, sdpo_loss
from claas_verl.losses.seq_is import seq_is_clipped_loss
from claas_verl.utils.host_sync import metrics_to_floats
from claas_verl.verl_ext.logits_loss import LogitsProcessorLoss
from claas_verl.verl_ext.packed_batch import padded
from claas_verl.verl_ext.topk_fields import pack_row_list, unpack_rows

logger = logging.getLogger(__name__)

IDS = "sdpo_ids"  # student top-K ids, response layout, flattened rows [B, T_b*K]
TEACHER_LP = "sdpo_tlp"  # EMA-teacher log-probs at those ids on x', response layout, flattened rows [B, T_b*K]
TEACHER_LP_Y = "sdpo_tlp_y"  # EMA-teacher log-prob of the sampled token on x' (pg+jsd)
IS_REF = "sdpo_is_ref"  # [B] EMA-teacher sequence log-prob of y on x (is_reference=ema_teacher)
# the update processor's packed [1, N, K + 1] output (with grad): log-probs at the stored ids, then at the sampled token
CURRENT_LP = "sdpo_clp"
# Non-tensor keys of the update forward. distillation_use_topk: verl's engine calls the loss's logits-processor
# form. distillation_only: verl then computes no sampled-token log-probs of its own; the processor returns them
# (CURRENT_LP's last column). With flash-attn installed verl would take them from flash-attn's cross-entropy with
# inplace_backward=True, whose backward overwrites the logits tensor with its gradient; the processor's
# backward (claas_verl.distill.topk_logprobs) reads those logits again (pg+jsd backpropagates through both).
UPDATE_FLAGS = {"distillation_use_topk": True, "distillation_only": True}
TOPK_SETTING = "claas.sdpo.topk"


def _rows(x: torch.Tensor) -> list[torch.Tensor]:
    return list(x.unbind()) if getattr(x, "is_nested", False) else list(x)


def _as_response_field(values: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Per-row ``[R_b]`` tensors in the layout of ``response_mask`` (nested jagged, or right-padded ``[B, T]``)."""
    if getattr(like, "is_nested", False):
        return torch.nested.nested_tensor([v.contiguous() for v in values], layout=torch.jagged)
    out = torch.zeros((len(values), like.shape[1]), dtype=values[0].dtype)
    for b, v in enumerate(values):
        out[b, : v.shape[0]] = v
    return out


def teacher_fields(ids: list[torch.Tensor], t_lp: list[torch.Tensor], t_y: list[torch.Tensor],
                   is_ref: list[torch.Tensor], response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The batch fields of the pre/teacher passes, from per-row ``[R_b, K]`` ids / teacher log-probs, ``[R_b]``
    teacher log-probs of y and (``is_reference=ema_teacher``) scalar sequence log-probs.

    The K-wide quantities become ONE flattened-rows field each whatever K is (:data:`IDS`, :data:`TEACHER_LP`);
    the teacher log-prob of y follows ``response_mask``'s layout (nested, or right-padded ``[B, T]``)."""
    out = {IDS: pack_row_list([i.long() for i in ids]), TEACHER_LP: pack_row_list([t.float() for t in t_lp]),
           TEACHER_LP_Y: _as_response_field([t.float() for t in t_y], response_mask)}
    if is_ref:
        out[IS_REF] = torch.stack(is_ref).float()
    return out


@torch.no_grad()
def response_logprob_stats(module, sequences: list[torch.Tensor], resp_lens: list[int], device, *, topk: int = 0,
                           at_ids: list[torch.Tensor] | None = None, at_tokens: bool = False,
                           chunk_tokens: int = 512) -> list[dict[str, torch.Tensor]]:
    """Reductions of the full-vocabulary log-softmax at each row's response positions (one padded forward).

    Per row, on the host: ``"topk"`` the ``[R, topk]`` ids of the largest log-probs (if ``topk``), ``"at_ids"`` the
    ``[R, K]`` fp32 log-probs at ``at_ids[b]`` (if given) and ``"at_tokens"`` the ``[R]`` fp32 log-probs of the
    response tokens themselves (if ``at_tokens``). The log-softmax runs on the device in chunks of ``chunk_tokens``
    positions, so at most ``[chunk_tokens, V]`` fp32 exists at a time and nothing of size V leaves the device: a
    152k vocabulary costs ``chunk_tokens * V * 4`` bytes of scratch (312 MB at 512), not ``[rows, L, V]`` fp32 copies
    on the host. The forward's own ``[rows, L, V]`` logits stay in the model's dtype on the device.
    """
    L = max(int(s.shape[0]) for s in sequences)
    ids = torch.zeros((len(sequences), L), dtype=torch.long)
    attn = torch.zeros((len(sequences), L), dtype=torch.long)
    for b, s in enumerate(sequences):
        ids[b, : s.shape[0]] = s
        attn[b, : s.shape[0]] = 1
    pos = torch.arange(L).expand(len(sequences), L)
    logits = module(input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=pos.to(device),
                    use_cache=False).logits
    out = []
    for b, s in enumerate(sequences):
        n, r = int(s.shape[0]), int(resp_lens[b])
        parts: dict[str, list[torch.Tensor]] = {"topk": [], "at_ids": [], "at_tokens": []}
        tokens = s[n - r:].to(device).long()
        for a in range(0, r, chunk_tokens):
            e = min(r, a + chunk_tokens)
            lp = torch.log_softmax(logits[b, n - r - 1 + a: n - 1 - r + e].float(), dim=-1)  # [c, V] on device
            if topk:
                parts["topk"].append(lp.topk(min(topk, lp.shape[-1]), dim=-1).indices.cpu())
            if at_ids is not None:
                parts["at_ids"].append(lp.gather(-1, at_ids[b][a:e].to(device)).cpu())
            if at_tokens:
                parts["at_tokens"].append(lp.gather(-1, tokens[a:e, None]).squeeze(-1).cpu())
            del lp
        out.append({k: torch.cat(v) for k, v in parts.items() if v})
    del logits
    return out


class ClaasSdpoLoss(LogitsProcessorLoss):
    """verl loss callable of the SDPO update (both call forms of verl's engine; see the module docstring)."""

    needed_by = "the CLaaS SDPO update"

    def __init__(self, sdpo: dict, actor_config: Any):
        self.cfg = dict(sdpo)
        self.actor_config = actor_config
        self.k: int = int(self.cfg["topk"])
        self.global_sd_tokens: float = 0.0  # Σ m·sd_mask over the global minibatch, set before each update
        self.global_tokens: float = 0.0

    def compute_loss(self, model_output, data, dp_group=None, packed: dict | None = None):
        return self.update_loss(packed, data)

    def process_logits(self, logits: torch.Tensor, data) -> dict[str, torch.Tensor]:
        """Packed ``[1, N, V]`` logits -> ``[1, N, K + 1]``: differentiable log π_θ at the stored top-K ids and
        at the token each position predicts (verl's ``input_ids_rmpad_rolled``), from ONE chunked node."""
        ids = self.stored_packed_ids(data, IDS, self.k, logits.shape[1], logits.device, TOPK_SETTING)  # [1, N, K]
        tokens = data["input_ids"].values().to(logits.device)
        sampled = torch.zeros((1, logits.shape[1], 1), dtype=torch.long, device=logits.device)
        sampled[0, : tokens.shape[0], 0] = torch.roll(tokens, -1)  # position i predicts token i + 1
        lp = topk_logprobs(logits, torch.cat([ids, sampled], -1))  # [1, N, K + 1] fp32, full-vocabulary, with grad
        return {CURRENT_LP: lp}

    def update_loss(self, packed: dict, data):
        from verl.utils.metric import AggregationType, Metric

        c = self.cfg
        lp = self.response_rows(packed[CURRENT_LP], data)  # [B, T_r, K + 1]
        s_k, log_prob = lp[..., : self.k], lp[..., self.k]  # [B, T_r, K], [B, T_r], with grad
        dev = s_k.device
        t_k = unpack_rows(data[TEACHER_LP], self.k, TEACHER_LP, TOPK_SETTING).to(dev)
        mask = padded(data["response_mask"]).to(dev).bool()
        width = mask.shape[1]
        if t_k.shape != s_k.shape or mask.shape != s_k.shape[:2]:
            raise ValueError(f"CLaaS SDPO update: teacher log-probs {tuple(t_k.shape)}, student log-probs "
                             f"{tuple(s_k.shape)} and response_mask {tuple(mask.shape)} disagree; the stored fields "
                             "were written for another batch layout")
        sd = data[HAS_FEEDBACK_FIELD].to(dev).view(-1).bool()
        behaviour = padded(data["old_log_probs"] if "old_log_probs" in data.keys() else data["rollout_log_probs"])
        is_ref = data[IS_REF].to(dev).float().view(-1) if c["is_reference"] == "ema_teacher" else behaviour.to(dev)
        dp_size = int(data["dp_size"]) if "dp_size" in data.keys() else 1
        # s_k/t_k hold the FULL-vocabulary log-probs at the student's K ids: sdpo_loss's top-K over these K columns
        # selects all of them and its tail bucket log(1 − Σ_K p) is the same as over V (GJS is order-free).
        loss, metrics = sdpo_loss(
            s_k, t_k, log_prob, is_ref, mask, sd, mode="gjs", alpha=c["alpha"], topk=self.k,
            add_tail=c["add_tail"], is_clip=c["is_clip"], ratio_mode=c["ratio_mode"], loss_agg_mode="token-mean",
            global_sd_tokens=max(self.global_sd_tokens, 1.0), dp_size=dp_size,
        )
        if c["mode"] == "pg+jsd":
            # Same formula as sdpo_loss(mode="pg+jsd"): A_j = sg(ℓT(y_j) − ℓS(y_j)); the teacher's log-prob of y_j
            # is carried as its own field because y_j need not be among the student's top-K ids.
            t_y = padded(data[TEACHER_LP_Y]).to(dev).float()[:, :width]
            adv = (t_y - log_prob.detach().float()) * mask.float()
            pg, pg_metrics = seq_is_clipped_loss(
                log_prob, behaviour.to(dev), adv, mask, ratio_mode=c["ratio_mode"],
                clip_ratio_low=self.actor_config.clip_ratio_low, clip_ratio_high=self.actor_config.clip_ratio_high,
                clip_ratio_c=self.actor_config.clip_ratio_c, loss_agg_mode="token-mean",
                global_tokens=max(self.global_tokens, 1.0), dp_size=dp_size,
            )
            loss = pg + c["jsd_coef"] * loss
            metrics.update(pg_metrics)
            metrics["actor/sdpo_pg_loss"] = pg.detach()
        # every metric and the loss read in ONE host transfer (verl's Metric would .item() each tensor: one sync each)
        values = metrics_to_floats({**metrics, "sdpo/loss": loss.detach()})
        out = {"sdpo/loss": Metric(value=values.pop("sdpo/loss"), aggregation=AggregationType.SUM)}
        out.update(Metric.from_dict(values, aggregation=AggregationType.MEAN))
        return loss, out


class ClaasSdpoTrainingWorker(TrainingWorker):
    """verl's training worker with the SDPO pre-pass, teacher pass, update and EMA step (module docstring)."""

    sdpo: dict | None = None
    ema: EmaTeacher | None = None
    probe: dict | None = None

    def sdpo_setup(self, sdpo: dict, actor_config: Any) -> None:
        self.sdpo = dict(sdpo)
        self.ema = EmaTeacher(self.engine.module, tau=float(sdpo["tau"]), scope="lora")  # θ_T = θ⁰
        self.loss_fn_sdpo = ClaasSdpoLoss(sdpo, actor_config)
        self.set_loss_fn(self.loss_fn_sdpo)
        self.probe = {"ema_updates": 0, "steps_applied": 0, "steps_skipped": 0}

    def train_mini_batch(self, data):
        if self.sdpo is None:
            raise ValueError("ClaasSdpoTrainingWorker: claas_sdpo_setup was not called (the CLaaS trainer does it)")
        loss_fn = self.loss_fn_sdpo
        n_sd, n_tok = self._add_teacher_fields(data)
        loss_fn.global_sd_tokens, loss_fn.global_tokens = n_sd, n_tok
        tu.assign_non_tensor(data, **UPDATE_FLAGS)
        skip = self.sdpo["mode"] == "gjs" and n_sd == 0  # docs/math.md §A.2.4: no training signal -> no optimizer step
        with vc.shadow_optimizer_step(self.engine, skip=skip) as step:
            output = super().train_mini_batch(data)
        applied = step["applied"]
        self.probe["steps_applied" if applied else "steps_skipped"] += 1
        if applied:
            self._ema_step()
        return output

    # ------------------------------------------------------------------ passes
    def _add_teacher_fields(self, data) -> tuple[float, float]:
        c, k = self.sdpo, 1
        module = vc.engine_module(self.engine)
        _, resp = self.loss_fn_sdpo.lengths(data)
        full = _rows(data["input_ids"])
        teacher_prompts = _rows(data[TEACHER_PROMPT_FIELD])
        has_fb = data[HAS_FEEDBACK_FIELD].view(-1).cpu()
        responses = [s[-int(r):].cpu() for s, r in zip(full, resp.tolist())]
        teacher_seqs = [torch.cat([p.cpu(), y]) for p, y in zip(teacher_prompts, responses)]
        resp_l = resp.tolist()
        rows = max(1, int(getattr(self.engine_config, "micro_batch_size_per_gpu", None) or len(full)))
        device = vc.module_device(module)
        ids, t_lp, t_y, is_ref = [], [], [], []
        with self.engine.eval_mode(), torch.no_grad():
            for a in range(0, len(full), rows):
                sl = slice(a, a + rows)
                stats = response_logprob_stats(module, [x.cpu() for x in full[sl]], resp_l[sl], device,
                                               topk=int(c["topk"]))
                ids += [x["topk"] for x in stats]
                k = int(ids[0].shape[-1])
            with self.ema.swapped_into(module):
                for a in range(0, len(full), rows):
                    sl = slice(a, a + rows)
                    stats = response_logprob_stats(module, teacher_seqs[sl], resp_l[sl], device, at_ids=ids[sl],
                                                   at_tokens=True)
                    t_lp += [x["at_ids"] for x in stats]
                    t_y += [x["at_tokens"] for x in stats]
                    if c["is_reference"] == "ema_teacher":
                        own = response_logprob_stats(module, [x.cpu() for x in full[sl]], resp_l[sl], device,
                                                     at_tokens=True)
                        is_ref += [x["at_tokens"].double().sum() for x in own]
        for name, value in teacher_fields(ids, t_lp, t_y, is_ref, data["response_mask"]).items():
            data[name] = value
        self.loss_fn_sdpo.k = k
        counts = torch.tensor([float((resp * (has_fb > 0)).sum()), float(resp.sum())], dtype=torch.float64)
        return vc.all_reduce_sum(counts)

    def _ema_step(self) -> None:
        module = vc.engine_module(self.engine)
        before = _lora_sum(self.ema.params.values())
        self.ema.update(module)
        student = _lora_sum(p for n, p in module.named_parameters() if "lora_" in n)
        self.probe.update(ema_updates=self.ema.num_updates, teacher_sum_before=before,
                          teacher_sum_after=_lora_sum(self.ema.params.values()), student_sum=student,
                          tau=self.ema.tau)


def _lora_sum(tensors) -> float:
    """Σ of every element of the (local shards of the) LoRA tensors: θ_T' = (1−τ)θ_T + τθ is linear, so the sums obey
    the same relation exactly (up to float rounding); the probe the end-to-end test checks."""
    total = 0.0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += float(t.detach().double().sum())
    return total


class ClaasSdpoWorker(ClaasProbeMixin, ActorRolloutRefWorker):
    """verl's hybrid actor/rollout worker whose actor runs the SDPO update (registered methods below)."""

    actor_worker_cls = ClaasSdpoTrainingWorker

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def claas_sdpo_setup(self, sdpo: dict) -> bool:
        from verl.utils.config import omega_conf_to_dataclass

        if self.actor is None:
            raise ValueError("the CLaaS SDPO worker needs the actor role (actor_rollout)")
        self.actor.sdpo_setup(sdpo, omega_conf_to_dataclass(self.config.actor))
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def claas_sdpo_save(self, claas_dir: str) -> str:
        """Checkpoint: this rank's EMA teacher (local shards) and bookkeeping, atomically, into ``claas_dir``."""
        from claas_verl.claas.trainer.resume import save_teacher_state

        if self.actor.ema is None:
            raise ValueError("the SDPO EMA teacher is not set up (claas_sdpo_setup was not called)")
        return save_teacher_state(self.actor.ema, self.actor.probe, claas_dir, _rank())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def claas_sdpo_load(self, claas_dir: str) -> dict:
        """Resume: restore this rank's EMA teacher from ``claas_dir``. Returns its EMA step count and the sha256 of the
        restored teacher tensors and of the student's LoRA tensors as loaded (fp32, the teacher's dtype): a teacher
        that was not restored would be the student's copy (``claas_sdpo_setup``), so the two must differ."""
        from claas_verl.claas.trainer.resume import load_teacher_state, tensors_sha256

        if self.actor.ema is None:
            raise ValueError("the SDPO EMA teacher is not set up (claas_sdpo_setup was not called)")
        self.actor.probe = load_teacher_state(self.actor.ema, claas_dir, _rank())
        module = vc.engine_module(self.actor.engine)
        student = {n: p.detach().float() for n, p in module.named_parameters() if n in self.actor.ema.params}
        return {"ema_steps": self.actor.ema.num_updates, "teacher_sha256": tensors_sha256(self.actor.ema.params),
                "student_lora_sha256": tensors_sha256(student)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def claas_sdpo_probe(self) -> dict:
        """EMA-teacher bookkeeping of the last update (sums of the LoRA tensors, counts of applied steps)."""
        return dict(self.actor.probe or {})


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

