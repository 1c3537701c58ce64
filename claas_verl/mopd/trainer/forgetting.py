"""The held-out forgetting evaluation of a continual MOPD run (``mopd.eval``).

Before a stage's first update, the KL from the student to the expert of every domain the stage teaches; at a stage
end, to the expert of every domain learned so far (``forgetting.jsonl`` / ``forgetting.md``, see
:mod:`claas_verl.mopd.trainer.forgetting_table`). A stage end that a crash lost is measured again before the next step.

verl validates only from its own dataloader, so the evaluation drives verl's ``val`` partition by hand: the
held-out prompts go through the agent loop, the sampler returns the samples, the student's top-k forward and the
domain expert's forward score them as a training step would (docs/math.md §B.2), and the rollout replicas get the
student's weights back afterwards.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import transfer_queue as tq
from verl.utils import tensordict_utils as tu

from claas_verl.distill import topk_binned_kl, topk_weighted_kl
from claas_verl.mopd.config import EvalConfig
from claas_verl.mopd.trainer.blocks import prompt_batch
from claas_verl.mopd.trainer.forgetting_table import (
    FORGETTING_MD,
    append_forgetting,
    forgetting_table,
    read_forgetting,
    stage_end_measured,
)
from claas_verl.mopd.trainer.plan_steps import learned_domains, taught_domains
from claas_verl.verl_ext.packed_batch import padded


class ForgettingEval:
    """Stage-start and stage-end KL to the experts on held-out prompts; ``datasets`` maps domain -> held-out set."""

    def __init__(self, trainer, settings: EvalConfig):
        self.trainer = trainer  # the MOPD trainer: its workers, rollout, sampler and step math
        self.enabled, self.prompts = settings.enabled, settings.prompts
        self.datasets: dict = {}
        self.pending_end: tuple[int, int] | None = None  # (stage, its last global step) a crash left unmeasured

    @property
    def plan_steps(self) -> list[dict]:
        return self.trainer.plan_steps

    def stage_start(self, stage: int, global_steps: int) -> None:
        """Before ``stage``'s first update: the replicas still serve the weights of global step - 1."""
        if self.enabled:
            self.evaluate(stage, "start", taught_domains(self.plan_steps, stage), global_steps - 1)

    def stage_end(self, stage: int, global_steps: int) -> None:
        """At ``stage``'s end: the stage-final student against every domain learned so far."""
        if self.enabled:
            self.evaluate(stage, "end", learned_domains(self.plan_steps, global_steps - 1), global_steps)

    def note_resume(self, state: dict, global_steps: int) -> None:
        """A checkpoint at a stage end whose evaluation is not in the table: measure it before the next step."""
        if (state["stage_complete"] and self.enabled and global_steps < len(self.plan_steps)
                and not stage_end_measured(read_forgetting(self.trainer.run_dir), state["stage"])):
            self.pending_end = (state["stage"], global_steps)

    def run_pending(self) -> None:
        if self.pending_end is None:
            return
        stage, gs = self.pending_end
        self.pending_end = None
        print(f"[mopd] resumed after stage {stage} ended: re-running its lost stage-end forgetting evaluation")
        self.evaluate(stage, "end", learned_domains(self.plan_steps, gs - 1), gs)

    def evaluate(self, stage: int, at: str, domains: list[str], version: int) -> None:
        """Measure ``domains`` (those with held-out prompts) at weight ``version``; append the rows, rewrite the
        tables."""
        rows = []
        for d in domains:
            if d not in self.datasets:
                continue
            measured = self.measure(d, version)
            rows.append({"stage": stage, "at": at, "global_step": version, "domain": d, **measured})
            print(f"[mopd] stage {stage} {at}: KL(student || E[{d}]) = {measured['kl']:.4f} "
                  f"(binned {measured['kl_binned']:.4f}), score {measured['score']:.3f}")
        if not rows:
            return
        run_dir = self.trainer.run_dir
        append_forgetting(run_dir, rows)
        table = forgetting_table(read_forgetting(run_dir), title=self.trainer.config.trainer.experiment_name)
        with open(os.path.join(run_dir, FORGETTING_MD), "w") as f:
            f.write(table + "\n")

    def measure(self, domain: str, version: int) -> dict[str, float]:
        """Sample the student on ``domain``'s held-out prompts; return ``kl`` (the student-weighted top-k KL to the
        domain's expert, as the MOPD paper logs it), ``kl_binned`` (the (k+1)-bin KL, a non-negative lower bound of the
        full-vocabulary KL) and ``score`` (mean reward).

        ``version``: the weight version the rollout replicas serve (tags the rollout and the weight re-sync).
        """
        t = self.trainer
        ds = self.datasets[domain]
        rows = range(min(self.prompts, len(ds)))
        batch = prompt_batch(ds, rows, version)
        tu.assign_non_tensor_data(batch, "validate", True)
        tags = [{"is_prompt": True, "status": "pending", "global_steps": version} for _ in rows]
        tq.kv_batch_put(keys=list(batch["uid"]), partition_id="val", tags=tags)
        t.agent_loop_manager.generate_sequences(batch)
        meta, _ = t.replay_buffer.sample(global_steps=version, partition_id="val", batch_size=len(rows))
        t.checkpoint_manager.sleep_replicas()
        try:
            meta = t._balance_batch(meta, metrics={})
            expert = t.teachers.load_expert(t.actor_rollout_wg, domain)
            t.distill.student_topk(meta, t.actor_rollout_wg)  # reorders the rows (canonical_row_order): tags after
            real = np.array([not tag.get("is_padding", False) for tag in meta.tags])
            Sx, Q, mask, _ = t.distill.teacher_q(meta, t.actor_rollout_wg, expert)
            sel = torch.as_tensor(real)
            kl = float(topk_weighted_kl(Sx[sel], Q[sel], mask[sel]))
            kl_binned = float(topk_binned_kl(Sx[sel], Q[sel], mask[sel]))
            scores = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=["rm_scores"])
            score = float(padded(scores["rm_scores"]).sum(-1)[sel].mean())
        finally:
            tq.kv_clear(keys=meta.keys, partition_id=meta.partition_id)
            t.checkpoint_manager.update_weights(version)
        return {"kl": kl, "kl_binned": kl_binned, "score": score}
