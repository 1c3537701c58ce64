"""The CLaaS actor worker: verl's ``ActorRolloutRefWorker`` plus the trainer's side of the weight-sync probe.

After every adapter push the CLaaS trainer asks the rollout replicas for a fixed probe's greedy tokens and their
served log-probs, and the actor for its own log-probs at the same tokens
(:mod:`claas_verl.verl_ext.weight_probe`); a mismatch beyond ``claas.weight_sync_max_abs_diff`` stops the job.
:class:`ClaasProbeMixin` is mixed into every CLaaS actor worker (this one, the SDPO worker, the tenants workers).
"""

from __future__ import annotations

from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker


class ClaasProbeMixin:
    """``claas_probe_logprobs``: the actor's log-probs at the probe's targets (every rank runs the forward)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def claas_probe_logprobs(self, ids: list[int], targets: list[list[int]]) -> list[list[float]]:
        from claas_verl.verl_ext.weight_probe import engine_prefix_logprobs

        if self.actor is None:
            raise ValueError("the weight-sync probe needs the actor role (actor_rollout)")
        return engine_prefix_logprobs(self.actor.engine, ids, targets)


class ClaasWorker(ClaasProbeMixin, ActorRolloutRefWorker):
    """verl's hybrid actor/rollout worker with the probe method (REINFORCE++, PPO)."""
